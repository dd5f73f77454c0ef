"""``expert_mlp_ref`` without a Python loop over experts: each projection one ``torch._grouped_mm`` over the
padding-free rows (grouped by expert, in order), the biases gathered per row. Used on CPU by ``moe::expert_mlp``
(forward, and again inside its backward) and by ``moe::expert_mlp_keep`` (which keeps the projections, so its
backward, ``expert_mlp_keep_backward``, is grouped GEMMs alone); the loop of ``reference.py`` stays the meaning.

    x_BH = x_TH[token_ids_B]                    rows of each expert contiguous, offs = cumsum(tokens_per_expert_E)
    up_BI = grouped_mm(x_BH, W_up^T, offs)      (+ gate_BI likewise; + bias[expert of row])
    y_BH  = grouped_mm(act(gate, up), W_down^T, offs)

``torch._grouped_mm`` takes float32, bfloat16 and float16 on CPU, rows whose byte strides are multiples of 16 (its
backward checks that), and no float64: ``usable`` says whether it applies, else the caller runs the loop.
"""

from __future__ import annotations

import torch

from .activations import apply_activation, check_activation
from .layouts import gate_up_weights
from .library import wanted

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def usable(x_TH: torch.Tensor, w_up_EIH: torch.Tensor, w_down_EHI: torch.Tensor) -> bool:
    """Whether ``grouped_mm`` takes these sizes and dtype (forward and backward)."""
    return usable_sizes(w_up_EIH.dtype, w_down_EHI.shape[1], w_up_EIH.shape[1])


def usable_sizes(dtype: torch.dtype, H: int, I: int) -> bool:
    """``usable`` from the weights' dtype, the hidden size H and the intermediate size I."""
    per16 = 16 // dtype.itemsize if dtype in DTYPES else 0
    return bool(per16) and hasattr(torch, "_grouped_mm") and H % per16 == 0 and I % per16 == 0


def expert_mlp_grouped(x_TH, token_ids_B, tokens_per_expert_E, w_gate_EIH, w_up_EIH, w_down_EHI, b_gate_EI=None,
                       b_up_EI=None, b_down_EH=None, input_scale_B=None, *, activation="silu", alpha=1.702,
                       limit=7.0) -> torch.Tensor:
    """The same rows as ``reference.expert_mlp_ref``, through grouped GEMMs (``usable`` must hold)."""
    return expert_mlp_keep(x_TH, token_ids_B, tokens_per_expert_E, w_gate_EIH, w_up_EIH, w_down_EHI, b_gate_EI,
                           b_up_EI, b_down_EH, input_scale_B, activation=activation, alpha=alpha, limit=limit)[0]


class Segments:
    """Rows grouped by expert, in order: their offsets for ``grouped_mm``, the count n of rows computed (rows
    dropped by a capacity sit after them; reading n waits for the device, unless the caller knows it: ``rows``),
    and each row's expert where a bias needs it. The GEMMs over such rows (``kernels/vendor.py`` uses them too)."""

    def __init__(self, counts_E, biased, rows: int | None = None):
        counts = counts_E.to(torch.int64)
        self.offs = counts.cumsum(0).to(torch.int32)
        self.n = n = rows if rows is not None else int(self.offs[-1]) if self.offs.numel() else 0
        self.expert_B = torch.repeat_interleave(torch.arange(counts.shape[0], device=counts.device), counts,
                                                output_size=n) if biased else None

    def mm(self, rows, w, *, t=False):
        """rows[b] @ w[expert of b] (``t``: @ w[expert of b]^T) for every row; a strided view of w (interleaved
        gate/up rows) is copied contiguous first, a transpose is passed as a view."""
        if w.stride(-1) != 1 or w.stride(-2) != w.shape[-1]:  # rows apart (interleaved gate/up); a chunk is fine
            w = w.contiguous()
        return torch._grouped_mm(rows, w.transpose(-2, -1) if t else w, offs=self.offs)

    def outer(self, a_nM, b_nN):
        """sum over each expert's rows of a[b]^T b[b]: [E, M, N] (zeros for an expert without rows)."""
        return torch._grouped_mm(a_nM.t(), b_nN, offs=self.offs)

    def per_expert(self, rows_nN, E):
        """sum over each expert's rows: [E, N] (a bias's gradient)."""
        return rows_nN.new_zeros(E, rows_nN.shape[1]).index_add_(0, self.expert_B, rows_nN)

    def bias(self, out, b):
        return out if b is None else out + b[self.expert_B]

    def pad(self, rows, B):
        return rows if self.n == B else torch.cat([rows, rows.new_zeros(B - self.n, *rows.shape[1:])])


