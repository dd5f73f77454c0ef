"""What the forward and backward grouped kernels share: the tile schedule over variable-size expert segments (on
the device), the checks of an expert MLP call (on the host) and what their compile targets specialise.

    segments(counts)   rows per expert and each expert's first row (exclusive prefix sum), in the kernel
    locate(t, counts)  row tile t -> (expert e, its rows, mask): tiles numbered expert by expert,
                       ceil(rows_e / BLOCK_M) each; a tile past the last does nothing
    tile_of(pid)       program pid -> (row tile, column tile), GROUP_M row tiles walking the column tiles
                       together (their rows stay in L2 while the weights stream past)
    max_tiles(B, E, M) the static grid bound ceil(B / M) + E: no tile count travels to the host
    proj_tile          the [M, N] gate/up projection tile of gathered rows (rounded as the reference rounds)

Segments are never padded in memory: a tile past its expert's rows masks them.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..activations import check_activation
from .common import check_device, check_shape

# ---- tile schedule (device) ----------------------------------------------------------------------------------


def max_tiles(B: int, E: int, block_m: int) -> int:
    return triton.cdiv(B, block_m) + E  # sum of ceil(n_e / M) <= B / M + E


@triton.jit
def segments(counts_ptr, E, BLOCK_E: tl.constexpr):
    """Rows per expert and each expert's first row (exclusive prefix sum), from tokens_per_expert_E."""
    offs_e = tl.arange(0, BLOCK_E)
    counts = tl.load(counts_ptr + offs_e, mask=offs_e < E, other=0).to(tl.int32)
    return offs_e, counts, tl.cumsum(counts, axis=0) - counts


@triton.jit
def locate(t, counts_ptr, E, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr):
    """Expert ``e`` of row tile ``t`` (>= E past the last tile), its rows and the mask of real ones. Tiles are
    numbered expert by expert, ceil(rows_e / BLOCK_M) each, from the counts alone: nothing precomputed."""
    offs_e, counts, first_row = segments(counts_ptr, E, BLOCK_E)
    tiles = (counts + (BLOCK_M - 1)) // BLOCK_M
    tile_end = tl.cumsum(tiles, axis=0)
    e = tl.sum((tile_end <= t).to(tl.int32), axis=0)  # padded lanes end at the total: counted only past it
    is_e = offs_e == e
    first_tile = tl.sum(tl.where(is_e, tile_end - tiles, 0), axis=0)
    row0 = tl.sum(tl.where(is_e, first_row, 0), axis=0)
    nrows = tl.sum(tl.where(is_e, counts, 0), axis=0)
    local = (t - first_tile) * BLOCK_M + tl.arange(0, BLOCK_M)
    valid = e < E
    rows_ok = (local < nrows) & valid
    return e, row0 + local, rows_ok, valid


