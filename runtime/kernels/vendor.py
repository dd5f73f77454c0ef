"""The vendor's grouped GEMM (``torch._grouped_mm``: CUTLASS on an H100) for each role of the grouped GEMM
kernels, as a candidate the tuner times beside the Triton tiles (``tuning.py``): a role whose vendor form is
fastest on this GPU and shape runs it instead of its kernel, the other roles of the same layer keep theirs.

Each function writes the buffers the role's kernel writes (rows past the counted ones are left as the kernel
leaves them), rounding as the torch reference does: gathered rows in the weights' dtype, GEMM outputs in it.
The fused epilogues of the kernels (gather, bias, activation, the partial sums for the combine weights' and the
row scales' gradients) run as torch ops around the GEMMs. Unlike the kernels, each reads the number of counted
rows (one wait for the device: that cost is in what the tuner times), except with ``all_rows``: every row is
counted (no capacity drops a row, the lower pass knows it), so the count is the buffer's length.

    role        kernel (grouped_mlp*.py)                         here
    up_act      gather, [gate,] up GEMM, bias, activation -> h    Rows, grouped_mm x2, apply_activation
    down        h @ Wd^T + bd -> y rows                          grouped_mm
    dh          recompute g, u, h; G = dout[tok] @ Wd; dcw; act'  grouped_mm x3, activation_backward
    dh_kept     dh reading the forward's kept g, u (pre rows)     grouped_mm x1, activation_backward
    dx          dxs = dg @ Wg + du @ Wu; partial sums for ds, dcw grouped_mm x2
    wgrad_*     dW[e] = A_e^T C_e, db[e] = column sums of A_e    grouped_mm over the rows (K = rows)
"""

from __future__ import annotations

import functools

import torch

from ..activations import apply_activation
from ..grouped_cpu import Rows, Segments, activation_backward, projections, usable_sizes


CHUNK = 1 << 24  # elements of one float32 temporary (64 MiB) in the row-wise epilogues, which run a slice of rows
# at a time: at Mixtral's T = 16384 whole-width float32 copies of [rows, I] were 1.75 GiB each on the H100


