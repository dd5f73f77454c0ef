"""A measured routing for the planner: which experts each MoE layer's tokens chose on sample data, recorded once
(``record_routing``) and read by ``python -m moecompile plan --routing routing.pt`` in place of uniform routing.

Each recorded layer gives, for a group of W ranks holding the experts contiguously (E / W each), the share of
routed rows each rank receives (``rank_shares``) and, for G groups, the fraction of tokens sending a row to each
group (``group_hits``). ``runtime/comm/expected.py`` turns them into the busiest rank's bytes of every all-to-all
(uniform routing: shares 1 / W, hits the expected distinct groups / G); the planner averages them over the
recorded layers, and scales the experts' compute by the busiest rank's rows (``imbalance``: W x its share; under
replication the instances ``runtime/placement/replication.schedule`` places for the layer's load). The tokens
of the sample are taken to start on the ranks alike (a token's routing does not depend on its rank).
"""

from __future__ import annotations

import functools
import math

import torch

from moecompile.runtime.comm import expected
from moecompile.runtime.placement import replication

Tensor = torch.Tensor


class Routing:
    """Per MoE layer, the experts ``[T, K]`` its tokens chose, of ``num_experts``."""

    def __init__(self, layers: dict[str, Tensor], num_experts: int):
        if not layers:
            raise ValueError("the routing file records no MoE layer: record it with moecompile.record_routing on a "
                             "model with MoE layers")
        for name, ids in layers.items():
            if not isinstance(ids, Tensor) or ids.dim() != 2 or ids.dtype.is_floating_point or ids.numel() == 0:
                raise ValueError(f"routing of {name!r}: expected [tokens, top_k] integer expert ids, got "
                                 f"{getattr(ids, 'shape', type(ids))}")
            if int(ids.min()) < 0 or int(ids.max()) >= num_experts:
                raise ValueError(f"routing of {name!r} names expert {int(ids.max())}, outside the model's "
                                 f"{num_experts} experts: record it on the model this config describes")
        if len({ids.shape[1] for ids in layers.values()}) != 1:
            raise ValueError("the routing's layers chose different numbers of experts per token (top-k): record "
                             "the routing of one model")
        self.layers, self.num_experts = {k: v.long() for k, v in layers.items()}, num_experts
        self.top_k = next(iter(self.layers.values())).shape[1]
        self.loads = [torch.bincount(ids.reshape(-1), minlength=num_experts).double() / ids.numel()
                      for ids in self.layers.values()]
        self._messages: dict = {}

    @functools.lru_cache(maxsize=None)
    def rank_shares(self, ranks: int, slots_per_rank: int = 0) -> tuple[list[float], ...]:
        """Per layer, each of ``ranks`` ranks' share of the routed rows: E / ranks contiguous experts each, or
        (``slots_per_rank``) the instances replication places for the layer's load, each expert's rows split
        evenly over its instances."""
        out = []
        for load in self.loads:
            if slots_per_rank:
                slots = replication.schedule(load, ranks, slots_per_rank)
                instances = torch.bincount(slots, minlength=self.num_experts).double()
                out.append((load[slots] / instances[slots]).view(ranks, slots_per_rank).sum(1).tolist())
            else:
                out.append(load.view(ranks, -1).sum(1).tolist())
        return tuple(out)

    @functools.lru_cache(maxsize=None)
    def group_hits(self, groups: int) -> tuple[list[float], ...]:
        """Per layer, the fraction of tokens with a row for each of ``groups`` contiguous expert groups."""
        out = []
        for ids in self.layers.values():
            g = ids // (self.num_experts // groups)
            out.append(torch.zeros(ids.shape[0], groups).scatter_(1, g, 1.0).mean(0).tolist())
        return tuple(out)

    def duplication_rate(self, groups: int) -> float:
        """hiermoe.md Table II's quantity on this routing, the mean over layers."""
        return sum(1 - sum(h) / self.top_k for h in self.group_hits(groups)) / len(self.layers)

    def summary(self) -> dict:
        """plan.json's ``routing``: the recorded layers, their tokens, and the busiest expert's share of rows over
        the mean (1: balanced)."""
        return {"layers": len(self.layers), "tokens": sum(ids.shape[0] for ids in self.layers.values()),
                "busiest_expert": sum(self.num_experts * float(load.max()) for load in self.loads) / len(self.loads)}

    def imbalance(self, ranks: int, slots_per_rank: int = 0) -> float:
        """The busiest rank's rows over the mean (1 under uniform routing), averaged over the layers."""
        return sum(ranks * max(shares) for shares in self.rank_shares(ranks, slots_per_rank)) / len(self.loads)

    def offrank(self, ranks: int) -> float:
        """The busiest rank's share of its tokens' rows sent to, or received from, the other ranks (``ranks - 1``
        times its share received, 1 - its share sent), averaged over the layers; uniform: 1 - 1 / ranks."""
        return sum(expected.busiest_offrank(shares) for shares in self.rank_shares(ranks)) / len(self.loads)

    def messages(self, tokens: float, top_k: int, counts, names, row_bytes: float, slots_per_rank: int = 0
                 ) -> dict:
        """``expected.expected_messages`` on each layer's shares and hits, averaged over the layers."""
        key = (tokens, top_k, tuple(counts), tuple(names), row_bytes, slots_per_rank)
        if key not in self._messages:
            ranks = math.prod(counts)
            per_layer = [expected.expected_messages(tokens, top_k, self.num_experts, counts, names, row_bytes,
                                                    shares=shares, hits=lambda G, i=i: self.group_hits(G)[i])
                         for i, shares in enumerate(self.rank_shares(ranks, slots_per_rank))]
            self._messages[key] = {mode: [(kind, sum(layer[mode][m][1] for layer in per_layer) / len(per_layer))
                                          for m, (kind, _) in enumerate(msgs)]
                                   for mode, msgs in per_layer[0].items()}
        return self._messages[key]


