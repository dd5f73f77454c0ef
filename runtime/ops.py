"""The canonical MoE IR: ``torch.library`` custom ops ``moe::route``, ``moe::build_pft``, ``moe::expert_mlp`` and
``moe::combine``, each with a fake (shape) function and autograd. The passes target these ops; the lower pass
picks their implementation (on CPU: grouped GEMMs from ``grouped_cpu.py`` where they apply, else the torch
references of ``reference.py``, which are the meaning; ``expert_mlp_keep`` on CPU keeps its projections).

Legend: T tokens, K top-k, E experts, H hidden, I expert intermediate, B kept assignments (T*K without capacity).

Backward. ``expert_mlp`` computes its forward again inside an opaque backward op and differentiates it there
(``torch.func.vjp``), so it saves only its inputs: no [B, I] intermediate lives between forward and backward (the
expert MLP is, in effect, checkpointed). ``expert_mlp_keep`` (CPU, chosen by the lower pass) keeps its [B, 2I]
projections instead and runs no forward again. ``route`` saves its logits and picks and differentiates the weights
at those picks. ``build_pft`` and ``combine`` have closed-form adjoints written as plain torch ops, which the
compiler sees and fuses.
"""

from __future__ import annotations

import torch
from torch.library import register_autograd, register_fake

from . import grouped_cpu
from . import reference as ref
from . import stats
from .library import asked, moe_op, wanted
from .stats import DROPS

Tensor = torch.Tensor


# ---- route ---------------------------------------------------------------------------------------------------


@moe_op("moe::route", mutates_args=())
def route(
    logits_TE: Tensor,
    correction_bias_E: Tensor | None,
    top_k: int,
    score_fn: str,
    renormalize: bool,
    renorm_eps: float,
    scaling: float,
    n_group: int,
    topk_group: int,
    group_score: str,
    jitter_eps: float,
) -> tuple[Tensor, Tensor]:
    w, ids = ref.route_ref(
        logits_TE, correction_bias_E, top_k=top_k, score_fn=score_fn, renormalize=renormalize,
        renorm_eps=renorm_eps, scaling=scaling, n_group=n_group, topk_group=topk_group,
        group_score=group_score, jitter_eps=jitter_eps,
    )
    return w.contiguous(), ids.contiguous()


@register_fake("moe::route")
def _route_fake(logits_TE, correction_bias_E, top_k, *args):
    T = logits_TE.shape[0]
    w_dtype = ref.route_dtype(logits_TE.dtype)
    return logits_TE.new_empty(T, top_k, dtype=w_dtype), logits_TE.new_empty(T, top_k, dtype=torch.int64)


@moe_op("moe::route_backward", mutates_args=())
def route_backward(
    grad_weights_TK: Tensor,
    logits_TE: Tensor,
    correction_bias_E: Tensor | None,
    top_k: int,
    score_fn: str,
    renormalize: bool,
    renorm_eps: float,
    scaling: float,
    n_group: int,
    topk_group: int,
    group_score: str,
    jitter_eps: float,
    ids_TK: Tensor | None = None,
) -> Tensor:
    """The logits' gradient. With the forward's picks (``ids_TK``) it differentiates the weights at those picks
    (``reference.route_weights_at``) instead of routing again; sparsemixer always routes again."""
    def weights(logits):
        if ids_TK is not None and score_fn != "sparsemixer":
            return ref.route_weights_at(logits, ids_TK, score_fn=score_fn, renormalize=renormalize,
                                        renorm_eps=renorm_eps, scaling=scaling)
        return ref.route_ref(
            logits, correction_bias_E, top_k=top_k, score_fn=score_fn, renormalize=renormalize,
            renorm_eps=renorm_eps, scaling=scaling, n_group=n_group, topk_group=topk_group,
            group_score=group_score, jitter_eps=jitter_eps,
        )[0]

    _, vjp = torch.func.vjp(weights, logits_TE)
    return vjp(grad_weights_TK)[0].contiguous()


@register_fake("moe::route_backward")
def _route_backward_fake(grad_weights_TK, logits_TE, *args):
    return logits_TE.new_empty(logits_TE.shape)


def _route_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0], inputs[1], output[1])
    ctx.args = inputs[2:]


def _route_bwd(ctx, grad_w, grad_ids):
    logits, bias, ids = ctx.saved_tensors
    g = torch.ops.moe.route_backward(grad_w, logits, bias, *ctx.args, ids)
    return (g,) + (None,) * 10


register_autograd("moe::route", _route_bwd, setup_context=_route_setup)


# ---- build_pft -----------------------------------------------------------------------------------------------


