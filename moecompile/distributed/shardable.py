"""Which MoE layers ``moecompile.parallelize`` shards, and which sharded forms a layer's routing leaves out.

A layer with an expert capacity (GShard's, Switch Transformers' per sequence) is sharded: each rank drops its own
rows past the capacity before they are sent (its capacity holds over the tokens it routes, as when each rank runs
the original model on its batch under data parallelism), ``moe::build_pft`` leaves them at the tail of its rows,
the dispatch sends only the kept rows and the combine gives the tail zeros (``runtime/comm/ops.py``). Dedup
(``runtime/comm/dedup.py``), expert swap (``moe.ep_to_slots``) and replication (``moe.ep_to_instances``) carry
that tail too (its rows are no pair, keep their place, go to no instance); sequence sharding over tp would drop
other rows (a capacity over a slice of the tokens): such a layer is not sequence-sharded, and the report says why.

A layer with identity experts (LongCat-Flash's zero-computation experts: ids E..E+Z-1 return the token) sends only
the rows of its E computed experts; the identity rows stay home at the tail, as a capacity's dropped rows, and the
token's own share is added on its rank. Its fused ``gate_up`` weight keeps Z rows the model never reads (transformers
allocates ``[E + Z, ...]``, ``down`` ``[E, ...]``): each rank holds its E / W computed experts' rows, then its
Z / W of those spare rows (``identity_shard``), and the state_dict places them back in the model's order
(``identity_slots``: the slot of each row, as an expert swap's placement), so a checkpoint holds the whole
``[E + Z, ...]`` tensor. An expert swap moves the E experts' rows; the spare ones stay where they are. Under
``moe_tp="ssmb"`` each tp rank adds the identity share of its slice of the tokens (``passes/sequence_shard.py``
cuts the comparisons and the sum); in expert domains each rank gathers its domain's experts' rows, the spare
ones left where they are (``passes/distribute.py``); TED (each expert cut over tp) leaves it whole, and it does
not replicate its experts (the replicas' slots hold ``[E, ...]`` weights).
"""

from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist
from torch import nn

CAPACITY = "its expert capacity drops rows on each rank before the exchange, which sends the kept ones"


def unshardable(rec, world: int) -> str:
    """Why the layer of ``rec`` stays whole on every rank ("" when ``parallelize`` shards it over ``world``
    ranks); experts that do not divide over the ranks raise ValueError."""
    e, r = rec.spec.experts, rec.spec.routing
    if e.num_experts % world:
        raise ValueError(f"MoE layer {rec.path} has {e.num_experts} experts, which do not divide over the mesh's "
                         f"{world} ranks: use a mesh whose size divides {e.num_experts}")
    if e.storage not in ("stacked", "flat", "modulelist", "rows"):
        return (f"{e.storage} expert storage is not sharded yet (stacked [E, ...] parameters, flat [E * R, ...] ones, "
                "[E, C] rows and ModuleLists are)")
    if e.identity_experts and (e.storage != "stacked" or e.identity_experts % world):
        return (f"a layer with identity experts is sharded with stacked experts and a number of identity experts "
                f"({e.identity_experts}) that divides over the {world} ranks")
    if e.identity_experts and getattr(rec, "moe_tp", "off") == "ted":
        return ("a layer with identity experts is not sharded by TED yet (plain expert parallelism, moe_tp='ssmb' "
                "and expert domains are)")
    if r.capacity >= 0 and getattr(rec, "moe_tp", "off") == "ssmb":
        return (f"{CAPACITY} of all its tokens: sequence-sharding them over tp (moe_tp='ssmb') would change which "
                "rows it drops (moe_tp='off' or 'ted' shards it)")
    if any(not isinstance(p, nn.Parameter) for p in expert_tensors(rec)):
        return "its expert weights are not parameters of the model"
    return ""


def rows_home(rec) -> str:
    """Why the layer of ``rec`` does not replicate its experts: "" without identity experts (a layer with a capacity
    replicates: its kept rows go to the instances, its tail stays home)."""
    if rec.spec.experts.identity_experts:
        return ("its identity experts' rows stay home and its gate_up weight holds spare rows: replicas are not built "
                "for such a layer yet")
    return ""


def identity_shard(full: torch.Tensor, E: int, rank: int, world: int) -> torch.Tensor:
    """This rank's rows of a stacked weight with Z = ``len(full) - E`` spare rows after its E computed experts':
    its E / W experts', then its Z / W spare rows."""
    e, z = E // world, (full.shape[0] - E) // world
    return torch.cat([full[rank * e:(rank + 1) * e], full[E + rank * z:E + (rank + 1) * z]])


def identity_slots(E: int, total: int, world: int, slots: torch.Tensor | None = None, device=None) -> torch.Tensor:
    """The slot (place in the ranks' rows, ``identity_shard``'s layout) of each of the ``total`` rows of a stacked
    weight with spare rows after its E experts'; with ``slots`` (an expert swap's placement: expert e in slot
    ``slots[e]`` of the E computed experts' slots), the experts' rows where the swaps put them."""
    e, z, c = E // world, (total - E) // world, total // world
    rows = torch.arange(total, device=device if slots is None else slots.device)
    placed = rows[:E] if slots is None else slots
    spare = rows[E:] - E
    return torch.cat([placed // e * c + placed % e, spare // max(z, 1) * c + e + spare % max(z, 1)])


def expert_tensors(rec):
    """Every expert weight of a layer record (a role holds one tensor, or a ModuleList's one per expert)."""
    for w in rec.expert_weights.values():
        yield from w if isinstance(w, list) else [w]


def check_ranks_agree(model: nn.Module, plans, group) -> None:
    """The same layers found, the same weights held and the same ones trained on every rank, else ValueError."""
    digest = hashlib.sha256()
    for rec, params in plans:
        digest.update(f"{rec.path}|{rec.spec}|{sorted(params.items())}".encode())
    for name, p in model.state_dict().items():
        digest.update(f"{name}{tuple(p.shape)}{p.dtype}".encode())
        if hasattr(p, "full_tensor"):  # a DTensor (tensor parallelism): the whole weight, not this rank's shard
            p = p.full_tensor()
        if p.is_floating_point() and not p.is_meta:  # (a model built on meta: shapes only)
            digest.update(repr(float(p.detach().sum(dtype=torch.float64))).encode())  # no float64 copy of p
    trained = sorted(name for name, p in model.named_parameters() if p.requires_grad)
    every = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, (digest.hexdigest(), hashlib.sha256(repr(trained).encode()).hexdigest()), group=group)
    differ = [i for i, d in enumerate(every) if d[0] != every[0][0]]
    if differ:
        raise ValueError(f"ranks {differ} hold a different model than rank 0 (other MoE layers, shapes or weights): "
                         "build the same model with the same seed on every rank (torch.manual_seed(s) before "
                         "creating it) before moecompile.parallelize")
    differ = [i for i, d in enumerate(every) if d[1] != every[0][1]]
    if differ:  # (each rank's gradient reductions would differ in size: a hang or an error in backward)
        raise ValueError(f"ranks {differ} train other parameters than rank 0 (requires_grad differs): freeze the same "
                         "parameters on every rank before moecompile.parallelize")
