"""Forward expert kernels over the padding-free token buffer: grouped GEMMs on variable-size expert segments.

Legend: T tokens, B routed rows (sorted by expert), E experts, H hidden, I expert intermediate, M/N/K tile sizes.

    up_act          h_BI = act(x[token_ids] * s @ w_gate[e]^T + b_gate, x[token_ids] * s @ w_up[e]^T + b_up)
    down            y_BH = h_BI @ w_down[e]^T + b_down
    down_combine    down, then out_TH[t] = sum_k cw * y over each token's rows in k order (combine.py: no atomics)
    fused_experts   up_act + down_combine; or the persistent form: ONE launch in which each program walks row
                    tiles of every expert and runs the whole MLP of its tile (h kept in a per-program scratch,
                    never a [B, I] tensor), storing y rows; then the combine

Segments are never padded to a block multiple in memory. Row tiles are numbered expert by expert
(``grouped_common.locate``: tiles_E = ceil(rows_E / BLOCK_M), computed in the kernel from the counts); a tile past
the end of its expert's rows masks them, and a tile number past the last tile does nothing. The grid is a static
upper bound (ceil(B / BLOCK_M) + E tiles), so no tile count ever travels to the host: nothing here synchronises
with the GPU.

Gated activations read (gate, up); the ungated ones apply to up alone (``GATED=False``). Arithmetic is fp32 in
registers; the gathered rows are rounded to the weights' dtype before the dot, as the torch reference does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import reference as ref
from . import combine as cb
from . import tuning
from . import vendor as vd
from .common import (ACT_CODES, act_fwd, check_device, check_shape, dot_precision, interpreting, launch_kernel,
                     target)
from .grouped_common import (FLAG_SETS, REAL_LAUNCH, check_expert_args, check_pre, load_scale, locate, max_tiles,
                             opt_bias, proj_tile, rows_contiguous, tile_of)
from .tiles import gpu_config, gpu_configs, group_m, halved_n, rule_config, run_role, tuner_configs

# ---- tile bodies (shared by the separate kernels and the fused one) ------------------------------------------


@triton.jit
def _up_tile(
    x_ptr, sxt, sxh, tok, scale, rows_ok, e64, n0, H, I,
    wg_ptr, sge, sgi, sgh, wu_ptr, sue, sui, suh, bg_ptr, sbge, bu_ptr, sbue, alpha, limit,
    GATED: tl.constexpr, HAS_BG: tl.constexpr, HAS_BU: tl.constexpr, HAS_SCALE: tl.constexpr, ACT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PREC: tl.constexpr,
):
    """fp32 [M, N] tile of the activated hidden state (ungated: the activation of up alone)."""
    g, u = proj_tile(x_ptr, sxt, sxh, tok, scale, rows_ok, e64, n0, H, I,
                     wg_ptr, sge, sgi, sgh, wu_ptr, sue, sui, suh, bg_ptr, sbge, bu_ptr, sbue,
                     GATED, HAS_BG, HAS_BU, HAS_SCALE, BLOCK_M, BLOCK_N, BLOCK_K, PREC)
    if GATED:
        return act_fwd(g, u, ACT, alpha, limit)
    else:
        return act_fwd(u, 1.0, ACT, alpha, limit)


@triton.jit
def _down_tile(
    h_ptr, shr, hrow, rows_ok, e64, n0, H, I, wd_ptr, sde, sdh, sdi, bd_ptr, sbde,
    HAS_BD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PREC: tl.constexpr,
):
    """fp32 [M, N] tile of ``h @ w_down[e]^T + b_down`` (columns n0 + [0, N) of H), rounded to the dtype."""
    DT = wd_ptr.dtype.element_ty
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_ok = offs_n < H
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, I, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < I
        a = tl.load(h_ptr + hrow[:, None] * shr + offs_k[None, :], mask=rows_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(wd_ptr + e64 * sde + offs_n[None, :] * sdh + offs_k[:, None] * sdi,
                    mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc += tl.dot(a.to(DT), w, input_precision=PREC)
    if HAS_BD:
        acc += tl.load(bd_ptr + e64 * sbde + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    return acc.to(DT).to(tl.float32)


@triton.jit
def _store_rows(acc, rows, rows_ok, n0, H, y_ptr, BLOCK_N: tl.constexpr):
    """Down-projection epilogue: the y_BH rows, in the weights' dtype (the combine sums them in a fixed order)."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    mask = rows_ok[:, None] & (offs_n[None, :] < H)
    tl.store(y_ptr + rows[:, None] * H + offs_n[None, :], acc.to(y_ptr.dtype.element_ty), mask=mask)


