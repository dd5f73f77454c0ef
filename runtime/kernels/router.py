"""Fused MoE router in Triton: scores, correction bias, group-limited top-k, renormalization, scaling (+ backward).

Forward, per token: ``score_fn`` turns the logits into scores (softmax or sigmoid over all experts; for the
``topk_*`` functions the logits themselves), the choice score is the score plus the correction bias, a group limit
(``n_group > 1``, softmax/sigmoid only) zeroes the choice score of every expert outside the ``topk_group`` best
groups, and the ``top_k`` best choices are picked in ``torch.topk`` order. The weights are the scores at the
picked experts (``topk_softmax``: a softmax over the K picked logits; ``topk_sigmoid``: their sigmoid), then
optionally renormalized ``w / (sum(w) + renorm_eps)`` and multiplied by ``scaling``. All math is fp32.

Backward: the gradient of those weights w.r.t. the logits with the chosen ids fixed (the ids, and through them the
correction bias, are not differentiable), i.e. ``torch.func.vjp`` of ``reference.route_ref``'s weights.

One program handles BLOCK_T tokens x all E experts (BLOCK_E lanes, the tail masked). Top-k is K rounds of
(max, lowest index attaining it, mask it out). The picked slots live in a [BLOCK_T, BLOCK_E] tile whose first K
columns are used (K <= E), so no extra power-of-two block for K is needed.

Legend: T tokens, E experts, K experts per token (top-k), G expert groups.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import reference
from .common import _sigmoid, check_device, check_shape, pow2

SCORE_FN_CODES = {"softmax": 0, "sigmoid": 1, "topk_softmax": 2, "topk_sigmoid": 3}  # constexpr SCORE_FN
GROUP_SCORE_CODES = {"max": 0, "top2_sum": 1}  # constexpr GROUP_SCORE
LOGIT_DTYPES = {torch.float32: "*fp32", torch.float16: "*fp16", torch.bfloat16: "*bf16"}
TILE_ELEMS = 2048  # BLOCK_T * BLOCK_E: ~6 live fp32 tiles stay within registers at 4 warps
MAX_BLOCK_T = 64  # more tokens per program only lengthens the tail program for small E
NEG_INF = tl.constexpr(float("-inf"))  # masked lanes and picked experts
NUM_WARPS = 4  # 2048-element tiles: 16 fp32 per thread each; the kernel is memory- and reduction-bound


def _block_t(block_e: int) -> int:
    """Tokens per program for a BLOCK_E-wide tile (the only launch choice; no autotune)."""
    return max(1, min(MAX_BLOCK_T, TILE_ELEMS // block_e))


@triton.jit
def _row_softmax(x_TE, lane_mask):
    """Softmax of each row over the lanes where ``lane_mask`` holds (0 on the others)."""
    xm_TE = tl.where(lane_mask[None, :], x_TE, NEG_INF)
    ex_TE = tl.exp(xm_TE - tl.max(xm_TE, axis=1)[:, None])
    return ex_TE / tl.sum(ex_TE, axis=1)[:, None]


@triton.jit
def _load_logits(logits_ptr, T, E, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr):
    """This program's [BLOCK_T, BLOCK_E] fp32 tile of logits_TE, with its lane offsets and masks."""
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_e = tl.arange(0, BLOCK_E)
    t_mask = offs_t < T
    e_mask = offs_e < E
    row_T = offs_t.to(tl.int64)
    x_TE = tl.load(logits_ptr + row_T[:, None] * E + offs_e[None, :], mask=t_mask[:, None] & e_mask[None, :],
                   other=0.0).to(tl.float32)
    return offs_e, t_mask, e_mask, row_T, x_TE


