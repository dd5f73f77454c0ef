"""Deterministic combine: each token's K expert rows summed in a fixed order, with no float atomics.

Legend: T tokens, K experts per token, B = T*K routed rows (sorted by expert), H hidden, E experts.

    invert     rows_TK[src_B[b]] = b          where each assignment (t, k) of the flat ids_TK sits in the buffer
    combine    out_TH[t] = sum_k w[r] * y_BH[r]   over r = rows_TK[t, k], k = 0..K-1 in order, fp32 sums;
               rows past the counted ones (capacity-dropped tail, never computed) are skipped

The forward's weighted combine (y rows times combine weights) and the backward's gather adjoint (dx from the
gathered rows' gradients times the input scale) are both this kernel. A scatter-add with float atomics adds a
token's rows in whatever order the programs finish, so its result changes from run to run in the last bits; here
each output element is owned by one program that adds its K rows in k order: the same inputs give bitwise the same
output. (It is also faster: on an H100, Mixtral-8x7B at 4096 tokens, the down GEMM with the atomic scatter-add in
its epilogue took 3.35 ms, the GEMM storing y rows 2.10 ms plus 0.47 ms for a separate combine,
``../shared/measurements/h100-2026-11-23.md``.)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import check_shape, target

BLOCK_T = 16  # tokens per program: K row loads each, so few tokens keep the gather's index math cheap
BLOCK_H = 128  # columns per program: 256-byte (bf16) row segments, coalesced
INVERT_BLOCK = 1024


@triton.jit
def _invert_kernel(src_ptr, rows_ptr, B, BLOCK: tl.constexpr):
    """rows[src[b]] = b: the buffer row of every flat assignment (src is a permutation of 0..B-1)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < B
    src = tl.load(src_ptr + offs, mask=ok, other=0)
    tl.store(rows_ptr + src, offs.to(tl.int64), mask=ok)


@triton.jit
def _combine_kernel(
    y_ptr, sy, w_ptr, rows_ptr, counts_ptr, out_ptr, T, K, H, E,
    HAS_W: tl.constexpr, ROUND_W: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    """Grid (token tiles, H tiles): out[t, h] = sum over k in order of w[r] * y[r, h], r = rows[t * K + k]. Rows at
    or past the counted total (dropped by a capacity: never computed) add nothing. ROUND_W rounds each weight to
    y's dtype first (the input scale multiplies the rows in the weights' dtype in the reference)."""
    offs_e = tl.arange(0, BLOCK_E)
    total = tl.sum(tl.load(counts_ptr + offs_e, mask=offs_e < E, other=0), axis=0)
    offs_t = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    t_ok = offs_t < T
    h_ok = offs_h < H
    acc = tl.zeros((BLOCK_T, BLOCK_H), tl.float32)
    for k in range(0, K):
        r = tl.load(rows_ptr + offs_t * K + k, mask=t_ok, other=0)
        r_ok = t_ok & (r < total)
        y = tl.load(y_ptr + r[:, None] * sy + offs_h[None, :], mask=r_ok[:, None] & h_ok[None, :], other=0.0)
        y = y.to(tl.float32)
        if HAS_W:
            w = tl.load(w_ptr + r, mask=r_ok, other=0.0)
            if ROUND_W:
                w = w.to(y_ptr.dtype.element_ty)
            y = y * w.to(tl.float32)[:, None]
        acc += y
    tl.store(out_ptr + offs_t[:, None] * H + offs_h[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=t_ok[:, None] & h_ok[None, :])


# ---- host launchers ------------------------------------------------------------------------------------------


def token_rows(token_ids_B: torch.Tensor, num_tokens: int, src_B: torch.Tensor | None = None) -> torch.Tensor:
    """rows_TK: the buffer rows of each token's K assignments, in k order. From the PFT's ``src_B`` (a
    permutation of the flat assignments) by one scatter kernel; without it, by a stable sort of the token ids
    (rows of one token in buffer order: the same sums, another order of the k terms)."""
    B = token_ids_B.shape[0]
    if num_tokens == 0 or B % num_tokens:
        raise ValueError(f"{B} routed rows for {num_tokens} tokens: expected K rows per token (B = T*K)")
    K = B // num_tokens
    if src_B is None:
        return torch.argsort(token_ids_B, stable=True).view(num_tokens, K)
    check_shape("src_B", src_B, (B,))
    rows = torch.empty(B, dtype=torch.int64, device=src_B.device)
    _invert_kernel[(triton.cdiv(B, INVERT_BLOCK),)](src_B.contiguous(), rows, B, BLOCK=INVERT_BLOCK)
    return rows.view(num_tokens, K)


def combine(y_BH, rows_TK, tokens_per_expert_E, weights_B=None, *, out_dtype, round_weights=False):
    """out_TH[t] = sum over k of weights[r] * y[r], r = rows_TK[t, k] (rows past the counted ones skipped): fp32
    sums in a fixed order, stored in ``out_dtype``."""
    T, K = rows_TK.shape
    B, H = y_BH.shape
    E = tokens_per_expert_E.shape[0]
    check_shape("weights_B", weights_B, (B,))
    if y_BH.stride(1) != 1:
        y_BH = y_BH.contiguous()
    out = torch.empty(T, H, dtype=out_dtype, device=y_BH.device)
    if T == 0:
        return out
    w = weights_B.contiguous() if weights_B is not None else y_BH
    grid = (triton.cdiv(T, BLOCK_T), triton.cdiv(H, BLOCK_H))
    _combine_kernel[grid](
        y_BH, y_BH.stride(0), w, rows_TK.contiguous(), tokens_per_expert_E.contiguous(), out, T, K, H, E,
        HAS_W=weights_B is not None, ROUND_W=round_weights, BLOCK_T=BLOCK_T, BLOCK_H=BLOCK_H,
        BLOCK_E=triton.next_power_of_2(E), num_warps=4,
    )
    return out


def combine_ref(y_BH, rows_TK, tokens_per_expert_E, weights_B=None, *, out_dtype, round_weights=False):
    total = int(tokens_per_expert_E.sum())
    rows = y_BH.float()
    if weights_B is not None:
        w = weights_B.to(y_BH.dtype) if round_weights else weights_B
        rows = rows * w.float()[:, None]
    rows = torch.where((torch.arange(y_BH.shape[0], device=y_BH.device) < total)[:, None], rows, 0.0)
    return rows[rows_TK].sum(1).to(out_dtype)


# ---- compile targets (CI compiles each for sm_90) ------------------------------------------------------------


def compile_targets():
    out = [target(_invert_kernel, {"src_ptr": torch.int64, "rows_ptr": torch.int64}, dict(BLOCK=INVERT_BLOCK))]
    for y_dt, w_dt, out_dt, has_w, round_w in (
        (torch.bfloat16, torch.float32, torch.float32, True, False),  # forward combine, fp32 router weights
        (torch.bfloat16, torch.float32, torch.bfloat16, True, True),  # dx with an input scale (Llama4)
        (torch.float16, torch.float16, torch.float16, False, False),  # dx, plain sum
        (torch.float32, torch.float32, torch.float32, True, False),
    ):
        ptrs = {"y_ptr": y_dt, "w_ptr": w_dt, "rows_ptr": torch.int64, "counts_ptr": torch.int64, "out_ptr": out_dt}
        consts = dict(HAS_W=has_w, ROUND_W=round_w, BLOCK_T=BLOCK_T, BLOCK_H=BLOCK_H, BLOCK_E=256)
        out.append(target(_combine_kernel, ptrs, consts, num_warps=4, aligned=("sy", "H")))
    return out