def _row_slices(n: int, width: int):
    """Slices covering rows 0..n in steps of at most CHUNK elements of ``width`` columns."""
    step = max(1, CHUNK // max(1, width))
    return [slice(i, min(i + step, n)) for i in range(0, n, step)]


WGRAD_CHUNK = 1 << 27  # elements of one weight-gradient temporary [E, m, N] (256 MiB in bf16): grouped_mm has
# no out=, so each slice of A's columns is computed and copied into the gradient. Computed whole, the [E, 2I, H]
# temporary of the gate/up gradient was 1.75 GiB beside the gradient itself at Mixtral's widths (the H200's
# 5.25 GiB forward+backward peak at 4096 tokens, against Inductor's 3.19, is about that much more).


def _column_slices(M: int, per_column: int):
    """(m0, m1) covering columns 0..M, each at most WGRAD_CHUNK // per_column columns (one slice when all fit),
    cut at multiples of 8 columns (a slice of A then starts a multiple of 16 bytes in, as grouped_mm wants)."""
    step = max(8, WGRAD_CHUNK // max(1, per_column) // 8 * 8)
    return [(m0, min(m0 + step, M)) for m0 in range(0, M, step)]


def candidate(dtype: torch.dtype, n1: int, n2: int, role_fn, /, *args, **kwargs):
    """``role_fn(*args, **kwargs)`` as a zero-argument call, or None where ``torch._grouped_mm`` does not take
    the role's dtype and operand widths (rows of 16 bytes)."""
    return functools.partial(role_fn, *args, **kwargs) if usable_sizes(dtype, n1, n2) else None


def _split(wg, I):
    return (slice(0, I), slice(I, 2 * I)) if wg is not None else (None, slice(None))


def up_act(h_out, x_TH, token_ids_B, counts_E, w_gate_EIH, w_up_EIH, b_gate_EI, b_up_EI, input_scale_B, *,
           activation, alpha, limit, all_rows=False, pre_out=None):
    """h rows: the activated projections of the gathered (and scaled) rows; the projections themselves into
    ``pre_out``'s rows where given (kept for backward)."""
    biased = b_gate_EI is not None or b_up_EI is not None
    r = Rows(x_TH, token_ids_B, counts_E, w_up_EIH.dtype, input_scale_B, biased, all_rows)
    pre = projections(r, w_gate_EIH, w_up_EIH, b_gate_EI, b_up_EI, out=pre_out)
    gs, us = _split(w_gate_EIH, w_up_EIH.shape[1])
    h_out[:r.n] = apply_activation(activation, None if gs is None else pre[:, gs], pre[:, us], alpha=alpha,
                                   limit=limit)


def down(y_out, h_BI, counts_E, w_down_EHI, b_down_EH, *, all_rows=False):
    """y rows: h @ Wd[e]^T + bd[e]."""
    s = Segments(counts_E, b_down_EH is not None, h_BI.shape[0] if all_rows else None)
    y_out[:s.n] = s.bias(s.mm(h_BI[:s.n], w_down_EHI, t=True), b_down_EH)


def dh(x_TH, token_ids_B, input_scale_B, combine_weights_B, counts_E, dout_TH, w_gate_EIH, w_up_EIH, w_down_EHI,
       b_gate_EI, b_up_EI, *, activation, alpha, limit, h_out, dgu_out, all_rows=False, pre=None):
    """h rows again, [dg | du] (or du) rows; returns <h, dout[tok] @ Wd> per row as [B, 1] fp32 partial sums (the
    combine weights' gradient) when there are combine weights, else None. ``pre``: the projections the forward
    kept (read, not recomputed: no gathered x, one GEMM)."""
    dt, I = w_up_EIH.dtype, w_up_EIH.shape[1]
    pcw_out = None if combine_weights_B is None else torch.zeros(token_ids_B.shape[0], 1, device=x_TH.device)
    if pre is None:
        r = Rows(x_TH, token_ids_B, counts_E, dt, input_scale_B, b_gate_EI is not None or b_up_EI is not None,
                 all_rows)
        pre = projections(r, w_gate_EIH, w_up_EIH, b_gate_EI, b_up_EI)
        tok = r.tok
    else:
        r = Segments(counts_E, False, token_ids_B.shape[0] if all_rows else None)
        pre, tok = pre[:r.n], token_ids_B[:r.n]
    G = r.mm(dout_TH[tok].to(dt), w_down_EHI)

    def grad_h(h):
        if combine_weights_B is None:
            return G
        scaled = torch.empty_like(G)
        for rows in _row_slices(r.n, I):  # float32 copies, multiplied in place
            g = G[rows].to(torch.float32, copy=True)
            pcw_out[rows, 0] = h[rows].to(torch.float32, copy=True).mul_(g).sum(1)
            scaled[rows] = g.mul_(combine_weights_B[rows].float()[:, None])  # rounded to dt as it is written
        return scaled

    gs, us = _split(w_gate_EIH, I)
    activation_backward(activation, pre, gs, us, alpha, limit, grad_h, h_out=h_out[:r.n], d_pre=dgu_out[:r.n])
    return pcw_out


def dx(x_TH, token_ids_B, counts_E, dgu, dout_TH, w_gate_EIH, w_up_EIH, b_down_EH, *, dxs_out, scale, bd_dcw,
       all_rows=False):
    """dxs rows = dg @ Wg[e] + du @ Wu[e] (summed in fp32, then rounded); returns [B, 1] fp32 partial sums
    <dxs, x[tok]> (with a row ``scale``) and <bd[e], dout[tok]> (``bd_dcw``), each None when not asked."""
    dt, I = w_up_EIH.dtype, w_up_EIH.shape[1]
    ps_out, pbd_out = (torch.zeros(token_ids_B.shape[0], 1, device=x_TH.device) if want else None
                       for want in (scale, bd_dcw))
    s = Segments(counts_E, pbd_out is not None, token_ids_B.shape[0] if all_rows else None)
    n = s.n
    up = s.mm(dgu[:n, I:] if w_gate_EIH is not None else dgu[:n], w_up_EIH)
    gate = None if w_gate_EIH is None else s.mm(dgu[:n, :I], w_gate_EIH)
    tok = token_ids_B[:n]
    for rows in _row_slices(n, x_TH.shape[1]):
        acc = up[rows].float()
        if gate is not None:
            acc += gate[rows]
        dxs_out[rows] = acc  # rounded to dt
        if ps_out is not None:
            ps_out[rows, 0] = x_TH[tok[rows]].to(dt).float().mul_(dxs_out[rows]).sum(1)  # a gathered copy
        if pbd_out is not None:
            pbd_out[rows, 0] = dout_TH[tok[rows]].float().mul_(b_down_EH[s.expert_B[rows]]).sum(1)
    return ps_out, pbd_out


def wgrad(a, a_tok, a_scale, c, c_tok, c_scale, counts_E, dws, dbs, *, split, dtype, all_rows=False):
    """dW[e] = A_e^T C_e over expert e's rows into ``dws`` (its halves of A's columns with ``split``), the column
    sums of A_e into ``dbs`` when given; A row r is a[a_tok[r]] * a_scale[r] (rounded once), C likewise with the
    scale rounded to the dtype first (the reference's gather)."""
    rows = (a_tok if a_tok is not None else a).shape[0] if all_rows else None
    s = Segments(counts_E, dbs is not None, rows)
    n = s.n
    A = a[a_tok[:n]] if a_tok is not None else a[:n]
    A = A.to(dtype) if a_scale is None else (A.float() * a_scale[:n].float()[:, None]).to(dtype)
    C = (c[c_tok[:n]] if c_tok is not None else c[:n]).to(dtype)
    if c_scale is not None:
        C = (C.float() * c_scale[:n].to(dtype).float()[:, None]).to(dtype)
    E, M, N = counts_E.shape[0], A.shape[1], C.shape[1]
    halves = ((0, split), (split, M)) if split else ((0, M),)
    for m0, m1 in _column_slices(M, E * N):
        dw = s.outer(A[:, m0:m1], C)
        db = s.per_expert(A[:, m0:m1].float(), E) if dbs is not None else None
        for i, (lo, hi) in enumerate(halves):  # the parts of this slice in each gradient
            a, b = max(m0, lo), min(m1, hi)
            if a < b:
                dws[i][:, a - lo:b - lo] = dw[:, a - m0:b - m0]
                if db is not None:
                    dbs[i][:, a - lo:b - lo] = db[:, a - m0:b - m0]
        del dw, db
