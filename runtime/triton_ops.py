"""The Triton lowering of the canonical MoE ops: custom ops with the same meaning as those of ``ops.py``, whose
implementations launch the kernels of ``runtime/kernels``. The ``lower`` pass swaps them in:

    moe.route           -> moe.route_triton          (same arguments; fused router kernel, backward kernel)
    moe.build_pft       -> moe.build_pft_triton      (same arguments; counts/ranks/scatter kernels, no capacity)
    moe.expert_mlp + moe.combine -> moe.fused_experts (grouped GEMM kernels + a deterministic combine; backward
                                                       kernels, no float atomics anywhere)
                                    moe.fused_experts_keep (the same, where the program trains: its projections
                                                       before the activation kept for backward)

Like the torch ops they are opaque to the compiler (``triton_op`` cannot be traced without a GPU), carry fake
functions whose shapes and strides match the real outputs, and save their inputs for backward (the router also
its chosen ids; fused_experts_keep also the [B, 2I] projections, so its backward runs one GEMM fewer per
projection: fused_experts recomputes them inside the backward kernels). The kernels are imported on first
use (``kernels.load()``), so importing moecompile never switches Triton into interpreter mode by itself. Each op
launches on its inputs' GPU, whatever the current device.
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch.library import register_autograd, register_fake

from .layouts import gate_up_weights, split_gate_up
from .library import asked, moe_op, wanted
from .ops import _build_pft_bwd, _build_pft_fake, _build_pft_setup, _route_fake  # moe::build_pft's formulas

Tensor = torch.Tensor


@functools.cache
def _kernels():
    from . import kernels

    return kernels.load()


def _on(t: Tensor):
    """Launches on ``t``'s GPU whatever the current device (Triton launches on the current one)."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


# ---- route ---------------------------------------------------------------------------------------------------


@moe_op("moe::route_triton", mutates_args=())
def route_triton(
    logits_TE: Tensor, correction_bias_E: Tensor | None, top_k: int, score_fn: str, renormalize: bool,
    renorm_eps: float, scaling: float, n_group: int, topk_group: int, group_score: str, jitter_eps: float,
) -> tuple[Tensor, Tensor]:
    with _on(logits_TE):
        return _kernels()["router"].route(
            logits_TE, correction_bias_E, top_k=top_k, score_fn=score_fn, renormalize=renormalize,
            renorm_eps=renorm_eps, scaling=scaling, n_group=n_group, topk_group=topk_group, group_score=group_score,
        )


register_fake("moe::route_triton", _route_fake)


@moe_op("moe::route_triton_backward", mutates_args=())
def route_triton_backward(
    grad_weights_TK: Tensor, logits_TE: Tensor, ids_TK: Tensor, correction_bias_E: Tensor | None, top_k: int,
    score_fn: str, renormalize: bool, renorm_eps: float, scaling: float, n_group: int, topk_group: int,
    group_score: str,
) -> Tensor:
    with _on(logits_TE):
        return _kernels()["router"].route_backward(
            grad_weights_TK.contiguous(), logits_TE, ids_TK, correction_bias_E, top_k=top_k, score_fn=score_fn,
            renormalize=renormalize, renorm_eps=renorm_eps, scaling=scaling, n_group=n_group,
            topk_group=topk_group, group_score=group_score,
        )


@register_fake("moe::route_triton_backward")
def _route_triton_backward_fake(grad_weights_TK, logits_TE, *args):
    return logits_TE.new_empty(logits_TE.shape)


def _route_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0], output[1], inputs[1])
    ctx.args = inputs[2:10]  # top_k .. group_score (jitter_eps is sparsemixer's, never lowered here)


def _route_bwd(ctx, grad_w, grad_ids):
    logits, ids, bias = ctx.saved_tensors
    return (torch.ops.moe.route_triton_backward(grad_w, logits, ids, bias, *ctx.args),) + (None,) * 10


register_autograd("moe::route_triton", _route_bwd, setup_context=_route_setup)


# ---- build_pft -----------------------------------------------------------------------------------------------