# ---- kernels -------------------------------------------------------------------------------------------------


@triton.jit
def _up_act_kernel(
    x_ptr, sxt, sxh, tok_ptr, s_ptr, counts_ptr, h_ptr, pre_ptr, spr,
    wg_ptr, sge, sgi, sgh, wu_ptr, sue, sui, suh, bg_ptr, sbge, bu_ptr, sbue,
    E, H, I, num_tiles, alpha, limit,
    GATED: tl.constexpr, HAS_BG: tl.constexpr, HAS_BU: tl.constexpr, HAS_SCALE: tl.constexpr, ACT: tl.constexpr,
    STORE_PRE: tl.constexpr, GROUP_M: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr, PREC: tl.constexpr,
):
    """Grid (row tiles x I tiles, in tile_of's order): gather + up (+gate) GEMM + activation, h_BI stored in the
    weights' dtype; with STORE_PRE also the projections before the activation, [g | u] (u alone ungated) rows of
    pre, for backward."""
    t, pid_n = tile_of(tl.program_id(0), num_tiles, tl.cdiv(I, BLOCK_N), GROUP_M)
    e, rows, rows_ok, valid = locate(t, counts_ptr, E, BLOCK_M, BLOCK_E)
    if valid:
        n0 = pid_n * BLOCK_N
        tok = tl.load(tok_ptr + rows, mask=rows_ok, other=0)
        scale = load_scale(s_ptr, rows, rows_ok, HAS_SCALE, wu_ptr.dtype.element_ty)
        g, u = proj_tile(x_ptr, sxt, sxh, tok, scale, rows_ok, e.to(tl.int64), n0, H, I,
                         wg_ptr, sge, sgi, sgh, wu_ptr, sue, sui, suh, bg_ptr, sbge, bu_ptr, sbue,
                         GATED, HAS_BG, HAS_BU, HAS_SCALE, BLOCK_M, BLOCK_N, BLOCK_K, PREC)
        if GATED:
            h = act_fwd(g, u, ACT, alpha, limit)
        else:
            h = act_fwd(u, 1.0, ACT, alpha, limit)
        offs_n = n0 + tl.arange(0, BLOCK_N)
        rows64 = rows.to(tl.int64)
        mask = rows_ok[:, None] & (offs_n[None, :] < I)
        tl.store(h_ptr + rows64[:, None] * I + offs_n[None, :], h.to(h_ptr.dtype.element_ty), mask=mask)
        if STORE_PRE:  # g and u are already rounded to the dtype (proj_tile): stored exactly as used above
            DT = pre_ptr.dtype.element_ty
            if GATED:
                tl.store(pre_ptr + rows64[:, None] * spr + offs_n[None, :], g.to(DT), mask=mask)
                tl.store(pre_ptr + rows64[:, None] * spr + I + offs_n[None, :], u.to(DT), mask=mask)
            else:
                tl.store(pre_ptr + rows64[:, None] * spr + offs_n[None, :], u.to(DT), mask=mask)