def read_routing(path: str, num_experts: int) -> Routing:
    """A file ``record_routing`` wrote (``torch.save`` of ``{"layers": {path: [T, K] ids}}``)."""
    try:
        data = torch.load(path, weights_only=True, map_location="cpu")  # recorded on a GPU, planned anywhere
    except FileNotFoundError:
        raise ValueError(f"routing file {path!r} not found: write it with moecompile.record_routing(model, "
                         "example, path=...)") from None
    if not isinstance(data, dict) or not isinstance(data.get("layers"), dict):
        raise ValueError(f"{path!r} is not a routing file: expected {{'layers': {{layer: [tokens, top_k] expert "
                         "ids}}}, as moecompile.record_routing writes")
    experts = set(data.get("num_experts", {}).values()) or {num_experts}
    if experts != {num_experts}:
        raise ValueError(f"{path!r} records layers of {sorted(experts)} experts; the config has {num_experts}: "
                         "record the routing on the model the config describes")
    return Routing(data["layers"], num_experts)


def record_routing(model: torch.nn.Module, *example_args, path: str | None = None) -> dict[str, Tensor]:
    """Run ``model(*example_args)`` once through the moe passes (as ``moecompile.explain``, torch references)
    and return each proved MoE layer's routing ``{layer path: [tokens, top_k] expert ids}``; with ``path``, save
    it for ``python -m moecompile plan --routing path``."""
    from moecompile.explain import explain
    from moecompile.runtime.stats import recording_routing

    with recording_routing() as routing:
        report = explain(model, *example_args, lowering="torch")
    experts = {rec.path: rec.spec.experts.num_experts for rec in report.layers if rec.path in routing}
    layers = {k: v for k, v in routing.items() if k in experts}
    if not layers:
        raise ValueError("no MoE layer's routing was recorded: moecompile.explain(model, ...) says which layers "
                         "were found and why any was left out")
    if path:
        torch.save({"layers": layers, "num_experts": experts}, path)
    return layers