@triton.jit
def _route_kernel(
    logits_ptr, bias_ptr, weights_ptr, ids_ptr,  # logits_TE, correction_bias_E (fp32), weights_TK, ids_TK
    T, E, K, n_group, topk_group, renorm_eps, scaling,
    SCORE_FN: tl.constexpr, HAS_BIAS: tl.constexpr, RENORM: tl.constexpr,
    GROUPED: tl.constexpr, GROUP_SCORE: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
):
    offs_e, t_mask, e_mask, row_T, x_TE = _load_logits(logits_ptr, T, E, BLOCK_T, BLOCK_E)

    if SCORE_FN == 0:
        scores_TE = _row_softmax(x_TE, e_mask)
    elif SCORE_FN == 1:
        scores_TE = _sigmoid(x_TE)
    else:  # topk_*: choose on the logits, weigh the picked logits afterwards
        scores_TE = x_TE
    choice_TE = scores_TE
    if HAS_BIAS:
        choice_TE += tl.load(bias_ptr + offs_e, mask=e_mask, other=0.0)[None, :]
    choice_TE = tl.where(e_mask[None, :], choice_TE, NEG_INF)

    if GROUPED:  # keep the topk_group best of n_group groups; the others' experts score 0.0, as the reference
        gsize = E // n_group
        group_E = offs_e // gsize
        gscore_TE = tl.full([BLOCK_T, BLOCK_E], NEG_INF, tl.float32)  # each expert's lane holds its group's score
        for g in range(0, n_group):
            in_g = (group_E == g)[None, :] & e_mask[None, :]
            vals_TE = tl.where(in_g, choice_TE, NEG_INF)
            best_T = tl.max(vals_TE, axis=1)
            if GROUP_SCORE == 1:  # sum of the two largest: drop one lane attaining the max, take the max again
                at_T = tl.min(tl.where(vals_TE == best_T[:, None], offs_e[None, :], BLOCK_E), axis=1)
                second_T = tl.max(tl.where(offs_e[None, :] == at_T[:, None], NEG_INF, vals_TE), axis=1)
                best_T = best_T + second_T
            gscore_TE = tl.where(in_g, best_T[:, None], gscore_TE)
        keep_TE = tl.zeros([BLOCK_T, BLOCK_E], tl.float32)
        for _ in range(0, topk_group):
            top_T = tl.max(gscore_TE, axis=1)
            at_T = tl.min(tl.where(gscore_TE == top_T[:, None], offs_e[None, :], BLOCK_E), axis=1)
            hit_TE = group_E[None, :] == (at_T // gsize)[:, None]
            keep_TE = tl.where(hit_TE, 1.0, keep_TE)
            gscore_TE = tl.where(hit_TE, NEG_INF, gscore_TE)
        choice_TE = tl.where(keep_TE > 0.0, choice_TE, 0.0)
        choice_TE = tl.where(e_mask[None, :], choice_TE, NEG_INF)

    # top-k, slot k in column k of the slot tiles
    slot_ids_TE = tl.zeros([BLOCK_T, BLOCK_E], tl.int32)
    slot_vals_TE = tl.zeros([BLOCK_T, BLOCK_E], tl.float32)
    for k in range(0, K):
        best_T = tl.max(choice_TE, axis=1)
        at_T = tl.min(tl.where(choice_TE == best_T[:, None], offs_e[None, :], BLOCK_E), axis=1)
        hit_TE = offs_e[None, :] == at_T[:, None]
        val_T = tl.sum(tl.where(hit_TE, scores_TE, 0.0), axis=1)
        choice_TE = tl.where(hit_TE, NEG_INF, choice_TE)
        slot_TE = offs_e[None, :] == k
        slot_ids_TE = tl.where(slot_TE, at_T[:, None], slot_ids_TE)
        slot_vals_TE = tl.where(slot_TE, val_T[:, None], slot_vals_TE)

    k_mask = offs_e < K
    if SCORE_FN == 2:
        w_TE = _row_softmax(slot_vals_TE, k_mask)
    elif SCORE_FN == 3:
        w_TE = _sigmoid(slot_vals_TE)
    else:
        w_TE = slot_vals_TE
    w_TE = tl.where(k_mask[None, :], w_TE, 0.0)
    if RENORM:
        w_TE = w_TE / (tl.sum(w_TE, axis=1) + renorm_eps)[:, None]
    w_TE = w_TE * scaling
    out_mask = t_mask[:, None] & k_mask[None, :]
    out_off = row_T[:, None] * K + offs_e[None, :]
    tl.store(weights_ptr + out_off, w_TE, mask=out_mask)
    tl.store(ids_ptr + out_off, slot_ids_TE.to(tl.int64), mask=out_mask)


@triton.jit
def _route_backward_kernel(
    grad_w_ptr, logits_ptr, ids_ptr, grad_logits_ptr,  # grad_weights_TK (fp32), logits_TE, ids_TK, grad_logits_TE
    T, E, K, renorm_eps, scaling,
    SCORE_FN: tl.constexpr, RENORM: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
):
    offs_e, t_mask, e_mask, row_T, x_TE = _load_logits(logits_ptr, T, E, BLOCK_T, BLOCK_E)

    # scatter the slot gradients to expert lanes (the K ids of a token are distinct)
    g_TE = tl.zeros([BLOCK_T, BLOCK_E], tl.float32)
    sel_TE = tl.zeros([BLOCK_T, BLOCK_E], tl.float32)
    for k in range(0, K):
        id_T = tl.load(ids_ptr + row_T * K + k, mask=t_mask, other=-1)
        gk_T = tl.load(grad_w_ptr + row_T * K + k, mask=t_mask, other=0.0)
        hit_TE = offs_e[None, :].to(tl.int64) == id_T[:, None]
        g_TE = tl.where(hit_TE, gk_T[:, None], g_TE)
        sel_TE = tl.where(hit_TE, 1.0, sel_TE)
    sel = sel_TE > 0.0

    # raw weights r (before renorm and scaling) on the picked lanes, 0 elsewhere
    if SCORE_FN == 0:
        p_TE = _row_softmax(x_TE, e_mask)
        r_TE = p_TE
    elif SCORE_FN == 2:
        m_T = tl.max(tl.where(sel, x_TE, NEG_INF), axis=1)
        m_T = tl.where(m_T > NEG_INF, m_T, 0.0)  # rows past T pick nothing
        ex_TE = tl.where(sel, tl.exp(x_TE - m_T[:, None]), 0.0)
        s_T = tl.sum(ex_TE, axis=1)
        r_TE = ex_TE / tl.where(s_T > 0.0, s_T, 1.0)[:, None]
    else:
        r_TE = _sigmoid(x_TE)
    r_TE = tl.where(sel, r_TE, 0.0)

    if RENORM:  # w = c * r / S, S = sum(r) + eps:  dr = c * (g / S - sum(g * r) / S^2)
        s_T = tl.sum(r_TE, axis=1) + renorm_eps
        s_T = tl.where(s_T != 0.0, s_T, 1.0)  # rows past T pick nothing
        gr_T = tl.sum(g_TE * r_TE, axis=1)
        dr_TE = scaling * (g_TE / s_T[:, None] - (gr_T / (s_T * s_T))[:, None])
    else:
        dr_TE = scaling * g_TE
    dr_TE = tl.where(sel, dr_TE, 0.0)

    if SCORE_FN == 0:  # softmax adjoint over all experts
        dx_TE = p_TE * (dr_TE - tl.sum(dr_TE * p_TE, axis=1)[:, None])
    elif SCORE_FN == 2:  # softmax adjoint over the K picked logits
        dx_TE = r_TE * (dr_TE - tl.sum(dr_TE * r_TE, axis=1)[:, None])
    else:  # sigmoid adjoint, picked lanes only
        dx_TE = dr_TE * r_TE * (1.0 - r_TE)
    tl.store(grad_logits_ptr + row_T[:, None] * E + offs_e[None, :],
             dx_TE.to(grad_logits_ptr.dtype.element_ty), mask=t_mask[:, None] & e_mask[None, :])


def _check_args(logits_TE, correction_bias_E, top_k, score_fn, n_group, topk_group, group_score):
    if score_fn == "sparsemixer":
        raise NotImplementedError("the Triton router has no sparsemixer (PhiMoE); use the torch reference route_ref")
    reference._check_choice("score_fn", score_fn, tuple(SCORE_FN_CODES))
    reference._check_choice("group_score", group_score, reference.GROUP_SCORES)
    if logits_TE.dim() != 2:
        raise ValueError(f"logits_TE must be 2-D [tokens, experts], got shape {tuple(logits_TE.shape)}; "
                         "flatten the leading dims with logits.reshape(-1, num_experts)")
    if logits_TE.dtype not in LOGIT_DTYPES:
        raise ValueError(f"logits_TE has dtype {logits_TE.dtype}; pass float32, float16 or bfloat16")
    T, E = logits_TE.shape
    if correction_bias_E is not None:
        check_shape("correction_bias_E (one bias per expert)", correction_bias_E, (E,))
        if not correction_bias_E.is_floating_point():
            raise ValueError(f"correction_bias_E has dtype {correction_bias_E.dtype}; pass a floating-point tensor")
    if not 1 <= top_k <= E:
        raise ValueError(f"top_k={top_k} must be between 1 and the number of experts ({E})")
    if n_group < 1 or (n_group > 1 and (E % n_group or not 1 <= topk_group <= n_group)):
        raise ValueError(f"n_group={n_group} must divide the {E} experts and topk_group={topk_group} be 1..n_group")
    if n_group > 1 and group_score == "top2_sum" and E // n_group < 2:
        raise ValueError(f"group_score='top2_sum' needs >= 2 experts per group, got {E // n_group}; use 'max'")
    check_device(logits_TE, correction_bias_E)
    return T, E


def _config(E: int) -> tuple[int, int]:
    block_e = pow2(E, lo=8)
    return _block_t(block_e), block_e


def route(logits_TE, correction_bias_E=None, *, top_k, score_fn="softmax", renormalize=False, renorm_eps=0.0,
          scaling=1.0, n_group=1, topk_group=1, group_score="top2_sum"):
    """``(weights_TK fp32, ids_TK int64)``, equal to ``reference.route_ref`` with the same arguments."""
    T, E = _check_args(logits_TE, correction_bias_E, top_k, score_fn, n_group, topk_group, group_score)
    logits_TE = logits_TE.contiguous()
    weights_TK = torch.empty(T, top_k, dtype=torch.float32, device=logits_TE.device)
    ids_TK = torch.empty(T, top_k, dtype=torch.int64, device=logits_TE.device)
    if T == 0:
        return weights_TK, ids_TK
    grouped = n_group > 1 and score_fn in ("softmax", "sigmoid")  # the reference groups only these
    bias_E = weights_TK if correction_bias_E is None else correction_bias_E.float().contiguous()  # dummy: unread
    block_t, block_e = _config(E)
    _route_kernel[(triton.cdiv(T, block_t),)](
        logits_TE, bias_E, weights_TK, ids_TK, T, E, top_k, n_group, topk_group, float(renorm_eps), float(scaling),
        SCORE_FN=SCORE_FN_CODES[score_fn], HAS_BIAS=correction_bias_E is not None, RENORM=bool(renormalize),
        GROUPED=grouped, GROUP_SCORE=GROUP_SCORE_CODES[group_score] if grouped else 0,
        BLOCK_T=block_t, BLOCK_E=block_e, num_warps=NUM_WARPS,
    )
    return weights_TK, ids_TK


def route_ref(logits_TE, correction_bias_E=None, *, top_k, score_fn="softmax", renormalize=False, renorm_eps=0.0,
              scaling=1.0, n_group=1, topk_group=1, group_score="top2_sum"):
    return reference.route_ref(logits_TE, correction_bias_E, top_k=top_k, score_fn=score_fn, renormalize=renormalize,
                               renorm_eps=renorm_eps, scaling=scaling, n_group=n_group, topk_group=topk_group,
                               group_score=group_score)


def route_backward(grad_weights_TK, logits_TE, ids_TK, correction_bias_E=None, *, top_k, score_fn="softmax",
                   renormalize=False, renorm_eps=0.0, scaling=1.0, n_group=1, topk_group=1, group_score="top2_sum"):
    """grad_logits_TE (dtype of logits): the vjp of ``route``'s weights with ``ids_TK`` fixed. The bias and the
    group limit only choose the ids, so they are checked but not used."""
    T, E = _check_args(logits_TE, correction_bias_E, top_k, score_fn, n_group, topk_group, group_score)
    check_shape("ids_TK", ids_TK, (T, top_k))
    check_shape("grad_weights_TK", grad_weights_TK, (T, top_k))
    if ids_TK.is_floating_point() or ids_TK.is_complex():
        raise ValueError(f"ids_TK has dtype {ids_TK.dtype}; pass the int64 ids returned by route()")
    check_device(logits_TE, ids_TK, grad_weights_TK)
    logits_TE = logits_TE.contiguous()
    grad_logits_TE = torch.empty_like(logits_TE)
    if T == 0:
        return grad_logits_TE
    block_t, block_e = _config(E)
    _route_backward_kernel[(triton.cdiv(T, block_t),)](
        grad_weights_TK.float().contiguous(), logits_TE, ids_TK.long().contiguous(), grad_logits_TE,
        T, E, top_k, float(renorm_eps), float(scaling),
        SCORE_FN=SCORE_FN_CODES[score_fn], RENORM=bool(renormalize), BLOCK_T=block_t, BLOCK_E=block_e,
        num_warps=NUM_WARPS,
    )
    return grad_logits_TE


def _weights_given_ids(logits_TE, ids_TK, score_fn, renormalize, renorm_eps, scaling):
    """reference.route_ref's weights, with the ids given instead of chosen."""
    x_TE = logits_TE.float()
    if score_fn in ("topk_softmax", "topk_sigmoid"):
        vals_TK = x_TE.gather(1, ids_TK)
        w_TK = vals_TK.softmax(dim=-1) if score_fn == "topk_softmax" else torch.sigmoid(vals_TK)
    else:
        w_TK = (x_TE.softmax(dim=-1) if score_fn == "softmax" else torch.sigmoid(x_TE)).gather(1, ids_TK)
    if renormalize:
        w_TK = w_TK / (w_TK.sum(dim=-1, keepdim=True) + renorm_eps)
    return w_TK * scaling if scaling != 1.0 else w_TK


def route_backward_ref(grad_weights_TK, logits_TE, ids_TK, correction_bias_E=None, *, top_k, score_fn="softmax",
                       renormalize=False, renorm_eps=0.0, scaling=1.0, n_group=1, topk_group=1,
                       group_score="top2_sum"):
    if score_fn == "sparsemixer":
        raise NotImplementedError("sparsemixer backward: differentiate reference.route_ref with autograd")
    _, vjp = torch.func.vjp(
        lambda x: _weights_given_ids(x, ids_TK.long(), score_fn, renormalize, renorm_eps, scaling), logits_TE)
    return vjp(grad_weights_TK.float())[0]


def _fwd_target(dtype, score_fn, has_bias, renorm, group_score, block_e):
    """One forward compile target; ``group_score`` None means ungrouped."""
    ptr = LOGIT_DTYPES[dtype]
    sig = {"logits_ptr": ptr, "bias_ptr": "*fp32", "weights_ptr": "*fp32", "ids_ptr": "*i64", "T": "i32", "E": "i32",
           "K": "i32", "n_group": "i32", "topk_group": "i32", "renorm_eps": "fp32", "scaling": "fp32"}
    consts = {"SCORE_FN": SCORE_FN_CODES[score_fn], "HAS_BIAS": has_bias, "RENORM": renorm,
              "GROUPED": group_score is not None, "GROUP_SCORE": GROUP_SCORE_CODES.get(group_score, 0),
              "BLOCK_T": _block_t(block_e), "BLOCK_E": block_e}
    return _route_kernel, {**sig, **{k: "constexpr" for k in consts}}, consts


def _bwd_target(dtype, score_fn, renorm, block_e):
    sig = {"grad_w_ptr": "*fp32", "logits_ptr": LOGIT_DTYPES[dtype], "ids_ptr": "*i64",
           "grad_logits_ptr": LOGIT_DTYPES[dtype], "T": "i32", "E": "i32", "K": "i32", "renorm_eps": "fp32",
           "scaling": "fp32"}
    consts = {"SCORE_FN": SCORE_FN_CODES[score_fn], "RENORM": renorm, "BLOCK_T": _block_t(block_e),
              "BLOCK_E": block_e}
    return _route_backward_kernel, {**sig, **{k: "constexpr" for k in consts}}, consts


# (score_fn, has_bias, renorm, group_score or None, BLOCK_E): every constexpr value, in the shapes models use
_FWD_CONFIGS = (
    ("softmax", False, True, None, 8),  # Mixtral
    ("softmax", False, False, None, 64),  # Qwen2-MoE
    ("softmax", False, False, "max", 64),  # DeepSeek-V2 (greedy group limit)
    ("sigmoid", True, True, "top2_sum", 256),  # DeepSeek-V3
    ("sigmoid", True, True, "max", 128),
    ("sigmoid", False, False, None, 16),
    ("topk_softmax", False, True, None, 8),
    ("topk_sigmoid", True, False, None, 128),  # Llama-4 style
)
_BWD_CONFIGS = tuple((fn, renorm, be) for fn, be in (("softmax", 8), ("sigmoid", 256), ("topk_softmax", 64),
                                                      ("topk_sigmoid", 128)) for renorm in (False, True))


def compile_targets():
    """(jit_fn, signature, constexprs) for each kernel and every configuration the launchers pick."""
    targets = []
    for dtype in LOGIT_DTYPES:
        targets += [_fwd_target(dtype, *cfg) for cfg in _FWD_CONFIGS]
        targets += [_bwd_target(dtype, *cfg) for cfg in _BWD_CONFIGS]
    return targets
