"""Expert swap (HierMoE's HierD-ES): re-place a layer's experts over the ranks so the recent routing costs less.

A layer parallelized with ``swap_every`` keeps a placement, ``slots_E``: expert e lives in slot ``slots_E[e]``,
slot s on rank ``s // E_l`` at row ``s % E_l`` of that rank's shard (identity at first). The routed rows are
sorted by slot before they are exchanged (``moe.ep_to_slots``), so the dispatch ops see slot ids and never a
placement. A swap exchanges two experts' slots and moves their weights, gradients and optimizer state
(``move_rows``); the graph does not change (the placement is a graph input).

``choose_swap``: among the pairs of experts on different ranks, the one that lowers most the predicted time of
one dispatch and combine of the recent routing, the busiest rank's bytes taken as a smooth max over the ranks
(HierMoE's Eq. 11, gamma 10 by default); none when no pair lowers it.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.library import register_fake

from ..library import moe_op
from ..comm.cost_model import TWO_LEVELS, LinkModel, dispatch_times
from ..comm.plan import Placement
from ..comm.exchange import exchange

Tensor = torch.Tensor

RECENT: dict[str, Tensor] = {}  # layer -> [T, K] expert ids of its last forward here (layers that swap), on
# the layer's device: a copy to the host at every forward would wait for the GPU


@moe_op("moe::ep_to_slots", mutates_args=())
def ep_to_slots(token_ids_B: Tensor, counts_E: Tensor, slots_E: Tensor, num_tokens: int, layer: str
                ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The routed rows (sorted by expert) sorted by slot: (token_ids_S, counts per slot, order_S: the row of
    each, inverse_B: where each row went). Rows past ``sum(counts_E)`` (the uncounted tail of a layer with a
    capacity or identity experts: they stay on this rank) stay at the tail, in order; ``RECENT`` gives them id -1."""
    E, B = counts_E.numel(), token_ids_B.numel()
    expert_B = torch.repeat_interleave(torch.arange(E, device=counts_E.device), counts_E)
    order_S = torch.argsort(slots_E[expert_B], stable=True)
    if expert_B.numel() < B:
        order_S = torch.cat([order_S, torch.arange(expert_B.numel(), B, device=order_S.device)])
        expert_B = torch.cat([expert_B, expert_B.new_full((B - expert_B.numel(),), -1)])
    inverse_B = torch.empty_like(order_S)
    inverse_B[order_S] = torch.arange(order_S.numel(), device=order_S.device)
    counts_S = torch.empty_like(counts_E)
    counts_S[slots_E] = counts_E
    if num_tokens and expert_B.numel():
        by_token = torch.argsort(token_ids_B, stable=True)
        RECENT[layer] = expert_B[by_token].view(num_tokens, -1)  # to the host when a swap reads it, not here
    return token_ids_B[order_S], counts_S, order_S, inverse_B


@register_fake("moe::ep_to_slots")
def _ep_to_slots_fake(token_ids_B, counts_E, slots_E, num_tokens, layer):
    return (torch.empty_like(token_ids_B), torch.empty_like(counts_E), torch.empty_like(token_ids_B),
            torch.empty_like(token_ids_B))


def objective(ids_TK: Tensor, source_rank_T: Tensor, expert_rank: Tensor, mesh_shape: tuple[int, ...],
              hidden: int, elem_bytes: int, link: LinkModel, dedup: str, gamma: float, names=TWO_LEVELS) -> float:
    """Predicted seconds of one dispatch and combine of the routing under this placement (smooth max)."""
    placement = Placement(expert_rank, mesh_shape)
    return dispatch_times(ids_TK, placement, source_rank_T, hidden, elem_bytes, link, gamma=gamma,
                          names=names)[dedup]


def choose_swap(ids_TK: Tensor, source_rank_T: Tensor, slots_E: Tensor, mesh_shape: tuple[int, ...], hidden: int,
                elem_bytes: int, link: LinkModel, dedup: str, gamma: float = 10.0, max_pairs: int = 4096,
                names=TWO_LEVELS):
    """(expert a, expert b, predicted seconds before, after) of the best swap, or None. Pairs are taken from
    the experts of the rank receiving the most routed rows against every expert elsewhere (all pairs when
    that is fewer than ``max_pairs``). ``names``: the mesh's levels (``mesh_shape``'s), outermost first."""
    ranks = math.prod(mesh_shape)
    slots_E, E = slots_E.cpu(), slots_E.numel()
    expert_rank = slots_E // (E // ranks)
    before = objective(ids_TK, source_rank_T, expert_rank, mesh_shape, hidden, elem_bytes, link, dedup, gamma, names)
    pairs = [(a, b) for a in range(E) for b in range(a + 1, E) if expert_rank[a] != expert_rank[b]]
    if len(pairs) > max_pairs:
        ids = ids_TK.reshape(-1)
        load = torch.bincount(expert_rank[ids[ids >= 0]], minlength=ranks)  # (an id < 0 stays home)
        busiest = int(load.argmax())
        pairs = [(a, b) for a, b in pairs if (int(expert_rank[a]) == busiest) != (int(expert_rank[b]) == busiest)]
        pairs = pairs[:max_pairs]
    best = None
    for a, b in pairs:
        trial = expert_rank.clone()
        trial[a], trial[b] = expert_rank[b], expert_rank[a]
        after = objective(ids_TK, source_rank_T, trial, mesh_shape, hidden, elem_bytes, link, dedup, gamma, names)
        if after < before * (1 - 1e-9) and (best is None or after < best[3]):
            best = (a, b, before, after)
    return best


def move_rows(local: Tensor, old_slots_E: Tensor, new_slots_E: Tensor, group) -> Tensor:
    """This rank's rows of a ``[E_l, ...]`` shard (or a flat ``[E_l * R, ...]`` one: R rows per expert) placed by
    ``old_slots_E``, re-placed by ``new_slots_E``: each expert's rows go to the rank and place of its expert's new
    slot (one all_to_all_single with exact splits)."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    old_slots_E, new_slots_E = old_slots_E.cpu(), new_slots_E.cpu()  # index arithmetic on the host
    E = old_slots_E.numel()
    El = E // world
    shape, local = local.shape, local.reshape(El, -1)  # one row per expert
    mine = torch.arange(rank * El, (rank + 1) * El)
    old_expert_S, new_expert_S = torch.argsort(old_slots_E), torch.argsort(new_slots_E)  # slot -> expert
    dest_slot = new_slots_E[old_expert_S[mine]]  # where each of my rows goes
    order = torch.argsort(dest_slot)
    send = torch.bincount(dest_slot // El, minlength=world).tolist()
    source_rank = old_slots_E[new_expert_S[mine]] // El  # where each of my new rows comes from
    recv = torch.bincount(source_rank, minlength=world).tolist()
    received = exchange(local[order.to(local.device)], send, recv, group)
    out = torch.empty_like(local)
    out[torch.argsort(source_rank * E + mine, stable=True).to(local.device)] = received
    return out.view(shape)
