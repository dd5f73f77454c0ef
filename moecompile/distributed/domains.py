"""Expert domains (HybridEP, hybridep.md §IV): ``parallelize(..., expert_domains={"node": 2})``.

The mesh's dimensions are the multilevel description (outermost first; each level's scaling factor its size), and
``expert_domains`` gives, per level, how many of its workers form one domain (1 where a level is not named). Each
rank still owns its E / W experts (their parameters, gradients and optimizer state, its state_dict shard); in each
forward it all-gathers the experts of its domain (``moe.domain_gather``: the ranks of the same domain at every
level) and computes its own tokens for them; tokens for other domains' experts go padding-free to the rank at the
same offset in the expert's domain (the ranks of equal offsets at every level: the exchange group, each of which
holds one domain's experts) and come back combined. Backward: each gathered copy's gradient summed back to the
owner; token gradients return the way the tokens came. Chained over the levels, Algorithm 1's all-gathers and
all-to-alls (``runtime/comm/hybrid.py``) reach exactly these two groups; the rows go in one exchange.

Within the exchange group, member j holds its domain's ranks' experts in rank order, which need not be the
experts' order (domains over an outer level only): each expert's slot in that order is a buffer of the module
(``DOMAIN_SLOTS``), by which the rows are sorted before they are sent (``moe.ep_to_slots``, as expert swap does).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from moecompile.runtime.comm import hybrid

from .mesh import level_names


@dataclass
class Domains:
    """This rank's domain group (the ranks whose experts it gathers) and exchange group (the ranks it sends tokens
    to), their sizes per level, and each expert's slot (``slots(E)``)."""

    sizes: dict[str, int]
    domain_group: object
    exchange_group: object
    gather_ranks: list[int]
    exchange_ranks: list[int]
    mesh_shape: tuple[int, ...]
    domain_sizes: tuple[int, ...]

    def slots(self, num_experts: int) -> torch.Tensor:
        """Expert -> its slot in the exchange group's gathered order (every rank's the same)."""
        world = len(self.gather_ranks) * len(self.exchange_ranks)
        per_rank = num_experts // world
        order = []  # the owners, in the order the exchange group's members hold their domains' experts
        for member in self.exchange_ranks:
            order += hybrid.groups(member, self.mesh_shape, self.domain_sizes)[0]
        slot_of_rank = {owner: i for i, owner in enumerate(order)}
        expert = torch.arange(num_experts)
        return torch.tensor([slot_of_rank[int(e) // per_rank] for e in expert]) * per_rank + expert % per_rank

    def describe(self) -> str:
        return (f"expert domains {self.sizes}: the experts of ranks {self.gather_ranks} gathered here, tokens for "
                f"other domains' experts exchanged with ranks {self.exchange_ranks}")


def check(expert_domains, compress, mesh, **others) -> dict[str, int] | None:
    """The domain size of each mesh level (None: plain expert parallelism), or ValueError naming the fix."""
    if compress is not None:
        raise ValueError(f"compress={compress!r}: compressed expert migration (hybridep.md §IV-B) is not built yet: "
                         "leave compress=None")
    if expert_domains is None:
        return None
    if expert_domains == "auto":
        raise ValueError("expert_domains='auto' (sized by hybridep.md's stream model) is not built yet: give the "
                         "domain size of each level, e.g. expert_domains={'node': 2}")
    names = level_names(mesh)
    if not isinstance(expert_domains, dict) or any(k not in names for k in expert_domains):
        raise ValueError(f"expert_domains={expert_domains!r}: give a dict from this mesh's level names {list(names)} "
                         "to how many workers of that level form one domain, e.g. {" f"{names[0]!r}: 2" "}")
    asked = [name for name, on in others.items() if on]
    if asked:
        raise ValueError(f"expert_domains with {', '.join(asked)} is not built: drop {' and '.join(asked)} or "
                         "expert_domains")
    sizes = {n: expert_domains.get(n, 1) for n in names}
    hybrid.check(tuple(mesh.shape), tuple(sizes.values()))  # each divides its level
    return sizes


def check_layer(rec, params: dict) -> None:
    """ValueError where a layer's experts cannot be gathered (an ``nn.ModuleList`` of them: not built)."""
    if any(isinstance(names, list) for names in params.values()):
        raise ValueError(f"expert_domains gathers stacked [E, ...] or flat expert weights; MoE layer {rec.path} "
                         "keeps its experts in an nn.ModuleList, which is not built: drop expert_domains")


_GROUPS: dict[tuple, tuple] = {}


def setup(mesh, sizes: dict[str, int]) -> Domains:
    """This rank's domain and exchange groups (every rank makes all of them, in the same order, once per mesh
    and domain sizes)."""
    from .mesh import _timeout

    shape, domain_sizes = tuple(mesh.shape), tuple(sizes.values())
    world, rank = dist.get_world_size(), dist.get_rank()
    key = (shape, domain_sizes)
    if key not in _GROUPS or _GROUPS[key][0] is not dist.group.WORLD:
        made = []
        for which in (0, 1):
            every = sorted({tuple(hybrid.groups(m, shape, domain_sizes)[which]) for m in range(world)})
            mine, _ = dist.new_subgroups_by_enumeration([list(g) for g in every], timeout=_timeout())
            made.append(mine)
        _GROUPS[key] = (dist.group.WORLD, *made)
    gather, exchange = hybrid.groups(rank, shape, domain_sizes)
    return Domains(sizes, _GROUPS[key][1], _GROUPS[key][2], gather, exchange, shape, domain_sizes)