@triton.jit
def tile_of(pid, num_tiles, num_n, GROUP_M: tl.constexpr):
    """(row tile, column tile) of program ``pid`` of a 1-D grid of num_tiles x num_n programs. Programs run about
    in pid order; taken row tile by row tile for each column (the 2-D grid's order), every wave read the rows of
    every tile again, e.g. up_act's x rows (64 MB at Mixtral's 4096 tokens, more than an H100's 50 MB L2) once per
    two column tiles. Here GROUP_M consecutive row tiles (mostly one expert's) take every column tile before the
    next GROUP_M start: their rows are read from memory about once, each expert's weights about once per group
    (the grouped ordering of Triton's matmul tutorial). GROUP_M = 0: the 2-D grid's order."""
    if GROUP_M == 0:
        return pid % num_tiles, pid // num_tiles
    per_group = GROUP_M * num_n
    first = (pid // per_group) * GROUP_M
    height = tl.minimum(num_tiles - first, GROUP_M)
    local = pid % per_group
    return first + local % height, local // height


@triton.jit
def load_scale(s_ptr, rows, rows_ok, HAS_SCALE: tl.constexpr, DT: tl.constexpr):
    if HAS_SCALE:
        return tl.load(s_ptr + rows, mask=rows_ok, other=0.0).to(DT).to(tl.float32)
    else:
        return tl.full(rows.shape, 1.0, tl.float32)


@triton.jit
def proj_tile(
    x_ptr, sxt, sxh, tok, scale, rows_ok, e64, n0, H, I,
    wg_ptr, sge, sgi, sgh, wu_ptr, sue, sui, suh, bg_ptr, sbge, bu_ptr, sbue,
    GATED: tl.constexpr, HAS_BG: tl.constexpr, HAS_BU: tl.constexpr, HAS_SCALE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PREC: tl.constexpr,
):
    """fp32 [M, N] tiles (gate, up) of the projections of rows ``tok`` of expert ``e64``, columns n0 + [0, N),
    each rounded to the weights' dtype as the reference rounds them (gate is up when not GATED)."""
    DT = wu_ptr.dtype.element_ty
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_ok = offs_n < I
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, H, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < H
        a = tl.load(x_ptr + tok[:, None] * sxt + offs_k[None, :] * sxh, mask=rows_ok[:, None] & k_ok[None, :],
                    other=0.0)
        a = a.to(DT)
        if HAS_SCALE:
            a = (a.to(tl.float32) * scale[:, None]).to(DT)
        w_mask = k_ok[:, None] & n_ok[None, :]
        wu = tl.load(wu_ptr + e64 * sue + offs_n[None, :] * sui + offs_k[:, None] * suh, mask=w_mask, other=0.0)
        acc_u += tl.dot(a, wu, input_precision=PREC)
        if GATED:
            wg = tl.load(wg_ptr + e64 * sge + offs_n[None, :] * sgi + offs_k[:, None] * sgh, mask=w_mask, other=0.0)
            acc_g += tl.dot(a, wg, input_precision=PREC)
    if HAS_BU:
        acc_u += tl.load(bu_ptr + e64 * sbue + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    if GATED:
        if HAS_BG:
            acc_g += tl.load(bg_ptr + e64 * sbge + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        return acc_g.to(DT).to(tl.float32), acc_u.to(DT).to(tl.float32)
    else:
        return acc_u.to(DT).to(tl.float32), acc_u.to(DT).to(tl.float32)


# ---- compile targets: what both grouped modules compile for sm_90 (tests/test_kernels_compile.py) ------------

# (GATED, HAS_BG, HAS_BU, HAS_BD, HAS_SCALE, HAS_CW, ACT): Mixtral-like, GPT-OSS-like, Llama4-like, ungated
FLAG_SETS = (
    (True, False, False, False, False, True, 0), (True, True, True, True, False, True, 5),
    (True, False, False, False, True, False, 0), (False, False, True, True, False, True, 1),
)


# what a launch at real sizes specialises: unit inner strides (contiguous x and weights), 16-divisible widths
REAL_LAUNCH = dict(unit=("sxh", "sgh", "suh", "sdi"),
                   aligned=("sxt", "sge", "sgi", "sue", "sui", "sde", "sdh", "sbge", "sbue", "sbde", "sdr", "H", "I",
                            "spr"))


# ---- host checks ---------------------------------------------------------------------------------------------


def check_expert_args(x_TH, token_ids_B, tokens_per_expert_E, w_gate_EIH, w_up_EIH, w_down_EHI, b_gate_EI, b_up_EI,
                      b_down_EH, input_scale_B, activation):
    """Shapes, dtypes and devices of an expert MLP call; returns (B, E, H, I)."""
    check_activation(activation, gated=w_gate_EIH is not None)
    check_device(x_TH, token_ids_B, tokens_per_expert_E, w_gate_EIH, w_up_EIH, w_down_EHI, b_gate_EI, b_up_EI,
                 b_down_EH, input_scale_B)
    if x_TH.dim() != 2 or w_up_EIH.dim() != 3:
        raise ValueError(f"expected x [T, H] and w_up [E, I, H]; got {tuple(x_TH.shape)} and {tuple(w_up_EIH.shape)}")
    E, I, H = w_up_EIH.shape
    B = token_ids_B.shape[0]
    check_shape("x_TH", x_TH, (x_TH.shape[0], H))
    check_shape("w_gate_EIH", w_gate_EIH, (E, I, H))
    check_shape("w_down_EHI", w_down_EHI, (E, H, I))
    check_shape("tokens_per_expert_E", tokens_per_expert_E, (E,))
    check_shape("b_gate_EI", b_gate_EI, (E, I))
    check_shape("b_up_EI", b_up_EI, (E, I))
    check_shape("b_down_EH", b_down_EH, (E, H))
    check_shape("input_scale_B", input_scale_B, (B,))
    if token_ids_B.dim() != 1 or token_ids_B.dtype.is_floating_point:
        raise ValueError(f"token_ids_B must be a 1-D integer tensor, got {token_ids_B.dtype} "
                         f"{tuple(token_ids_B.shape)}")
    dtypes = {t.dtype for t in (w_gate_EIH, w_up_EIH, w_down_EHI) if t is not None}
    if len(dtypes) != 1:
        raise ValueError(f"expert weights must share one dtype, got {sorted(map(str, dtypes))}")
    return B, E, H, I


def check_pre(name: str, pre, B: int, I: int, gated: bool, dtype) -> None:
    """The kept projections before the activation: [B, 2I] ([gate | up]) or [B, I] (ungated), the weights'
    dtype, unit column stride (the kernels read and write them by row)."""
    if pre is None:
        return
    check_shape(name, pre, (B, 2 * I if gated else I))
    if pre.dtype != dtype or pre.stride(1) != 1:
        raise ValueError(f"{name} must be {dtype} with unit column stride, got {pre.dtype} strides {pre.stride()}")


def opt_bias(t, dummy):
    """(tensor or a dummy pointer, its leading stride) for an optional bias: the kernels read a bias row with
    unit stride (GPT-OSS's interleaved biases are strided views: copied here, they are small)."""
    if t is None:
        return dummy, 0
    t = t.contiguous()
    return t, t.stride(0)


def rows_contiguous(*vectors):
    """The per-row vectors (token ids, scales, weights) as the kernels index them: unit stride."""
    return [None if v is None else v.contiguous() for v in vectors]