@triton.jit
def _down_kernel(
    h_ptr, counts_ptr, y_ptr, wd_ptr, sde, sdh, sdi, bd_ptr, sbde, E, H, I, num_tiles,
    HAS_BD: tl.constexpr, GROUP_M: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr, PREC: tl.constexpr,
):
    """Grid (row tiles x H tiles, in tile_of's order): down GEMM and bias, y_BH rows stored."""
    t, pid_n = tile_of(tl.program_id(0), num_tiles, tl.cdiv(H, BLOCK_N), GROUP_M)
    e, rows, rows_ok, valid = locate(t, counts_ptr, E, BLOCK_M, BLOCK_E)
    if valid:
        n0 = pid_n * BLOCK_N
        acc = _down_tile(h_ptr, I, rows.to(tl.int64), rows_ok, e.to(tl.int64), n0, H, I, wd_ptr, sde, sdh, sdi,
                         bd_ptr, sbde, HAS_BD, BLOCK_M, BLOCK_N, BLOCK_K, PREC)
        _store_rows(acc, rows.to(tl.int64), rows_ok, n0, H, y_ptr, BLOCK_N)


@triton.jit
def _fused_experts_kernel(
    x_ptr, sxt, sxh, tok_ptr, s_ptr, counts_ptr, scratch_ptr, y_ptr,
    wg_ptr, sge, sgi, sgh, wu_ptr, sue, sui, suh, wd_ptr, sde, sdh, sdi,
    bg_ptr, sbge, bu_ptr, sbue, bd_ptr, sbde, E, H, I, num_tiles, alpha, limit,
    GATED: tl.constexpr, HAS_BG: tl.constexpr, HAS_BU: tl.constexpr, HAS_BD: tl.constexpr,
    HAS_SCALE: tl.constexpr, ACT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr, PREC: tl.constexpr,
):
    """Persistent whole-layer forward: program p takes row tiles p, p + P, ... across all experts (uneven
    experts simply own more tiles) and runs gather -> up -> activation -> down for each, storing y rows (the
    combine kernel sums them). The activated [M, I] rows go to this program's own scratch slot, so no program
    waits on another."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    slot = scratch_ptr + pid.to(tl.int64) * BLOCK_M * I
    local = tl.arange(0, BLOCK_M).to(tl.int64)
    for t in range(pid, num_tiles, nprog):
        e, rows, rows_ok, valid = locate(t, counts_ptr, E, BLOCK_M, BLOCK_E)
        if valid:
            e64 = e.to(tl.int64)
            tok = tl.load(tok_ptr + rows, mask=rows_ok, other=0).to(tl.int64)
            scale = load_scale(s_ptr, rows, rows_ok, HAS_SCALE, wu_ptr.dtype.element_ty)
            for n0 in range(0, I, BLOCK_N):
                h = _up_tile(x_ptr, sxt, sxh, tok, scale, rows_ok, e64, n0, H, I,
                             wg_ptr, sge, sgi, sgh, wu_ptr, sue, sui, suh, bg_ptr, sbge, bu_ptr, sbue, alpha, limit,
                             GATED, HAS_BG, HAS_BU, HAS_SCALE, ACT, BLOCK_M, BLOCK_N, BLOCK_K, PREC)
                offs_n = n0 + tl.arange(0, BLOCK_N)
                tl.store(slot + local[:, None] * I + offs_n[None, :], h.to(scratch_ptr.dtype.element_ty),
                         mask=offs_n[None, :] < I)
            tl.debug_barrier()  # the whole [M, I] slot is written before any thread reads it back
            for n0 in range(0, H, BLOCK_N):
                acc = _down_tile(slot, I, local, rows_ok, e64, n0, H, I, wd_ptr, sde, sdh, sdi, bd_ptr, sbde,
                                 HAS_BD, BLOCK_M, BLOCK_N, BLOCK_K, PREC)
                _store_rows(acc, rows.to(tl.int64), rows_ok, n0, H, y_ptr, BLOCK_N)
            tl.debug_barrier()  # the slot is read by every thread before the next tile overwrites it


# ---- host launchers ------------------------------------------------------------------------------------------


def up_act(x_TH, token_ids_B, tokens_per_expert_E, w_gate_EIH, w_up_EIH, b_gate_EI=None, b_up_EI=None,
           input_scale_B=None, *, activation="silu", alpha=1.702, limit=7.0, config=None, zero_tail=True,
           all_rows=False, pre_out=None):
    """h_BI: gathered rows through each expert's up (and gate) projection and activation. Rows past the counted
    ones (dropped by a capacity) are 0, or left unwritten with ``zero_tail=False`` (no memset). ``all_rows``: the
    counts count every row (the vendor GEMM then reads no count from the device, ``vendor.py``). ``pre_out``: a
    contiguous [B, 2I] ([B, I] ungated) buffer that also gets the counted rows' projections before the
    activation, [gate | up], in the weights' dtype (what ``fused_experts_backward`` takes as ``pre_B``)."""
    B, E, H, I = check_expert_args(x_TH, token_ids_B, tokens_per_expert_E, w_gate_EIH, w_up_EIH, None, b_gate_EI,
                                   b_up_EI, None, input_scale_B, activation)
    token_ids_B, input_scale_B = rows_contiguous(token_ids_B, input_scale_B)
    counts = tokens_per_expert_E.contiguous()
    h_BI = (torch.zeros if zero_tail else torch.empty)(B, I, dtype=w_up_EIH.dtype, device=x_TH.device)
    check_pre("pre_out", pre_out, B, I, w_gate_EIH is not None, w_up_EIH.dtype)
    wg = w_up_EIH if w_gate_EIH is None else w_gate_EIH
    bg, sbg = opt_bias(b_gate_EI, wg)
    bu, sbu = opt_bias(b_up_EI, wg)
    s = input_scale_B if input_scale_B is not None else token_ids_B
    pre, spr = (pre_out, pre_out.stride(0)) if pre_out is not None else (h_BI, 0)

    def launch(cfg):
        tiles = max_tiles(B, E, cfg["BLOCK_M"])
        launch_kernel(
            _up_act_kernel, (tiles * triton.cdiv(I, cfg["BLOCK_N"]),),
            x_TH, x_TH.stride(0), x_TH.stride(1), token_ids_B, s, counts, h_BI, pre, spr,
            wg, *wg.stride(), w_up_EIH, *w_up_EIH.stride(), bg, sbg, bu, sbu, E, H, I, tiles, float(alpha),
            float(limit), GATED=w_gate_EIH is not None, HAS_BG=b_gate_EI is not None, HAS_BU=b_up_EI is not None,
            HAS_SCALE=input_scale_B is not None, ACT=ACT_CODES[activation], STORE_PRE=pre_out is not None,
            GROUP_M=group_m(cfg), BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"],
            BLOCK_E=triton.next_power_of_2(E), PREC=dot_precision(w_up_EIH.dtype), num_warps=cfg["num_warps"],
            num_stages=cfg["num_stages"],
        )

    vendor = vd.candidate(w_up_EIH.dtype, H, I, vd.up_act, h_BI, x_TH, token_ids_B, counts, w_gate_EIH, w_up_EIH,
                          b_gate_EI, b_up_EI, input_scale_B, activation=activation, alpha=alpha, limit=limit,
                          all_rows=all_rows, pre_out=pre_out)
    run_role("up_act" if pre_out is None else "up_act_kept", config, launch, vendor, dtype=w_up_EIH.dtype,
             device=x_TH.device, B=B, E=E, H=H, I=I, gated=w_gate_EIH is not None)
    return h_BI


