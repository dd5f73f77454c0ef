"""Routed rows to expert instances (adaptive replication; ``replication.py`` decides the placement).

A layer with replication holds S expert slots per rank (``slot_expert_N``, N = W x S, names the expert of each
slot). ``moe.ep_to_instances`` takes this rank's routed rows (sorted by expert, as ``build_pft`` gives them) and
sends each to one instance of its expert:

    tok_K, counts_N, order_K = ep_to_instances(tok_B, counts_E, slot_expert_N, capacity_factor, group, layer)
    d = ep_dispatch(x_TH, tok_K, counts_N, group, layer)        # the exchange by slot (local experts: S slots)
    y_KH = ep_combine(expert_mlp(d[0], d[1], d[2], w_slots_S...), d[1], counts_N, d[3], K, group, layer)
    y_BH = zeros(B, H).index_copy(0, order_K, y_KH)             # back in routed order; a dropped row gives 0

It gathers every rank's per-expert counts (one ``all_gather`` of E integers: their sum over the ranks is the
forward's expert popularity, added to ``POPULARITY`` for the scheduler: summed over the forwards since the layer's
optimizer step last consumed them, ``forget``, so an iteration of several micro-batches counts them all), splits
each expert's rows, in the global order (rank 0's first), over its instances in equal runs
(``replication.route_to_instances``; with a ``capacity_factor`` > 0, each instance holds ceil(factor x routed rows
of every rank / N) rows, and the rows past what an expert's instances hold are dropped: not in ``order_K``), and
returns the kept rows sorted by slot: ``tok_K`` (their tokens), ``counts_N`` (rows this rank sends to each slot)
and ``order_K`` (the routed row each came from). Its outputs are integers: no gradient.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.library import register_fake

from ..library import moe_op
from ..comm.ops import _group
from .replication import route_to_instances

Tensor = torch.Tensor

# Per layer, summed over its forwards since ``forget``:
POPULARITY: dict[str, Tensor] = {}  # layer -> [E] rows routed to each expert over every rank
DROPPED: dict[str, int] = {}  # layer -> routed rows dropped over every rank (past a capacity)
SLOT_ROWS: dict[str, Tensor] = {}  # layer -> [N] rows each instance received (from every rank)


def forget(layers) -> None:
    """Start the layers' counts anew (the optimizer step that used them is done)."""
    for store in (POPULARITY, DROPPED, SLOT_ROWS):
        for layer in layers:
            store.pop(layer, None)


@moe_op("moe::ep_to_instances", mutates_args=())
def ep_to_instances(token_ids_B: Tensor, counts_E: Tensor, slot_expert_N: Tensor, capacity_factor: float,
                    group_name: str, layer: str) -> tuple[Tensor, Tensor, Tensor]:
    """``capacity_factor`` <= 0: dropless."""
    group = _group(group_name)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    every = [torch.empty_like(counts_E) for _ in range(world)]
    dist.all_gather(every, counts_E.contiguous(), group=group)
    counts_WE = torch.stack(every).cpu()
    placement = slot_expert_N.cpu()
    capacity = math.ceil(capacity_factor * int(counts_WE.sum()) / placement.numel()) if capacity_factor > 0 else None
    rows_WN = route_to_instances(counts_WE, placement, capacity)
    for store, value in ((POPULARITY, counts_WE.sum(0)), (DROPPED, int(counts_WE.sum() - rows_WN.sum())),
                         (SLOT_ROWS, rows_WN.sum(0))):
        store[layer] = store[layer] + value if layer in store else value
    mine = rows_WN[rank]
    dest, start = torch.full((int(counts_E.sum()),), -1, dtype=torch.int64), 0
    for e, n in enumerate(counts_WE[rank].tolist()):  # this rank's rows of expert e: to its slots in turn
        slots = torch.nonzero(placement == e).flatten()
        to = torch.repeat_interleave(slots, mine[slots])
        dest[start:start + to.numel()] = to
        start += n
    kept = torch.nonzero(dest >= 0).flatten()
    order_K = kept[torch.argsort(dest[kept], stable=True)].to(token_ids_B.device)
    return token_ids_B[order_K], mine.to(counts_E.device), order_K


@register_fake("moe::ep_to_instances")
def _ep_to_instances_fake(token_ids_B, counts_E, slot_expert_N, capacity_factor, group_name, layer):
    K = torch.library.get_ctx().new_dynamic_size()
    return (token_ids_B.new_empty(K), counts_E.new_empty(slot_expert_N.shape[0]), token_ids_B.new_empty(K))
