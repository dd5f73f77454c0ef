"""Padding-free row exchange for expert parallelism over torch.distributed (gloo on CPU, NCCL on GPUs).

Each rank holds rows (token copies, [R, H]) and the rank each row must reach. ``dispatch_rows`` sorts the rows by
destination, exchanges the row counts (one ``all_to_all_single`` of ``world`` integers), then the rows themselves
with exact uneven splits: no capacity padding, no [T, E, C] buffer. ``combine_rows`` sends the (processed) rows
back by the reverse exchange and puts them in their original order. Both are differentiable: the backward of an
exchange is the exchange with the splits swapped.

    rank 0: rows a b c -> ranks 1 0 1          rank 1: rows d e -> ranks 0 0
    counts sent   [1, 2]                       [2, 0]
    rank 0 gets b | d e (from 0, then 1)       rank 1 gets a c

Link emulation. This machine's ranks talk over loopback, where every link is alike. ``emulate_links(link)`` makes
each all-to-all here (rows and counts) also wait ``alpha + beta * n`` seconds of its group's collective kind
(``flat``, ``node``, ``local``: ``register_group_kind``), ``n`` the bytes this rank sends to, or receives from,
the other ranks, whichever is more: the cost model's expression (``cost_model.messages``), so its predictions
can be checked against what the emulated links take, and a dedup choice shows its effect. Expert domains'
all-gathers and their gradients' reductions (``domains.py``) wait the same way (``wait_as_link``), for the bytes
a rank receives.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

_EMULATED = None  # the LinkModel every all-to-all here waits by, or None
_GROUP_KINDS: dict[str, str] = {}  # process group name -> collective kind of the link model


def resolve_group(group_name: str):
    """The process group of that name (ops take groups by name: a graph holds strings, not groups)."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(group_name)


def register_group_kind(group_name: str, kind: str) -> None:
    _GROUP_KINDS[group_name] = kind


@contextlib.contextmanager
def emulate_links(link):
    """Within the block, every expert-parallel all-to-all waits as ``link`` (a ``cost_model.LinkModel``) says."""
    global _EMULATED
    before, _EMULATED = _EMULATED, link
    try:
        yield link
    finally:
        _EMULATED = before


def _all_to_all(out: torch.Tensor, inp: torch.Tensor, recv_splits, send_splits, group) -> None:
    dist.all_to_all_single(out, inp, recv_splits, send_splits, group=group)
    if _EMULATED is None:
        return
    me, world = dist.get_rank(group), dist.get_world_size(group)
    per_row = math.prod(inp.shape[1:]) * inp.element_size()
    send = send_splits or [inp.shape[0] // world] * world
    recv = recv_splits or [out.shape[0] // world] * world
    wait_as_link(group, max(sum(send) - send[me], sum(recv) - recv[me]) * per_row)


_CHARGED = [0.0]  # seconds of emulated link time charged so far (the whole of each, overlapped or not)


def charged_seconds(reset: bool = False) -> float:
    """The emulated link seconds charged since the last reset (what the links take, before any overlap)."""
    value = _CHARGED[0]
    if reset:
        _CHARGED[0] = 0.0
    return value


def wait_as_link(group, nbytes: float, since: float | None = None) -> None:
    """Under ``emulate_links``, wait as long as a collective of ``group``'s kind moving ``nbytes`` (its busiest
    rank's) takes on the emulated link (one started at ``since``, a ``time.perf_counter()``: what is left of
    it); nothing otherwise."""
    if _EMULATED is not None:
        group_name = (group or dist.group.WORLD).group_name
        left = _EMULATED.time(_GROUP_KINDS.get(group_name, "flat"), nbytes)
        _CHARGED[0] += left
        time.sleep(max(0.0, left - (time.perf_counter() - since if since is not None else 0.0)))


def exchange(rows: torch.Tensor, send_splits: list[int], recv_splits: list[int], group=None) -> torch.Tensor:
    """``all_to_all_single`` of rows with exact splits: ``send_splits[r]`` rows to rank r, ``recv_splits[r]`` from
    it (not differentiable; ``_Exchange`` and the custom ops of ``ops.py`` give it a backward)."""
    out = rows.new_empty((sum(recv_splits), *rows.shape[1:]))
    _all_to_all(out, rows.contiguous(), recv_splits, send_splits, group)
    return out


class _Exchange(torch.autograd.Function):
    """``exchange``; its gradient goes back with the splits swapped."""

    @staticmethod
    def forward(ctx, rows, send_splits: list[int], recv_splits: list[int], group):
        ctx.splits, ctx.group = (send_splits, recv_splits), group
        return exchange(rows, send_splits, recv_splits, group)

    @staticmethod
    def backward(ctx, grad):
        send_splits, recv_splits = ctx.splits
        return exchange(grad, recv_splits, send_splits, ctx.group), None, None, None


@dataclass
class ExchangePlan:
    """What one dispatch did, for its combine: the sort of the rows by destination and the counts both ways."""

    order: torch.Tensor  # [R]: sent row i was local row order[i]
    send_counts: list[int]  # rows sent to each rank
    recv_counts: list[int]  # rows received from each rank
    group: dist.ProcessGroup | None = None


def exchange_counts(send_counts: torch.Tensor, group=None) -> torch.Tensor:
    """Every rank's count of rows for me, given my count for every rank ([world] int64, on the group's device)."""
    recv = torch.empty_like(send_counts)
    _all_to_all(recv, send_counts.contiguous(), None, None, group)
    return recv


def dispatch_rows(rows: torch.Tensor, dest_rank: torch.Tensor, group=None) -> tuple[torch.Tensor, ExchangePlan]:
    """Send each of ``rows`` ([R, ...]) to rank ``dest_rank[i]`` (a rank of ``group``). Returns the rows this rank
    received, grouped by source rank in rank order (each source's in its own sorted order), and the plan for
    ``combine_rows``."""
    world = dist.get_world_size(group)
    if dest_rank.shape != rows.shape[:1] or dest_rank.dtype != torch.int64:
        raise ValueError(f"dest_rank must be int64 with one entry per row ({rows.shape[0]}); got "
                         f"{dest_rank.dtype} {tuple(dest_rank.shape)}")
    if dest_rank.numel() and (int(dest_rank.min()) < 0 or int(dest_rank.max()) >= world):
        raise ValueError(f"dest_rank holds ranks outside [0, {world}) of the process group")
    order = torch.argsort(dest_rank, stable=True)
    send = torch.bincount(dest_rank, minlength=world)
    recv = exchange_counts(send, group)
    plan = ExchangePlan(order, send.tolist(), recv.tolist(), group)
    return _Exchange.apply(rows[order], plan.send_counts, plan.recv_counts, group), plan


def combine_rows(rows: torch.Tensor, plan: ExchangePlan) -> torch.Tensor:
    """The reverse of ``dispatch_rows``: each received row (processed, same count) back to the rank it came from,
    in that rank's original row order."""
    back = _Exchange.apply(rows, plan.recv_counts, plan.send_counts, plan.group)
    inverse = torch.empty_like(plan.order)
    inverse[plan.order] = torch.arange(plan.order.numel(), device=plan.order.device)
    return back[inverse]