@moe_op("moe::build_pft", mutates_args=())
def build_pft(
    ids_TK: Tensor, weights_TK: Tensor, num_experts: int, capacity: int, drop_order: str, layer: str,
    group_tokens: int = 0,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    out = ref.build_pft_ref(ids_TK, weights_TK, num_experts, capacity, drop_order, group_tokens)
    if capacity >= 0 and layer:  # layer "": not counted (verify's probes)
        routed = ids_TK.numel()
        DROPS.add(layer, routed, routed - out[2].sum())  # a device tensor: read when token_drops() is called
    if stats.ROUTING is not None and layer:
        stats.ROUTING[layer] = ids_TK.detach().to("cpu", copy=True)  # on the host: gathered, saved, planned
    return tuple(t.contiguous() for t in out)


@register_fake("moe::build_pft")
def _build_pft_fake(ids_TK, weights_TK, num_experts, capacity, drop_order, layer, group_tokens=0):
    B = ids_TK.numel()
    i64 = dict(dtype=torch.int64)
    return (
        ids_TK.new_empty(B, **i64),
        ids_TK.new_empty(B, **i64),
        ids_TK.new_empty(num_experts, **i64),
        weights_TK.new_empty(B),
        ids_TK.new_empty(B, **i64),
    )


def _build_pft_setup(ctx, inputs, output):
    ctx.save_for_backward(output[1], output[4])
    ctx.shape = inputs[1].shape
    ctx.num_experts = inputs[2]


def _build_pft_bwd(ctx, g_tok, g_exp, g_cnt, grad_cw_B, g_src):
    expert_ids_B, src_B = ctx.saved_tensors
    kept = grad_cw_B * (expert_ids_B < ctx.num_experts)  # dropped assignments get no gradient
    grad_flat = grad_cw_B.new_zeros(ctx.shape).view(-1).index_put((src_B,), kept)  # Size.numel() would guard
    return None, grad_flat.view(ctx.shape), None, None, None, None, None


register_autograd("moe::build_pft", _build_pft_bwd, setup_context=_build_pft_setup)


# ---- expert_mlp ----------------------------------------------------------------------------------------------


@moe_op("moe::expert_mlp", mutates_args=())
def expert_mlp(
    x_TH: Tensor,
    token_ids_B: Tensor,
    tokens_per_expert_E: Tensor,
    w_gate_EIH: Tensor | None,
    w_up_EIH: Tensor,
    w_down_EHI: Tensor,
    b_gate_EI: Tensor | None,
    b_up_EI: Tensor | None,
    b_down_EH: Tensor | None,
    input_scale_B: Tensor | None,
    activation: str,
    alpha: float,
    limit: float,
) -> Tensor:
    return _expert_mlp(
        x_TH, token_ids_B, tokens_per_expert_E, w_gate_EIH, w_up_EIH, w_down_EHI, b_gate_EI, b_up_EI, b_down_EH,
        input_scale_B, activation=activation, alpha=alpha, limit=limit,
    )


def _expert_mlp(x_TH, token_ids_B, tokens_per_expert_E, w_gate_EIH, w_up_EIH, w_down_EHI, *rest, **attrs):
    """Grouped GEMMs over the rows on CPU where ``grouped_mm`` takes them; else the reference's loop (the meaning)."""
    how = ref.expert_mlp_ref
    if x_TH.device.type == "cpu" and grouped_cpu.usable(x_TH, w_up_EIH, w_down_EHI):
        how = grouped_cpu.expert_mlp_grouped
    return how(x_TH, token_ids_B, tokens_per_expert_E, w_gate_EIH, w_up_EIH, w_down_EHI, *rest, **attrs)


@register_fake("moe::expert_mlp")
def _expert_mlp_fake(x_TH, token_ids_B, tokens_per_expert_E, w_gate, w_up, w_down, *rest):
    return x_TH.new_empty(token_ids_B.shape[0], w_down.shape[1], dtype=w_up.dtype)


@moe_op("moe::expert_mlp_backward", mutates_args=())
def expert_mlp_backward(
    grad_y_BH: Tensor,
    x_TH: Tensor,
    token_ids_B: Tensor,
    tokens_per_expert_E: Tensor,
    w_gate_EIH: Tensor | None,
    w_up_EIH: Tensor,
    w_down_EHI: Tensor,
    b_gate_EI: Tensor | None,
    b_up_EI: Tensor | None,
    b_down_EH: Tensor | None,
    input_scale_B: Tensor | None,
    activation: str,
    alpha: float,
    limit: float,
    needs: list[bool] | None = None,
) -> list[Tensor]:
    """Gradients of every tensor input that is present, in argument order (skipping the index inputs); with
    ``needs`` (one flag per input among x, w_gate, w_up, w_down, b_gate, b_up, b_down, input_scale) only of those
    present and needed: a frozen weight's gradient GEMM is not run (autograd would drop its result)."""
    inputs = [x_TH, w_gate_EIH, w_up_EIH, w_down_EHI, b_gate_EI, b_up_EI, b_down_EH, input_scale_B]
    where = wanted(inputs, needs)

    def forward(*present):
        full = list(inputs)
        for i, t in zip(where, present):
            full[i] = t
        x, wg, wu, wd, bg, bu, bd, sc = full
        return _expert_mlp(
            x, token_ids_B, tokens_per_expert_E, wg, wu, wd, bg, bu, bd, sc,
            activation=activation, alpha=alpha, limit=limit,
        )

    if not where:
        return []
    _, vjp = torch.func.vjp(forward, *[inputs[i] for i in where])
    # contiguous out whatever the input's strides (see the fake); in too: grouped_mm refuses an expanded gradient
    return [g.contiguous() for g in vjp(grad_y_BH.contiguous())]


@register_fake("moe::expert_mlp_backward")
def _expert_mlp_backward_fake(grad_y_BH, x_TH, token_ids_B, tokens_per_expert_E, *rest):
    tensors = [x_TH, *rest[:7]]
    needs = rest[10] if len(rest) > 10 else None
    return [tensors[i].new_empty(tensors[i].shape) for i in wanted(tensors, needs)]


def _expert_mlp_setup(ctx, inputs, output):
    ctx.save_for_backward(*[t for t in inputs[:10] if t is not None])
    ctx.present = [t is not None for t in inputs[:10]]
    ctx.attrs = inputs[10:]


_MLP_GRADS = (0, 3, 4, 5, 6, 7, 8, 9)  # x, w_gate, w_up, w_down, b_gate, b_up, b_down, input_scale


def _expert_mlp_bwd(ctx, grad_y_BH):
    saved = iter(ctx.saved_tensors)
    full = [next(saved) if p else None for p in ctx.present]
    needs = asked(ctx, _MLP_GRADS)  # a frozen weight: no gradient GEMM
    grads = iter(torch.ops.moe.expert_mlp_backward(grad_y_BH, *full, *ctx.attrs, needs))
    flagged = dict(zip(_MLP_GRADS, needs))
    return tuple(next(grads) if t is not None and flagged.get(i) else None for i, t in enumerate(full)) + (None,) * 3


register_autograd("moe::expert_mlp", _expert_mlp_bwd, setup_context=_expert_mlp_setup)


# ---- expert_mlp_keep: expert_mlp on CPU keeping its projections for backward --------------------------------


@moe_op("moe::expert_mlp_keep", mutates_args=())
def expert_mlp_keep(
    x_TH: Tensor, token_ids_B: Tensor, tokens_per_expert_E: Tensor, w_gate_EIH: Tensor | None, w_up_EIH: Tensor | None,
    w_down_EHI: Tensor, b_gate_EI: Tensor | None, b_up_EI: Tensor | None, b_down_EH: Tensor | None,
    input_scale_B: Tensor | None, activation: str, alpha: float, limit: float, w_gate_up: Tensor | None = None,
    gate_up_layout: str = "", all_rows: bool = False,
) -> tuple[Tensor, Tensor]:
    """(y_BH, pre_BJ): ``expert_mlp``'s rows by grouped GEMMs (``grouped_cpu.expert_mlp_keep``) and the
    projections before the activation, which its backward takes instead of running the forward again. Put in
    place of ``expert_mlp`` by the lower pass; ``w_gate_up``/``gate_up_layout`` as ``moe::fused_experts``;
    ``all_rows``: no row is dropped (the lower pass sets it where the rows come from a capacity-free build_pft)."""
    return grouped_cpu.expert_mlp_keep(
        x_TH, token_ids_B, tokens_per_expert_E, w_gate_EIH, w_up_EIH, w_down_EHI, b_gate_EI, b_up_EI, b_down_EH,
        input_scale_B, activation=activation, alpha=alpha, limit=limit, w_gate_up=w_gate_up,
        gate_up_layout=gate_up_layout, all_rows=all_rows,
    )


@register_fake("moe::expert_mlp_keep")
def _expert_mlp_keep_fake(x_TH, token_ids_B, tokens_per_expert_E, w_gate, w_up, w_down, *rest):
    B, (E, H, I) = token_ids_B.shape[0], w_down.shape
    y = x_TH.new_empty(B, H, dtype=w_down.dtype)
    return y, y.new_empty(B, I if w_gate is None and (len(rest) < 8 or rest[7] is None) else 2 * I)


@moe_op("moe::expert_mlp_keep_backward", mutates_args=())
def expert_mlp_keep_backward(
    grad_y_BH: Tensor, pre_BJ: Tensor, x_TH: Tensor, token_ids_B: Tensor, tokens_per_expert_E: Tensor,
    w_gate_EIH: Tensor | None, w_up_EIH: Tensor | None, w_down_EHI: Tensor, b_gate_EI: Tensor | None,
    b_up_EI: Tensor | None, b_down_EH: Tensor | None, input_scale_B: Tensor | None, activation: str, alpha: float,
    limit: float, w_gate_up: Tensor | None = None, gate_up_layout: str = "", all_rows: bool = False,
    needs: list[bool] | None = None,
) -> list[Tensor]:
    """Gradients of the present tensors among (x, w_gate, w_up, w_down, b_gate, b_up, b_down, input_scale,
    w_gate_up), from the kept projections; ``needs``: as ``expert_mlp_backward``'s, one flag per tensor named."""
    return grouped_cpu.expert_mlp_keep_backward(
        grad_y_BH, pre_BJ, x_TH, token_ids_B, tokens_per_expert_E, w_gate_EIH, w_up_EIH, w_down_EHI, b_gate_EI,
        b_up_EI, b_down_EH, input_scale_B, activation=activation, alpha=alpha, limit=limit, w_gate_up=w_gate_up,
        gate_up_layout=gate_up_layout, all_rows=all_rows, needs=needs,
    )


_KEEP_GRADS = (0, 3, 4, 5, 6, 7, 8, 9, 13)  # x, w_gate, w_up, w_down, b_gate, b_up, b_down, input_scale, w_gate_up


@register_fake("moe::expert_mlp_keep_backward")
def _expert_mlp_keep_backward_fake(grad_y_BH, pre_BJ, *inputs):
    inputs = list(inputs) + [None] * (17 - len(inputs))
    tensors = [inputs[i] for i in _KEEP_GRADS]
    return [tensors[i].new_empty(tensors[i].shape) for i in wanted(tensors, inputs[16])]


def _expert_mlp_keep_setup(ctx, inputs, output):
    inputs = list(inputs) + [None, "", False][len(inputs) - 13:]
    ctx.save_for_backward(output[1], *[t for t in inputs[:10] + [inputs[13]] if t is not None])
    ctx.present = [t is not None for t in inputs[:10] + [inputs[13]]]
    ctx.attrs = (*inputs[10:13], inputs[14], inputs[15])


def _expert_mlp_keep_bwd(ctx, grad_y_BH, _grad_pre):  # the projections are read by this backward alone
    pre, *saved = ctx.saved_tensors
    saved = iter(saved)
    full = [next(saved) if p else None for p in ctx.present]  # the 10 first inputs, then w_gate_up
    act, alpha, limit, layout, all_rows = ctx.attrs
    needs = asked(ctx, _KEEP_GRADS)  # a frozen weight: no gradient GEMM
    grads = iter(torch.ops.moe.expert_mlp_keep_backward(grad_y_BH, pre, *full[:10], act, alpha, limit, full[10],
                                                        layout, all_rows, needs))
    flagged = dict(zip(_KEEP_GRADS, needs))
    inputs = full[:10] + [None, None, None, full[10], None, None]
    return tuple(next(grads) if t is not None and flagged.get(i) else None for i, t in enumerate(inputs))


register_autograd("moe::expert_mlp_keep", _expert_mlp_keep_bwd, setup_context=_expert_mlp_keep_setup)


# ---- combine -------------------------------------------------------------------------------------------------


@moe_op("moe::combine", mutates_args=())
def combine(y_BH: Tensor, token_ids_B: Tensor, combine_weights_B: Tensor | None, num_tokens: int) -> Tensor:
    return ref.combine_ref(y_BH, token_ids_B, combine_weights_B, num_tokens)


@register_fake("moe::combine")
def _combine_fake(y_BH, token_ids_B, combine_weights_B, num_tokens):
    dtype = y_BH.dtype if combine_weights_B is None else torch.promote_types(y_BH.dtype, combine_weights_B.dtype)
    return y_BH.new_empty(num_tokens, y_BH.shape[-1], dtype=dtype)


def _combine_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0], inputs[1], inputs[2])


def _combine_bwd(ctx, grad_out_TH):
    y_BH, token_ids_B, cw_B = ctx.saved_tensors
    g_BH = grad_out_TH[token_ids_B]
    if cw_B is None:
        return g_BH.to(y_BH.dtype), None, None, None
    grad_y = (g_BH * cw_B.unsqueeze(-1)).to(y_BH.dtype)
    grad_cw = (g_BH * y_BH).sum(-1).to(cw_B.dtype)
    return grad_y, None, grad_cw, None


register_autograd("moe::combine", _combine_bwd, setup_context=_combine_setup)