def _combine_dtype(w_dtype, combine_weights_B):
    return w_dtype if combine_weights_B is None else torch.promote_types(w_dtype, combine_weights_B.dtype)


def down_combine(h_BI, token_ids_B, tokens_per_expert_E, w_down_EHI, b_down_EH=None, combine_weights_B=None,
                 num_tokens=None, *, combine=True, config=None, src_B=None, all_rows=False):
    """``combine``: out_TH = sum over each token's rows of cw * (h @ w_down[e]^T + b_down), summed in k order
    (``src_B``: the PFT's flat assignment of each row, which gives that order; without it, buffer order); else
    y_BH (dropped tail rows 0). ``all_rows`` as ``up_act``."""
    E, H, I = w_down_EHI.shape
    B = token_ids_B.shape[0]
    check_device(h_BI, token_ids_B, tokens_per_expert_E, w_down_EHI, b_down_EH, combine_weights_B, src_B)
    check_shape("h_BI", h_BI, (B, I))
    check_shape("b_down_EH", b_down_EH, (E, H))
    check_shape("combine_weights_B", combine_weights_B, (B,))
    if combine and num_tokens is None:
        raise ValueError("down_combine(combine=True) needs num_tokens")
    counts = tokens_per_expert_E.contiguous()
    # rows past the counted ones are never written: zeroed only when y is handed out, the combine skips them
    y_BH = (torch.empty if combine else torch.zeros)(B, H, dtype=w_down_EHI.dtype, device=h_BI.device)
    bd, sbd = opt_bias(b_down_EH, w_down_EHI)
    h_BI = h_BI.contiguous()

    def launch(cfg):
        tiles = max_tiles(B, E, cfg["BLOCK_M"])
        launch_kernel(
            _down_kernel, (tiles * triton.cdiv(H, cfg["BLOCK_N"]),),
            h_BI, counts, y_BH, w_down_EHI, *w_down_EHI.stride(), bd, sbd, E, H, I, tiles,
            HAS_BD=b_down_EH is not None, GROUP_M=group_m(cfg), BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"],
            BLOCK_K=cfg["BLOCK_K"], BLOCK_E=triton.next_power_of_2(E), PREC=dot_precision(w_down_EHI.dtype),
            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        )

    vendor = vd.candidate(w_down_EHI.dtype, H, I, vd.down, y_BH, h_BI, counts, w_down_EHI, b_down_EH,
                          all_rows=all_rows)
    run_role("down", config, launch, vendor, dtype=w_down_EHI.dtype, device=h_BI.device, B=B, E=E, H=H, I=I,
             gated=False)
    if not combine:
        return y_BH
    rows_TK = cb.token_rows(token_ids_B, num_tokens, src_B)
    return cb.combine(y_BH, rows_TK, counts, combine_weights_B,
                      out_dtype=_combine_dtype(w_down_EHI.dtype, combine_weights_B))


