"""Hierarchical expert-parallel dispatch with token dedup at a mesh level (X-MoE's redundancy-bypassing dispatch,
HierMoE's HierD-AlltoAll). Built by the ``distribute`` pass for a layer ``moecompile.parallelize(...,
dedup="node")`` sharded (or any level but the innermost of the mesh: ``runtime/comm/levels.py``); the ops here are
its integer plans and exchanges, the rest is plain differentiable torch (so each op's backward is short: the
reverse exchange). Below, on a ``("node", "local")`` mesh; dedup at another level reads "node" as the groups of
that level (its "cross" collective) and "local" as the ranks of one such group (its "inner" one).

    source rank (node n, local index l), its T tokens routed to K experts each
    1 ep_node_plan     one row per distinct (token, node): P pairs, grouped by node; each (token, expert)
                       assignment's expert id and pair index, and its routing weight, ride with them
    2 ep_exchange      over the "node" group (the ranks of local index l, one per node): pair rows to the rank
                       of local index l in each node (once per node, however many of its K experts are there)
    relay rank (node m, local index l)
    3 ep_relay_plan    the received assignments sorted by this node's experts, each pointing at its pair row
    4 ep_dispatch      over the "local" group (the ranks of node m): one copy per assignment to its expert's rank
    5 expert_mlp, ep_combine (the local experts, and their outputs back to the relay)
    6 the relay weights each output by its routing weight and sums the outputs of each pair (inside the node)
    7 ep_exchange      the P' pair sums back over the "node" group, in the order they came
    source rank
    8 out[t] = sum of the token's pair sums (one per node it was routed to)

A layer with an expert capacity or identity experts (``moecompile/distributed/shardable.py``): the rows past
``sum(counts_E)`` (dropped past the capacity, or routed to an identity expert) are no assignment of any pair:
they stay on the source rank, cross no link and add nothing to their token's sum (as the zeros the exchange
without dedup gives them, ``ops.py``; an identity expert's share is added apart, ``passes/canonical.py``).

Inter-node bytes are the distinct (token, remote node) pairs x H x element size, each way (``COMM`` counts them
as ``dispatch.node`` and ``combine.node``); the routing (16 bytes of ids and the weight per assignment) is counted
apart as ``routing.*``.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.library import register_autograd, register_fake

from ..library import moe_op
from .exchange import exchange, exchange_counts
from .ops import _group
from .stats import COMM

Tensor = torch.Tensor

# The two collectives of dedup at each level of each mesh parallelize set up, by (the name of the mesh's whole
# group, the level): (name of this rank's cross group: the ranks of its inner coordinates, one per group of the
# level; name of its inner group: the ranks of its group of the level)
LAYOUTS: dict[tuple[str, str], tuple[str, str]] = {}


def register_layout(group_name: str, level: str, cross_group_name: str, inner_group_name: str) -> None:
    LAYOUTS[(group_name, level)] = (cross_group_name, inner_group_name)


def layout(group_name: str, level: str) -> tuple[str, str]:
    if (group_name, level) not in LAYOUTS:
        raise ValueError(f"process group {group_name!r} has no mesh level {level!r} to dedup at: dedup={level!r} "
                         "needs a mesh of several levels naming it (e.g. ('node', 'local')) given to "
                         "moecompile.parallelize")
    return LAYOUTS[(group_name, level)]


# ---- plans (integer, not differentiable) -----------------------------------------------------------------------


@moe_op("moe::ep_node_plan", mutates_args=())
def ep_node_plan(token_ids_B: Tensor, counts_E: Tensor, num_tokens: int, node_group_name: str, layer: str
                 ) -> tuple[Tensor, Tensor, Tensor]:
    """(pair_tok_P: the token of each distinct (token, node) pair, grouped by node; meta_B2: each assignment's
    global expert and pair index within its node's pairs; counts_N2: pairs and assignments per node)."""
    group = _group(node_group_name)
    nodes, me = dist.get_world_size(group), dist.get_rank(group)
    E = counts_E.numel()
    expert_B = torch.repeat_interleave(torch.arange(E, device=counts_E.device), counts_E)
    counted = expert_B.numel()  # (rows past it: the uncounted tail, dropped or identity rows, which stay here)
    node_B = expert_B // (E // nodes)
    keys, pair_B = torch.unique(node_B * num_tokens + token_ids_B[:counted], sorted=True, return_inverse=True)
    pairs_N = torch.bincount(keys // num_tokens, minlength=nodes)
    assign_N = counts_E.view(nodes, -1).sum(1)
    first_pair_N = torch.cumsum(pairs_N, 0) - pairs_N
    meta_B2 = torch.stack([expert_B, pair_B - first_pair_N[node_B]], 1)
    if counted < token_ids_B.numel():  # the tail's rows: never sent (ep_exchange sends the counted ones)
        meta_B2 = torch.cat([meta_B2, meta_B2.new_zeros(token_ids_B.numel() - counted, 2)])
    COMM.add(layer, "dedup.remote_assignments", assign_N.sum() - assign_N[me])  # summed on the device
    COMM.add(layer, "dedup.remote_pairs", pairs_N.sum() - pairs_N[me])
    return keys % num_tokens, meta_B2, torch.stack([pairs_N, assign_N], 1)


@register_fake("moe::ep_node_plan")
def _ep_node_plan_fake(token_ids_B, counts_E, num_tokens, node_group_name, layer):
    P = torch.library.get_ctx().new_dynamic_size()
    nodes = dist.get_world_size(_group(node_group_name))
    return (token_ids_B.new_empty(P), token_ids_B.new_empty(token_ids_B.shape[0], 2),
            counts_E.new_empty(nodes, 2))


@moe_op("moe::ep_relay_plan", mutates_args=())
def ep_relay_plan(meta_A2: Tensor, recv_N2: Tensor, num_experts: int, node_group_name: str
                  ) -> tuple[Tensor, Tensor, Tensor]:
    """On the relay: (pair_A: the received pair row of each received assignment, sorted by this node's experts;
    counts_X: assignments per expert of this node; order_A: the sort)."""
    group = _group(node_group_name)
    per_node = num_experts // dist.get_world_size(group)
    pairs_N, assign_N = recv_N2[:, 0], recv_N2[:, 1]
    source_A = torch.repeat_interleave(torch.arange(pairs_N.numel(), device=meta_A2.device), assign_N)
    pair_A = meta_A2[:, 1] + (torch.cumsum(pairs_N, 0) - pairs_N)[source_A]
    expert_A = meta_A2[:, 0] - dist.get_rank(group) * per_node
    order_A = torch.argsort(expert_A, stable=True)
    return pair_A[order_A], torch.bincount(expert_A, minlength=per_node), order_A


@register_fake("moe::ep_relay_plan")
def _ep_relay_plan_fake(meta_A2, recv_N2, num_experts, node_group_name):
    per_node = num_experts // dist.get_world_size(_group(node_group_name))
    A = meta_A2.shape[0]
    return meta_A2.new_empty(A), meta_A2.new_empty(per_node), meta_A2.new_empty(A)


@moe_op("moe::ep_counts", mutates_args=())
def ep_counts(send_WC: Tensor, group_name: str) -> Tensor:
    """Every rank's counts for me ([W, C]), given mine for every rank: one all_to_all_single."""
    return exchange_counts(send_WC, _group(group_name))


@register_fake("moe::ep_counts")
def _ep_counts_fake(send_WC, group_name):
    return torch.empty_like(send_WC)


# ---- the row exchange (differentiable) -------------------------------------------------------------------------


@moe_op("moe::ep_exchange", mutates_args=())
def ep_exchange(rows: Tensor, send_W: Tensor, recv_W: Tensor, num_rows: int, group_name: str, layer: str,
                phase: str) -> Tensor:
    """``send_W[r]`` of ``rows`` (in order) to rank r of the group, ``recv_W[r]`` rows from it; ``num_rows``, when
    the caller knows it, is ``sum(recv_W)`` or more (-1: a new size). Rows past ``sum(send_W)`` stay here (the
    uncounted tail of a layer with a capacity or identity experts), and rows past ``sum(recv_W)`` up to
    ``num_rows`` are zeros (the tail's gradient, in backward). Counted in ``COMM`` under ``phase`` unless empty."""
    group = _group(group_name)
    send = send_W.tolist()
    if not phase:  # a backward exchange: not counted
        return _padded(exchange(rows[:sum(send)], send, recv_W.tolist(), group), num_rows)
    with COMM.timed(layer, rows.device):
        COMM.add_rows(layer, phase, group, send, math.prod(rows.shape[1:]) * rows.element_size())
        return _padded(exchange(rows[:sum(send)], send, recv_W.tolist(), group), num_rows)


def _padded(rows: Tensor, num_rows: int) -> Tensor:
    if num_rows <= rows.size(0):
        return rows
    return torch.cat([rows, rows.new_zeros(num_rows - rows.size(0), *rows.shape[1:])])


@register_fake("moe::ep_exchange")
def _ep_exchange_fake(rows, send_W, recv_W, num_rows, group_name, layer, phase):
    n = torch.library.get_ctx().new_dynamic_size() if num_rows < 0 else num_rows
    return rows.new_empty(n, *rows.shape[1:])


def _ep_exchange_setup(ctx, inputs, output):
    rows, send_W, recv_W, _, group_name, layer, _ = inputs
    ctx.save_for_backward(send_W, recv_W)
    ctx.num_rows, ctx.group_name, ctx.layer = rows.shape[0], group_name, layer


def _ep_exchange_bwd(ctx, grad):
    send_W, recv_W = ctx.saved_tensors
    back = torch.ops.moe.ep_exchange(grad, recv_W, send_W, ctx.num_rows, ctx.group_name, ctx.layer, "")
    return back, None, None, None, None, None, None


register_autograd("moe::ep_exchange", _ep_exchange_bwd, setup_context=_ep_exchange_setup)


# ---- the whole hierarchical expert step, as the distribute pass traces it --------------------------------------


def hierarchical_experts(x_TH, token_ids_B, counts_E, weights_B, run_experts, group_name: str, layer: str,
                         level: str = "node"):
    """``combine(expert_mlp(x_TH, token_ids_B, counts_E, ...), token_ids_B, weights_B, T)`` with the experts of
    ``group_name``'s mesh and the rows deduplicated per group of ``level`` (see the module docstring).
    ``run_experts(x_RH, perm_R, counts_L)`` runs this rank's experts on the rows it received (plain torch ops or
    fx proxies: the pass calls it while tracing)."""
    ops = torch.ops.moe
    node_g, local_g = layout(group_name, level)
    T, E = x_TH.size(0), counts_E.size(0)
    pair_tok_P, meta_B2, send_N2 = ops.ep_node_plan(token_ids_B, counts_E, T, node_g, layer)
    recv_N2 = ops.ep_counts(send_N2, node_g)
    x_PH = ops.ep_exchange(x_TH[pair_tok_P], send_N2[:, 0], recv_N2[:, 0], -1, node_g, layer, "dispatch")
    meta_A2 = ops.ep_exchange(meta_B2, send_N2[:, 1], recv_N2[:, 1], -1, node_g, layer, "routing")
    w_A1 = ops.ep_exchange(weights_B.unsqueeze(-1), send_N2[:, 1], recv_N2[:, 1], meta_A2.size(0), node_g, layer,
                           "routing")
    pair_A, counts_X, order_A = ops.ep_relay_plan(meta_A2, recv_N2, E, node_g)
    d = ops.ep_dispatch(x_PH, pair_A, counts_X, local_g, layer)
    y_RH = run_experts(d[0], d[1], d[2])
    y_AH = ops.ep_combine(y_RH, d[1], counts_X, d[3], pair_A.size(0), local_g, layer)
    rows_AH = y_AH * w_A1.view(-1)[order_A].unsqueeze(-1)
    sums_PH = rows_AH.new_zeros(x_PH.size(0), rows_AH.size(1)).index_add(0, pair_A, rows_AH)
    back_PH = ops.ep_exchange(sums_PH, recv_N2[:, 0], send_N2[:, 0], pair_tok_P.size(0), node_g, layer, "combine")
    return back_PH.new_zeros(T, back_PH.size(1)).index_add(0, pair_tok_P, back_PH)
