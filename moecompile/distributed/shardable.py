"""Which MoE layers ``moecompile.parallelize`` shards, and which sharded forms a layer's routing leaves out.

A layer with an expert capacity (GShard's, Switch Transformers' per sequence) is sharded: each rank drops its own
rows past the capacity before they are sent (its capacity holds over the tokens it routes, as when each rank runs
the original model on its batch under data parallelism), ``moe::build_pft`` leaves them at the tail of its rows,
the dispatch sends only the kept rows and the combine gives the tail zeros (``runtime/comm/ops.py``). The forms
that regroup the rows (dedup, expert swap, replication, sequence sharding over tp) do not carry that tail: such a
layer runs without them, and the report says why.
"""

from __future__ import annotations

from torch import nn

CAPACITY = "its expert capacity drops rows on each rank before the exchange, which sends the kept ones"


def unshardable(rec, world: int) -> str:
    """Why the layer of ``rec`` stays whole on every rank ("" when ``parallelize`` shards it over ``world``
    ranks); experts that do not divide over the ranks raise ValueError."""
    e, r = rec.spec.experts, rec.spec.routing
    if e.num_experts % world:
        raise ValueError(f"MoE layer {rec.path} has {e.num_experts} experts, which do not divide over the mesh's "
                         f"{world} ranks: use a mesh whose size divides {e.num_experts}")
    if e.storage not in ("stacked", "flat", "modulelist"):
        return (f"{e.storage} expert storage is not sharded yet (stacked [E, ...] parameters, flat [E * R, ...] ones "
                "and ModuleLists are)")
    if e.identity_experts:
        return "a layer with identity experts is not sharded yet"
    if r.capacity >= 0 and getattr(rec, "moe_tp", "off") == "ssmb":
        return (f"{CAPACITY} of all its tokens: sequence-sharding them over tp (moe_tp='ssmb') would change which "
                "rows it drops (moe_tp='off' or 'ted' shards it)")
    if any(not isinstance(p, nn.Parameter) for p in expert_tensors(rec)):
        return "its expert weights are not parameters of the model"
    return ""


def capacity_note(rec) -> str:
    """Why the layer of ``rec`` runs without dedup, expert swap and replication: "" without a capacity."""
    return "" if rec.spec.routing.capacity < 0 else f"{CAPACITY}, one row per (token, expert), in expert order"


def expert_tensors(rec):
    """Every expert weight of a layer record (a role holds one tensor, or a ModuleList's one per expert)."""
    for w in rec.expert_weights.values():
        yield from w if isinstance(w, list) else [w]