def _programs_available(device) -> int:
    """Programs resident at once: one per SM on a GPU (the persistent schedule); a few in the interpreter."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def fused_experts(x_TH, token_ids_B, tokens_per_expert_E, combine_weights_B, w_gate_EIH, w_up_EIH, w_down_EHI,
                  b_gate_EI=None, b_up_EI=None, b_down_EH=None, input_scale_B=None, *, num_tokens, activation="silu",
                  alpha=1.702, limit=7.0, config=None, num_programs=None, single_launch=None, src_B=None,
                  all_rows=False, keep=False):
    """The whole routed MLP + combine of one layer: out_TH (fp32 sums in a fixed order, returned in the dtype the
    torch reference's combine would have: weights' dtype promoted with combine weights'). Deterministic: no
    float atomics anywhere (``combine.py``); ``src_B`` (the PFT's flat assignment of each row) sums each token's
    rows in k order.

    Two launches over (row tile, column tile) programs, ``up_act`` then ``down``, then the combine; or
    (``single_launch``) the persistent kernel, one program per SM walking whole row tiles (all of I, then all of
    H) with h in a per-program scratch slot instead of an h_BI buffer. On an H100 the persistent form was slower
    than the two launches at every shape measured (``../shared/measurements/h100-2026-11-23.md``), so
    ``single_launch=None`` takes it only in the interpreter, where fewer programs run faster. ``all_rows``: the
    counts count every row (no capacity): a role on the vendor GEMM reads no count from the device.

    ``keep``: returns (out_TH, pre_BJ), the projections before the activation kept for backward (``up_act``'s
    ``pre_out``; J = 2I gated, I ungated; rows past the counted ones unwritten), so that the backward's dh
    reads them instead of running the up GEMM again; always the two launches."""
    B, E, H, I = check_expert_args(x_TH, token_ids_B, tokens_per_expert_E, w_gate_EIH, w_up_EIH, w_down_EHI,
                                   b_gate_EI, b_up_EI, b_down_EH, input_scale_B, activation)
    check_shape("combine_weights_B", combine_weights_B, (B,))
    check_shape("x_TH", x_TH, (num_tokens, H))
    token_ids_B, combine_weights_B, input_scale_B = rows_contiguous(token_ids_B, combine_weights_B, input_scale_B)
    if single_launch is None:  # (a configuration naming the vendor GEMM runs the two launches' roles on it)
        single_launch = interpreting() and not tuning.is_vendor(config) and not keep
    if single_launch and (tuning.is_vendor(config) or keep):
        raise ValueError("single_launch=True runs the persistent Triton kernel, which keeps no [B, I] rows: pass a "
                         "tile configuration, not tuning.VENDOR, and keep=False")
    if not single_launch:
        pre = torch.empty(B, 2 * I if w_gate_EIH is not None else I, dtype=w_up_EIH.dtype,
                          device=x_TH.device) if keep else None
        h_BI = up_act(x_TH, token_ids_B, tokens_per_expert_E, w_gate_EIH, w_up_EIH, b_gate_EI, b_up_EI,
                      input_scale_B, activation=activation, alpha=alpha, limit=limit, config=config, zero_tail=False,
                      all_rows=all_rows, pre_out=pre)
        out = down_combine(h_BI, token_ids_B, tokens_per_expert_E, w_down_EHI, b_down_EH, combine_weights_B,
                           num_tokens, config=config, src_B=src_B, all_rows=all_rows)
        return (out, pre) if keep else out
    # the persistent kernel holds both GEMMs: the up projection's configuration, untuned (never timed here)
    cfg = config or tuning.tuner().lookup("up_act", tuning.key("up_act", w_up_EIH.dtype, H, I, E, B, True),
                                          w_up_EIH.dtype, x_TH.device,
                                          lambda: rule_config("up_act", B / max(E, 1), w_up_EIH.dtype))[0]
    if tuning.is_vendor(cfg):  # the up projection was tuned to the vendor GEMM: this kernel takes the rule's tiles
        cfg = rule_config("up_act", B / max(E, 1), w_up_EIH.dtype)
    counts = tokens_per_expert_E.contiguous()
    tiles = max_tiles(B, E, cfg["BLOCK_M"])
    P = num_programs or max(1, min(tiles, _programs_available(x_TH.device)))
    scratch = torch.empty(P, cfg["BLOCK_M"], I, dtype=w_up_EIH.dtype, device=x_TH.device)
    y_BH = torch.empty(B, H, dtype=w_down_EHI.dtype, device=x_TH.device)  # dropped tail rows: never read
    wg = w_up_EIH if w_gate_EIH is None else w_gate_EIH
    (bg, sbg), (bu, sbu), (bd, sbd) = opt_bias(b_gate_EI, wg), opt_bias(b_up_EI, wg), opt_bias(b_down_EH, wg)
    s = input_scale_B if input_scale_B is not None else token_ids_B
    _fused_experts_kernel[(P,)](
        x_TH, x_TH.stride(0), x_TH.stride(1), token_ids_B, s, counts, scratch, y_BH,
        wg, *wg.stride(), w_up_EIH, *w_up_EIH.stride(), w_down_EHI, *w_down_EHI.stride(),
        bg, sbg, bu, sbu, bd, sbd, E, H, I, tiles, float(alpha), float(limit),
        GATED=w_gate_EIH is not None, HAS_BG=b_gate_EI is not None, HAS_BU=b_up_EI is not None,
        HAS_BD=b_down_EH is not None, HAS_SCALE=input_scale_B is not None,
        ACT=ACT_CODES[activation], BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"],
        BLOCK_E=triton.next_power_of_2(E), PREC=dot_precision(w_up_EIH.dtype),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    rows_TK = cb.token_rows(token_ids_B, num_tokens, src_B)
    return cb.combine(y_BH, rows_TK, counts, combine_weights_B,
                      out_dtype=_combine_dtype(w_up_EIH.dtype, combine_weights_B))


def fused_experts_ref(x_TH, token_ids_B, tokens_per_expert_E, combine_weights_B, w_gate_EIH, w_up_EIH, w_down_EHI,
                      b_gate_EI=None, b_up_EI=None, b_down_EH=None, input_scale_B=None, *, num_tokens,
                      activation="silu", alpha=1.702, limit=7.0):
    y_BH = ref.expert_mlp_ref(x_TH, token_ids_B, tokens_per_expert_E, w_gate_EIH, w_up_EIH, w_down_EHI, b_gate_EI,
                              b_up_EI, b_down_EH, input_scale_B, activation=activation, alpha=alpha, limit=limit)
    return ref.combine_ref(y_BH, token_ids_B, combine_weights_B, num_tokens)


# ---- compile targets (CI compiles each for sm_90) ------------------------------------------------------------


def _ptrs(dt, **extra):
    names = ("x_ptr", "wg_ptr", "wu_ptr", "wd_ptr", "bg_ptr", "bu_ptr", "bd_ptr", "h_ptr", "pre_ptr", "scratch_ptr",
             "y_ptr")
    return {**{n: dt for n in names}, "tok_ptr": torch.int64, "counts_ptr": torch.int64, **extra}


def compile_targets():
    """Each forward kernel: every GPU tile configuration (Mixtral-like flags), every flag set (one
    configuration), every activation (fused kernel), with a few expert counts (BLOCK_E); up_act also keeping
    its projections (STORE_PRE, as training runs it)."""

    def three(dt, cfg, flag_set, block_e, launch=REAL_LAUNCH, store_pre=False):
        gated, bg, bu, bd, sc, cw, act = flag_set
        consts = dict(BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], BLOCK_E=block_e,
                      PREC=dot_precision(dt))
        flags = dict(GATED=gated, HAS_BG=bg, HAS_BU=bu, HAS_SCALE=sc, ACT=act)
        opts = dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
        return [
            target(_up_act_kernel, _ptrs(dt), dict(consts, **flags, STORE_PRE=store_pre, GROUP_M=group_m(cfg)),
                   **opts, **launch),
            target(_down_kernel, _ptrs(dt), dict(consts, HAS_BD=bd, GROUP_M=group_m(cfg)), **opts, **launch),
            target(_fused_experts_kernel, _ptrs(dt), dict(consts, **flags, HAS_BD=bd), **opts, **launch),
        ]

    out = []
    for i, (dt, cfg) in enumerate(gpu_configs()):
        out += three(dt, cfg, FLAG_SETS[0], (8, 128, 256)[i % 3])
        out.append(three(dt, halved_n(cfg), FLAG_SETS[0], (8, 128, 256)[i % 3], store_pre=True)[0])  # its rule
    for i, (role, dt, cfg) in enumerate(tuner_configs(("up_act", "up_act_kept", "down"))):  # all it may time
        out.append(three(dt, cfg, FLAG_SETS[0], (8, 128, 256)[i % 3], store_pre=role == "up_act_kept")[role == "down"])
    dt, cfg = torch.bfloat16, gpu_config(1024, torch.bfloat16)
    out += three(dt, cfg, FLAG_SETS[0], 8, launch={})  # odd widths and strided views: nothing specialised
    for flag_set in FLAG_SETS[1:]:
        out += three(dt, cfg, flag_set, 32)
        out.append(three(dt, halved_n(cfg), flag_set, 32, store_pre=True)[0])
    for name, act in ACT_CODES.items():
        if act not in (f[-1] for f in FLAG_SETS):
            out.append(three(dt, cfg, (name != "relu2", False, False, False, False, True, act), 64)[2])
    return out