class Rows(Segments):
    """``Segments`` with the routed input rows: gathered from x_TH, and scaled."""

    def __init__(self, x_TH, token_ids_B, counts_E, dtype, input_scale_B, biased, all_rows=False):
        super().__init__(counts_E, biased, token_ids_B.shape[0] if all_rows else None)
        self.tok = token_ids_B[:self.n]
        self.x_BH = x_TH[self.tok].to(dtype)  # before the scale (the scale's gradient needs it)
        self.scale = None if input_scale_B is None else input_scale_B[:self.n].to(dtype).unsqueeze(-1)
        self.xs_BH = self.x_BH if self.scale is None else self.x_BH * self.scale


def _columns(layout: str, I: int) -> tuple[slice, slice]:
    """Where gate and up sit among the 2I columns of the kept projections (a fused weight's own row order; the
    unfused gate then up)."""
    if layout == "interleave":
        return slice(0, None, 2), slice(1, None, 2)
    halves = (slice(0, I), slice(I, 2 * I))
    return halves[::-1] if layout == "chunk_up_first" else halves


def _weights(w_gate_EIH, w_up_EIH, w_down_EHI, w_gate_up, layout):
    """(w_gate, w_up) as views of ``w_gate_up`` where it is given (``runtime/layouts.py``), else as passed."""
    return gate_up_weights(w_gate_EIH, w_up_EIH, w_down_EHI, w_gate_up, layout, "expert_mlp_keep")


def projections(r: Rows, wg, wu, bg, bu, out=None):
    """[g | u] (gated) or u: the projections before the activation, with their biases (each written into its
    half as it is made: no concatenation holding both twice), in the counted rows of ``out`` where given."""
    u = r.bias(r.mm(r.xs_BH, wu, t=True), bu)
    if wg is None:
        if out is None:
            return u
        out[:r.n] = u
        return out[:r.n]
    I = u.shape[1]
    pre = u.new_empty(u.shape[0], 2 * I) if out is None else out[:r.n]
    pre[:, I:] = u
    del u
    pre[:, :I] = r.bias(r.mm(r.xs_BH, wg, t=True), bg)
    return pre


def expert_mlp_keep(x_TH, token_ids_B, tokens_per_expert_E, w_gate_EIH, w_up_EIH, w_down_EHI, b_gate_EI=None,
                    b_up_EI=None, b_down_EH=None, input_scale_B=None, *, activation="silu", alpha=1.702, limit=7.0,
                    w_gate_up=None, gate_up_layout="", all_rows=False):
    """(y_BH, pre_BJ): the rows, and the projections before the activation which ``expert_mlp_keep_backward``
    takes instead of computing them again: [B, 2I] gate and up (``_columns``), or [B, I] up when ungated. With
    ``w_gate_up`` (one [E, 2I, H] weight, its layout as ``runtime/layouts.py`` names it) one GEMM makes both.
    ``all_rows``: the caller knows every row is counted (no capacity drops: the tokens per expert sum to B), so
    the row count is not read from the device (on CUDA that read waits for the GPU)."""
    wg, wu = _weights(w_gate_EIH, w_up_EIH, w_down_EHI, w_gate_up, gate_up_layout)
    check_activation(activation, gated=wg is not None)
    dtype, B, I = wu.dtype, token_ids_B.shape[0], wu.shape[1]
    r = Rows(x_TH, token_ids_B, tokens_per_expert_E, dtype, input_scale_B,
             any(b is not None for b in (b_gate_EI, b_up_EI, b_down_EH)), all_rows)
    gs, us = _columns(gate_up_layout, I)
    if w_gate_up is None:
        pre = projections(r, wg, wu, b_gate_EI, b_up_EI)
    else:
        pre = r.mm(r.xs_BH, w_gate_up, t=True)
        if b_gate_EI is not None or b_up_EI is not None:
            pre[:, gs] = r.bias(pre[:, gs], b_gate_EI)
            pre[:, us] = r.bias(pre[:, us], b_up_EI)
    gate, up = (pre[:, gs], pre[:, us]) if wg is not None else (None, pre)
    h = apply_activation(activation, gate, up, alpha=alpha, limit=limit)
    y = r.bias(r.mm(h, w_down_EHI, t=True), b_down_EH)
    return r.pad(y, B), r.pad(pre, B)


