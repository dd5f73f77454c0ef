"""Sequence-sharded MoE blocks (SSMB, X-MoE §4.3): the ranks of a tensor-parallel group hold the same tokens; inside
an MoE block each keeps only its own slice of them, and the block's output is gathered back.

    tp ranks r = 0..G-1, T tokens (the flattened batch x sequence), slice r = rows [start_r, start_r + n_r):
        n_r = (T + G - 1 - r) // G  (uneven when G does not divide T: the first T % G slices have one row more)
        start_r = r * (T // G) + min(r, T % G)

    moe::tp_slice(x, group)       [T, ...] -> this rank's [n_r, ...]     backward: all-gather of the slices' gradients
    moe::tp_gather(x, T, group)   [n_r, ...] -> [T, ...], every slice     backward: this rank's slice of the gradient

Tensor-expert parallelism (``moecompile/distributed/ted.py``) keeps the tokens replicated and cuts each expert's
intermediate dimension over the group instead:

    moe::tp_copy(x, group)        x (a copy)                              backward: all-reduce (sum of the partials)
    moe::tp_reduce(y, group)      all-reduce of the partial rows (sum)    backward: the gradient as it is

A replicated weight that meets sliced rows (the router's, a shared expert's, under SSMB) gets from each rank only
its slice's part of the gradient; the sum over the group is the whole one:

    moe::tp_linear(x, w, b, group)  linear(x, w, b)                       backward: x's gradient as linear's; w's
                                                                          and b's all-reduced over the group

The backwards of slice and gather are each other's forwards (X-MoE Fig. 8): a replicated tensor's gradient is the
whole gradient on every tp rank (as tensor parallelism keeps it), so the gradient of what a block reads is whole
again on every rank, and nothing upstream needs a reduction over the group. Slices travel in token order: slice r
is rank r's, and the gather puts them back where they were (a batch > 1 is one flattened token axis here).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.library import register_autograd, register_fake

from ..library import moe_op
from .exchange import resolve_group as _group
from .stats import COMM

Tensor = torch.Tensor


def bounds(T: int, G: int, r: int) -> tuple[int, int]:
    """(start, rows) of slice r of T tokens over G ranks."""
    return r * (T // G) + min(r, T % G), (T + G - 1 - r) // G


def _me(group_name: str) -> tuple[int, int]:
    group = _group(group_name)
    return dist.get_world_size(group), dist.get_rank(group)


@moe_op("moe::tp_slice", mutates_args=())
def tp_slice(x: Tensor, group_name: str) -> Tensor:
    G, r = _me(group_name)
    start, rows = bounds(x.shape[0], G, r)
    return x[start:start + rows].clone()


@register_fake("moe::tp_slice")
def _tp_slice_fake(x, group_name):
    G, r = _me(group_name)
    return x.new_empty(((x.shape[0] + G - 1 - r) // G, *x.shape[1:]))


@moe_op("moe::tp_gather", mutates_args=())
def tp_gather(x: Tensor, num_tokens: int, group_name: str, layer: str = "") -> Tensor:
    group = _group(group_name)
    G = dist.get_world_size(group)
    most = bounds(num_tokens, G, 0)[1]  # gloo gathers equal shapes: each slice padded to the first's rows
    padded = x.new_zeros((most, *x.shape[1:]))
    padded[:x.shape[0]] = x
    parts = [torch.empty_like(padded) for _ in range(G)]
    dist.all_gather(parts, padded, group=group)
    if layer:
        COMM.add_rows(layer, "tp_gather", group, [most] * G, math.prod(x.shape[1:]) * x.element_size())
    return torch.cat([p[:bounds(num_tokens, G, i)[1]] for i, p in enumerate(parts)])


@register_fake("moe::tp_gather")
def _tp_gather_fake(x, num_tokens, group_name, layer=""):
    return x.new_empty((num_tokens, *x.shape[1:]))


def _slice_setup(ctx, inputs, output):
    ctx.num_tokens, ctx.group_name = inputs[0].shape[0], inputs[1]


def _slice_bwd(ctx, grad):
    return torch.ops.moe.tp_gather(grad, ctx.num_tokens, ctx.group_name), None


def _gather_setup(ctx, inputs, output):
    ctx.group_name = inputs[2]


def _gather_bwd(ctx, grad):
    return torch.ops.moe.tp_slice(grad, ctx.group_name), None, None, None


@moe_op("moe::tp_copy", mutates_args=())
def tp_copy(x: Tensor, group_name: str) -> Tensor:
    return x.clone()


@register_fake("moe::tp_copy")
def _tp_copy_fake(x, group_name):
    return torch.empty_like(x)


@moe_op("moe::tp_reduce", mutates_args=())
def tp_reduce(x: Tensor, group_name: str, layer: str = "") -> Tensor:
    group = _group(group_name)
    out = x.clone()
    dist.all_reduce(out, group=group)
    if layer:  # counted as the rows an all-gather of them would send (a ring all-reduce sends about twice that)
        COMM.add_rows(layer, "tp_reduce", group, [x.shape[0]] * dist.get_world_size(group),
                      math.prod(x.shape[1:]) * x.element_size())
    return out


@register_fake("moe::tp_reduce")
def _tp_reduce_fake(x, group_name, layer=""):
    return torch.empty_like(x)


def _copy_setup(ctx, inputs, output):
    ctx.group_name = inputs[1]


def _copy_bwd(ctx, grad):
    return torch.ops.moe.tp_reduce(grad, ctx.group_name), None


def _reduce_bwd(ctx, grad):
    return grad, None, None


@moe_op("moe::tp_linear", mutates_args=())
def tp_linear(x: Tensor, weight: Tensor, bias: Tensor | None, group_name: str) -> Tensor:
    return torch.nn.functional.linear(x, weight, bias)


@register_fake("moe::tp_linear")
def _tp_linear_fake(x, weight, bias, group_name):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def _linear_setup(ctx, inputs, output):
    x, weight, bias, ctx.group_name = inputs
    ctx.save_for_backward(x, weight)
    ctx.bias_dtype = None if bias is None else bias.dtype


def _linear_bwd(ctx, grad):
    x, weight = ctx.saved_tensors
    g = grad.reshape(-1, grad.shape[-1])
    grad_x = (grad @ weight.to(grad.dtype)).to(x.dtype) if ctx.needs_input_grad[0] else None
    grad_w = grad_b = None
    if ctx.needs_input_grad[1]:  # this slice's part; the group's sum is the whole gradient
        grad_w = torch.ops.moe.tp_reduce((g.t() @ x.reshape(-1, x.shape[-1]).to(g.dtype)).to(weight.dtype),
                                         ctx.group_name)
    if ctx.bias_dtype is not None and ctx.needs_input_grad[2]:
        grad_b = torch.ops.moe.tp_reduce(g.sum(0).to(ctx.bias_dtype), ctx.group_name)
    return grad_x, grad_w, grad_b, None


register_autograd("moe::tp_linear", _linear_bwd, setup_context=_linear_setup)
register_autograd("moe::tp_slice", _slice_bwd, setup_context=_slice_setup)
register_autograd("moe::tp_copy", _copy_bwd, setup_context=_copy_setup)
register_autograd("moe::tp_reduce", _reduce_bwd)
register_autograd("moe::tp_gather", _gather_bwd, setup_context=_gather_setup)