@moe_op("moe::build_pft_triton", mutates_args=())
def build_pft_triton(
    ids_TK: Tensor, weights_TK: Tensor, num_experts: int, capacity: int, drop_order: str, layer: str,
    group_tokens: int = 0,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    if capacity >= 0:
        raise ValueError("moe::build_pft_triton builds capacity-free buffers; capacity layers keep moe::build_pft")
    with _on(ids_TK):
        return _kernels()["pft"].build_pft(ids_TK, weights_TK, num_experts)


register_fake("moe::build_pft_triton", _build_pft_fake)
register_autograd("moe::build_pft_triton", _build_pft_bwd, setup_context=_build_pft_setup)


# ---- fused experts (expert_mlp + combine) --------------------------------------------------------------------

# the tensor arguments of fused_experts that can have gradients, in order
_GRAD_INPUTS = ("x", "combine_weights", "w_gate", "w_up", "w_down", "b_gate", "b_up", "b_down", "input_scale",
                "w_gate_up")


def _gate_up(w_gate_EIH, w_up_EIH, w_down_EHI, w_gate_up, gate_up_layout):
    """(gate, up) weights: given, or the views of the one fused gate/up weight (``runtime/layouts.py``)."""
    return gate_up_weights(w_gate_EIH, w_up_EIH, w_down_EHI, w_gate_up, gate_up_layout, "fused_experts")


@moe_op("moe::fused_experts", mutates_args=())
def fused_experts(
    x_TH: Tensor, token_ids_B: Tensor, tokens_per_expert_E: Tensor, combine_weights_B: Tensor | None,
    w_gate_EIH: Tensor | None, w_up_EIH: Tensor | None, w_down_EHI: Tensor, b_gate_EI: Tensor | None,
    b_up_EI: Tensor | None, b_down_EH: Tensor | None, input_scale_B: Tensor | None, activation: str, alpha: float,
    limit: float, num_tokens: int, src_B: Tensor | None = None, w_gate_up: Tensor | None = None,
    gate_up_layout: str = "", all_rows: bool = False,
) -> Tensor:
    """``combine(expert_mlp(x, ...), token_ids, combine_weights, num_tokens)``: grouped GEMM kernels, then each
    token's rows summed in k order (``src_B``: the PFT's flat assignment of each row) without atomics. With
    ``w_gate_up`` (one [E, 2I, H] weight, ``gate_up_layout`` saying where its halves are) instead of ``w_gate``
    and ``w_up``, its gradient is written whole, in its own layout. ``all_rows``: the counts count every row (the
    lower pass sets it where the rows come from a capacity-free PFT): no role reads the count back."""
    w_gate_EIH, w_up_EIH = _gate_up(w_gate_EIH, w_up_EIH, w_down_EHI, w_gate_up, gate_up_layout)
    with _on(x_TH):
        return _kernels()["grouped_mlp"].fused_experts(
            x_TH, token_ids_B, tokens_per_expert_E, combine_weights_B, w_gate_EIH, w_up_EIH, w_down_EHI, b_gate_EI,
            b_up_EI, b_down_EH, input_scale_B, num_tokens=num_tokens, activation=activation, alpha=alpha,
            limit=limit, src_B=src_B, all_rows=all_rows,
        )


@register_fake("moe::fused_experts")
def _fused_experts_fake(x_TH, token_ids_B, tokens_per_expert_E, combine_weights_B, w_gate, w_up, w_down, *rest):
    num_tokens = rest[7]
    dt = w_down.dtype
    dtype = dt if combine_weights_B is None else torch.promote_types(dt, combine_weights_B.dtype)
    return x_TH.new_empty(num_tokens, w_down.shape[1], dtype=dtype)


@moe_op("moe::fused_experts_keep", mutates_args=())
def fused_experts_keep(
    x_TH: Tensor, token_ids_B: Tensor, tokens_per_expert_E: Tensor, combine_weights_B: Tensor | None,
    w_gate_EIH: Tensor | None, w_up_EIH: Tensor | None, w_down_EHI: Tensor, b_gate_EI: Tensor | None,
    b_up_EI: Tensor | None, b_down_EH: Tensor | None, input_scale_B: Tensor | None, activation: str, alpha: float,
    limit: float, num_tokens: int, src_B: Tensor | None = None, w_gate_up: Tensor | None = None,
    gate_up_layout: str = "", all_rows: bool = False,
) -> tuple[Tensor, Tensor]:
    """(out_TH, pre_BJ): ``moe::fused_experts``, also keeping the projections before the activation ([B, 2I]
    gate then up, [B, I] ungated) for its backward, whose dh then reads them instead of running the gate/up GEMM
    again (one GEMM in place of three; the same gradients). What the lower pass puts in where the program trains."""
    w_gate_EIH, w_up_EIH = _gate_up(w_gate_EIH, w_up_EIH, w_down_EHI, w_gate_up, gate_up_layout)
    with _on(x_TH):
        return _kernels()["grouped_mlp"].fused_experts(
            x_TH, token_ids_B, tokens_per_expert_E, combine_weights_B, w_gate_EIH, w_up_EIH, w_down_EHI, b_gate_EI,
            b_up_EI, b_down_EH, input_scale_B, num_tokens=num_tokens, activation=activation, alpha=alpha,
            limit=limit, src_B=src_B, all_rows=all_rows, keep=True,
        )


@register_fake("moe::fused_experts_keep")
def _fused_experts_keep_fake(x_TH, token_ids_B, tokens_per_expert_E, combine_weights_B, w_gate, w_up, w_down, *rest):
    out = _fused_experts_fake(x_TH, token_ids_B, tokens_per_expert_E, combine_weights_B, w_gate, w_up, w_down, *rest)
    gated = w_gate is not None or (len(rest) > 9 and rest[9] is not None)  # w_gate_up: gated
    I = w_down.shape[2]
    return out, x_TH.new_empty(token_ids_B.shape[0], 2 * I if gated else I, dtype=w_down.dtype)


@moe_op("moe::fused_experts_backward", mutates_args=())
def fused_experts_backward(
    grad_out_TH: Tensor, x_TH: Tensor, token_ids_B: Tensor, tokens_per_expert_E: Tensor,
    combine_weights_B: Tensor | None, w_gate_EIH: Tensor | None, w_up_EIH: Tensor | None, w_down_EHI: Tensor,
    b_gate_EI: Tensor | None, b_up_EI: Tensor | None, b_down_EH: Tensor | None, input_scale_B: Tensor | None,
    activation: str, alpha: float, limit: float, src_B: Tensor | None = None, w_gate_up: Tensor | None = None,
    gate_up_layout: str = "", all_rows: bool = False, pre_B: Tensor | None = None, needs: list[bool] | None = None,
) -> list[Tensor]:
    """Gradients of the present inputs among ``_GRAD_INPUTS``, in that order: weights' in the weights' own
    layout (each written once by its kernel), the rest contiguous. ``pre_B``: the projections
    ``moe::fused_experts_keep`` kept. ``needs``: one flag per name of ``_GRAD_INPUTS``; the gradients of the
    flagged present inputs alone are returned, and a kernel none of whose outputs is flagged is not launched
    (frozen experts: their weight-gradient kernels; an input that needs no gradient: the dx kernel)."""
    tensors = _grad_inputs(x_TH, combine_weights_B, w_gate_EIH, w_up_EIH, w_down_EHI, b_gate_EI, b_up_EI, b_down_EH,
                           input_scale_B, w_gate_up)
    want = {_GRAD_INPUTS[i] for i in wanted(tensors, needs)}
    gate, up = _gate_up(w_gate_EIH, w_up_EIH, w_down_EHI, w_gate_up, gate_up_layout)
    launch = (bool(want & {"w_gate", "w_up", "b_gate", "b_up", "w_gate_up"}), bool(want & {"w_down", "b_down"}))
    # the dx kernel also gives the scale's gradient and the down bias's share of the combine weights'
    dx = bool(want & {"x", "input_scale"}) or ("combine_weights" in want and b_down_EH is not None)
    out = d_gate_up = None
    if w_gate_up is not None and launch[0]:
        d_gate_up = torch.empty_like(w_gate_up)  # the fused parameter's layout; its halves written in place
        down = torch.empty_like(w_down_EHI) if launch[1] else None
        out = (*split_gate_up(d_gate_up, gate_up_layout, w_down_EHI.shape[2]), down)
    with _on(x_TH):
        grads = list(_kernels()["grouped_mlp_bwd"].fused_experts_backward(
            grad_out_TH, x_TH, token_ids_B, tokens_per_expert_E, combine_weights_B, gate, up, w_down_EHI,
            b_gate_EI, b_up_EI, b_down_EH, input_scale_B, activation=activation, alpha=alpha, limit=limit,
            src_B=src_B, weight_grads=out, all_rows=all_rows, pre_B=pre_B, wgrads=launch, dx=dx,
        ))
    grads.append(d_gate_up)
    return [g for name, g in zip(_GRAD_INPUTS, grads) if name in want]


def _grad_inputs(x, cw, wg, wu, wd, bg, bu, bd, s, gu):
    return [x, cw, wg, wu, wd, bg, bu, bd, s, gu]


@register_fake("moe::fused_experts_backward")
def _fused_experts_backward_fake(grad_out_TH, x_TH, token_ids_B, tokens_per_expert_E, cw, wg, wu, wd, bg, bu, bd,
                                 s, activation, alpha, limit, src=None, gu=None, layout="", all_rows=False,
                                 pre=None, needs=None):
    like = (wg, wu, wd, gu)  # weights: their own strides, as the kernels write them
    tensors = _grad_inputs(x_TH, cw, wg, wu, wd, bg, bu, bd, s, gu)
    return [torch.empty_like(t) if any(t is w for w in like) else t.new_empty(t.shape)
            for t in (tensors[i] for i in wanted(tensors, needs))]


_TENSOR_ARGS = list(range(11)) + [15, 16]  # x .. input_scale, src, w_gate_up
_GRAD_POSITIONS = (0, 3, 4, 5, 6, 7, 8, 9, 10, 16)  # where each of _GRAD_INPUTS is among fused_experts' arguments


def _fused_setup(ctx, inputs, output):
    tensors = [inputs[i] if i < len(inputs) else None for i in _TENSOR_ARGS]
    tensors.append(output[1] if isinstance(output, (tuple, list)) else None)  # fused_experts_keep's projections
    ctx.save_for_backward(*[t for t in tensors if t is not None])
    ctx.present = [t is not None for t in tensors]
    ctx.attrs = inputs[11:14]
    ctx.layout = inputs[17] if len(inputs) > 17 else ""
    ctx.all_rows = inputs[18] if len(inputs) > 18 else False


def _fused_bwd(ctx, grad_out, _grad_pre=None):  # the kept projections are read by this backward alone
    saved = iter(ctx.saved_tensors)
    x, tok, counts, cw, wg, wu, wd, bg, bu, bd, s, src, gu, pre = [next(saved) if p else None for p in ctx.present]
    needs = asked(ctx, _GRAD_POSITIONS)  # a frozen weight: no weight-gradient kernel
    grads = iter(torch.ops.moe.fused_experts_backward(grad_out, x, tok, counts, cw, wg, wu, wd, bg, bu, bd, s,
                                                      *ctx.attrs, src, gu, ctx.layout, ctx.all_rows, pre, needs))
    g = {name: (next(grads) if t is not None and need else None)
         for name, t, need in zip(_GRAD_INPUTS, _grad_inputs(x, cw, wg, wu, wd, bg, bu, bd, s, gu), needs)}
    return (g["x"], None, None, g["combine_weights"], g["w_gate"], g["w_up"], g["w_down"], g["b_gate"], g["b_up"],
            g["b_down"], g["input_scale"], None, None, None, None, None, g["w_gate_up"], None, None)


register_autograd("moe::fused_experts", _fused_bwd, setup_context=_fused_setup)
register_autograd("moe::fused_experts_keep", _fused_bwd, setup_context=_fused_setup)