def expert_mlp_keep_backward(grad_y_BH, pre_BJ, x_TH, token_ids_B, tokens_per_expert_E, w_gate_EIH, w_up_EIH,
                             w_down_EHI, b_gate_EI=None, b_up_EI=None, b_down_EH=None, input_scale_B=None, *,
                             activation="silu", alpha=1.702, limit=7.0, w_gate_up=None, gate_up_layout="",
                             all_rows=False, needs=None) -> list[torch.Tensor]:
    """Gradients of the present tensors among (x, w_gate, w_up, w_down, b_gate, b_up, b_down, input_scale,
    w_gate_up), from the kept projections: grouped GEMMs and the activation's elementwise derivative, no forward
    again. ``w_gate_up``'s gradient is one tensor in its own layout. ``needs``: one flag per tensor named; only
    the gradients of those present and flagged are computed and returned (a frozen weight's GEMM is not run, nor
    dx's two when neither x nor the scale needs one)."""
    present = (x_TH, w_gate_EIH, w_up_EIH, w_down_EHI, b_gate_EI, b_up_EI, b_down_EH, input_scale_B, w_gate_up)
    names = ("x", "wg", "wu", "wd", "bg", "bu", "bd", "scale", "gu")
    want = {names[i] for i in wanted(present, needs)}
    wg, wu = _weights(w_gate_EIH, w_up_EIH, w_down_EHI, w_gate_up, gate_up_layout)
    gated, E, I, dtype = wg is not None, wu.shape[0], wu.shape[1], wu.dtype
    r = Rows(x_TH, token_ids_B, tokens_per_expert_E, dtype, input_scale_B,
             any(b is not None for b in (b_gate_EI, b_up_EI, b_down_EH)), all_rows)
    n = r.n
    gy = grad_y_BH[:n].to(dtype).contiguous()  # an expanded gradient has zero strides grouped_mm refuses
    gs, us = _columns(gate_up_layout, I)
    pre = pre_BJ[:n]
    h, d_pre = activation_backward(activation, pre, gs if gated else None, us, alpha, limit,
                                    lambda h: r.mm(gy, w_down_EHI))
    grads = dict.fromkeys(names)
    d_xs = None
    if want & {"x", "scale"}:
        d_xs = (r.mm(d_pre, w_gate_up) if w_gate_up is not None else
                r.mm(d_pre[:, gs], wg) + r.mm(d_pre[:, us], wu) if gated else r.mm(d_pre, wu))
    if "gu" in want:
        grads["gu"] = r.outer(d_pre, r.xs_BH)
    if "wg" in want:
        grads["wg"] = r.outer(d_pre[:, gs], r.xs_BH)
    if "wu" in want:
        grads["wu"] = r.outer(d_pre[:, us] if gated else d_pre, r.xs_BH)
    if "x" in want:
        d_x_BH = d_xs if r.scale is None else d_xs * r.scale
        grads["x"] = x_TH.new_zeros(x_TH.shape).index_add_(0, r.tok, d_x_BH.to(x_TH.dtype))
    if "wd" in want:
        grads["wd"] = r.outer(gy, h)
    if "bg" in want:
        grads["bg"] = r.per_expert(d_pre[:, gs], E)
    if "bu" in want:
        grads["bu"] = r.per_expert(d_pre[:, us] if gated else d_pre, E)
    if "bd" in want:
        grads["bd"] = r.per_expert(gy, E)
    if "scale" in want:
        d_scale = (d_xs * r.x_BH).sum(-1)
        grads["scale"] = torch.cat([d_scale, d_scale.new_zeros(input_scale_B.shape[0] - n)])
    return [grads[k].to(t.dtype) for k, t in zip(names, present) if k in want]


def activation_backward(activation, pre, gs, us, alpha, limit, grad_h, h_out=None, d_pre=None):
    """(h, d_pre): the activation again from the kept projections, and its derivative at ``grad_h(h)`` written
    into the projections' columns; into ``h_out`` and ``d_pre`` where given (no copy afterwards). Gated silu
    (SwiGLU, most models) by hand with no temporaries beyond h's; the rest through ``torch.func.vjp`` of
    ``apply_activation``, the meaning."""
    if gs is None:
        h, act_vjp = torch.func.vjp(lambda u: apply_activation(activation, None, u, alpha=alpha, limit=limit), pre)
        h = _into(h_out, h)
        return h, _into(d_pre, act_vjp(grad_h(h))[0])
    gate, up = pre[:, gs], pre[:, us]
    d_pre = pre.new_empty(pre.shape) if d_pre is None else d_pre
    if activation == "silu":  # h = silu(g) u: dh/du = silu(g), dh/dg = u silu'(g)
        silu_g = torch.nn.functional.silu(gate)
        h = torch.mul(silu_g, up, out=h_out) if h_out is not None else silu_g * up
        d_h = grad_h(h)
        torch.mul(d_h, silu_g, out=d_pre[:, us])
        del silu_g
        torch.ops.aten.silu_backward.grad_input(d_h * up, gate, grad_input=d_pre[:, gs])
        return h, d_pre
    h, act_vjp = torch.func.vjp(lambda g, u: apply_activation(activation, g, u, alpha=alpha, limit=limit), gate, up)
    h = _into(h_out, h)
    d_pre[:, gs], d_pre[:, us] = act_vjp(grad_h(h))
    return h, d_pre


def _into(out, value):
    """``value`` copied into ``out`` (and ``out`` returned), or ``value`` itself when there is no ``out``."""
    return value if out is None else out.copy_(value)
