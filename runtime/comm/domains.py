"""Expert domains (HybridEP, hybridep.md §IV): the ranks of one domain all-gather their experts' weights, so each
computes its own tokens for every expert of the domain; only tokens for other domains' experts travel
(``hybrid.py`` says which ranks form a domain).

    moe::domain_gather(w, group)    this rank's [E_l, ...] experts -> the domain's [S x E_l, ...], in the group's
                                    rank order                     backward: each copy's gradient summed back to
                                                                   the owner (a reduce-scatter)
                                    (``dtype``: sent and gathered cast to it, FSDP2's bf16 compute dtype; the
                                    gradient summed in ``w``'s own)

    moe::domain_gather_start(w, group) -> key     the same all-gather, started (asynchronously) where the
    moe::domain_gather_wait(key, w, group)         distribute pass puts it, ahead of the experts; waited for at
                                                   the experts (hybridep.md §IV-B's asynchronous communicator)

The owner keeps the only parameter (and optimizer state) of its experts; the gathered copies are activations of
the step. gloo has no reduce-scatter: there the backward all-reduces the whole gradient and keeps this rank's rows
(the same sum; twice the bytes), NCCL reduce-scatters. Under ``exchange.emulate_links`` both wait as their
group's link would take for the bytes a rank receives ((S - 1) shards).
"""

from __future__ import annotations

import itertools
import math
import time

import torch
import torch.distributed as dist
from torch.library import register_autograd, register_fake

from ..library import moe_op
from .exchange import resolve_group, wait_as_link
from .stats import COMM

Tensor = torch.Tensor


def _size(group_name: str) -> int:
    return dist.get_world_size(resolve_group(group_name))


def _launch(w: Tensor, group, dtype: torch.dtype | None = None) -> tuple:
    w = w if dtype is None else w.to(dtype)  # (the experts' compute dtype: FSDP2's bf16, half the bytes)
    parts = [torch.empty_like(w) for _ in range(dist.get_world_size(group))]
    return dist.all_gather(parts, w.contiguous(), group=group, async_op=True), parts, time.perf_counter()


def _finish(work, parts, started: float, w: Tensor, group, layer: str) -> Tensor:
    work.wait()
    size = parts[0].element_size()
    wait_as_link(group, (len(parts) - 1) * w.numel() * size, since=started)
    if layer:
        COMM.add_rows(layer, "domain_gather", group, [w.shape[0]] * len(parts), math.prod(w.shape[1:]) * size)
    return torch.cat(parts)


@moe_op("moe::domain_gather", mutates_args=())
def domain_gather(w: Tensor, group_name: str, layer: str = "", dtype: torch.dtype | None = None) -> Tensor:
    group = resolve_group(group_name)
    return _finish(*_launch(w, group, dtype), w, group, layer)


@register_fake("moe::domain_gather")
def _domain_gather_fake(w, group_name, layer="", dtype=None):
    return w.new_empty((w.shape[0] * _size(group_name), *w.shape[1:]), dtype=dtype or w.dtype)


in_flight: dict[int, tuple] = {}  # key -> what a gather started ahead needs at its wait (compress.py's too)
new_key = itertools.count().__next__


@moe_op("moe::domain_gather_start", mutates_args=())
def domain_gather_start(w: Tensor, group_name: str, dtype: torch.dtype | None = None) -> Tensor:
    """Starts ``domain_gather(w)`` (asynchronously); returns the key ``domain_gather_wait`` takes."""
    key = new_key()
    in_flight[key] = _launch(w, resolve_group(group_name), dtype)
    return torch.tensor([key], dtype=torch.int64)


@register_fake("moe::domain_gather_start")
def _domain_gather_start_fake(w, group_name, dtype=None):
    return torch.empty(1, dtype=torch.int64)


@moe_op("moe::domain_gather_wait", mutates_args=())
def domain_gather_wait(key: Tensor, w: Tensor, group_name: str, layer: str = "", dtype: torch.dtype | None = None
                       ) -> Tensor:
    """``domain_gather(w)``, started by ``domain_gather_start`` (its ``key``): waits for it here."""
    return _finish(*in_flight.pop(int(key[0])), w, resolve_group(group_name), layer)


@register_fake("moe::domain_gather_wait")
def _domain_gather_wait_fake(key, w, group_name, layer="", dtype=None):
    return w.new_empty((w.shape[0] * _size(group_name), *w.shape[1:]), dtype=dtype or w.dtype)


@moe_op("moe::domain_reduce", mutates_args=())
def domain_reduce(grad: Tensor, group_name: str, layer: str = "") -> Tensor:
    """This rank's rows of the sum over the domain of ``grad`` ([S x E_l, ...] -> [E_l, ...])."""
    group = resolve_group(group_name)
    S, r = dist.get_world_size(group), dist.get_rank(group)
    rows = grad.shape[0] // S
    if dist.get_backend(group) == "nccl":
        out = grad.new_empty((rows, *grad.shape[1:]))
        dist.reduce_scatter_tensor(out, grad.contiguous(), group=group)
    else:
        total = grad.contiguous().clone()
        dist.all_reduce(total, group=group)
        out = total[r * rows:(r + 1) * rows].clone()
    wait_as_link(group, (S - 1) * out.numel() * out.element_size())
    if layer:
        COMM.add_rows(layer, "domain_reduce", group, [rows] * S, math.prod(grad.shape[1:]) * grad.element_size())
    return out


@register_fake("moe::domain_reduce")
def _domain_reduce_fake(grad, group_name, layer=""):
    return grad.new_empty((grad.shape[0] // _size(group_name), *grad.shape[1:]))


def _gather_setup(ctx, inputs, output):
    ctx.group_name, ctx.layer, ctx.dtype = inputs[1], inputs[2], inputs[0].dtype


def _gather_bwd(ctx, grad):  # (summed in the weight's own dtype: float32 under FSDP2's bf16 compute)
    return torch.ops.moe.domain_reduce(grad.to(ctx.dtype), ctx.group_name, ctx.layer), None, None, None


def _wait_setup(ctx, inputs, output):
    ctx.group_name, ctx.layer, ctx.dtype = inputs[2], inputs[3], inputs[1].dtype


def _wait_bwd(ctx, grad):
    return None, torch.ops.moe.domain_reduce(grad.to(ctx.dtype), ctx.group_name, ctx.layer), None, None, None


register_autograd("moe::domain_gather", _gather_bwd, setup_context=_gather_setup)
register_autograd("moe::domain_gather_wait", _wait_bwd, setup_context=_wait_setup)
