"""Backward of the fused expert layer (``grouped_mlp.fused_experts``): grouped GEMMs for the input and weight
gradients, with the gather/scatter adjoints fused into them.

Legend: T tokens, B routed rows (sorted by expert), E experts, H hidden, I expert intermediate, P partial sums.

Forward, per row b of expert e and token t = tok[b]:
    xs_b = x[t] * s_b;  g_b, u_b = xs_b @ Wg[e]^T + bg, xs_b @ Wu[e]^T + bu;  h_b = act(g_b, u_b)
    out[t] += cw_b * (h_b @ Wd[e]^T + bd)
Backward, given dout_TH (four kernel kinds, five launches and the row inversion):
    dh_kernel    G_b = dout[t] @ Wd[e], with g, u read from the forward's kept projections (``pre_B``, role
                 "dh_kept": one GEMM) or recomputed (role "dh": nothing [B, I] kept from the forward, two GEMMs more)
                 dcw_b = <h_b, G_b> (+ <bd, dout[t]>),  dh_b = cw_b G_b,  (dg_b, du_b) = act'(g_b, u_b) dh_b
    dx_kernel    dxs_b = dg_b @ Wg[e] + du_b @ Wu[e] stored;  ds_b = <dxs_b, x[t]>
    combine      dx[t] = sum over k of s_b dxs_b (the gather's adjoint: each token's rows in k order, no atomics,
                 combine.py)
    wgrad_kernel dW[e] = A_e^T @ C_e over expert e's rows, A and C optionally gathered by token and scaled by
                 row: [dWg | dWu] = [dg | du]^T xs (one launch), dWd = (cw dout[tok])^T h; bias gradients =
                 column sums of A (``grouped_wgrad.py``)
Partial dot products ([B, P], one column per tile of the reduced axis) are summed on the device by torch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import combine as cb
from . import grouped_wgrad as gw
from . import tuning
from . import vendor as vd
from .common import ACT_CODES, act_bwd, act_fwd, dot_precision, launch_kernel, target
from .grouped_common import (FLAG_SETS, REAL_LAUNCH, check_expert_args, check_pre, load_scale, locate, max_tiles,
                             opt_bias, proj_tile, rows_contiguous, tile_of)
from .tiles import gpu_config, gpu_configs, group_m, halved_n, run_role, tuner_configs


@triton.jit
def _dh_kernel(
    x_ptr, sxt, sxh, tok_ptr, s_ptr, cw_ptr, counts_ptr, dout_ptr, h_ptr, dg_ptr, du_ptr, sdr, pcw_ptr,
    pre_ptr, spr, wg_ptr, sge, sgi, sgh, wu_ptr, sue, sui, suh, wd_ptr, sde, sdh, sdi, bg_ptr, sbge, bu_ptr, sbue,
    E, H, I, num_tiles, alpha, limit,
    GATED: tl.constexpr, HAS_BG: tl.constexpr, HAS_BU: tl.constexpr, HAS_SCALE: tl.constexpr,
    HAS_CW: tl.constexpr, ACT: tl.constexpr, KEPT: tl.constexpr, GROUP_M: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr, PREC: tl.constexpr,
):
    """Grid (row tiles x I tiles, in tile_of's order): the projections (KEPT: read from the forward's pre rows;
    else recomputed), G = dout[tok] @ Wd[e], then dh and act'."""
    n_tiles = tl.cdiv(I, BLOCK_N)
    t, pid_n = tile_of(tl.program_id(0), num_tiles, n_tiles, GROUP_M)
    e, rows, rows_ok, valid = locate(t, counts_ptr, E, BLOCK_M, BLOCK_E)
    if valid:
        DT = wu_ptr.dtype.element_ty
        e64 = e.to(tl.int64)
        n0 = pid_n * BLOCK_N
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_ok = offs_n < I
        rows64 = rows.to(tl.int64)
        tok = tl.load(tok_ptr + rows, mask=rows_ok, other=0).to(tl.int64)
        G = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for k0 in range(0, H, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_ok = offs_k < H
            a = tl.load(dout_ptr + tok[:, None] * H + offs_k[None, :], mask=rows_ok[:, None] & k_ok[None, :],
                        other=0.0)
            w = tl.load(wd_ptr + e64 * sde + offs_k[:, None] * sdh + offs_n[None, :] * sdi,
                        mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            G += tl.dot(a.to(DT), w, input_precision=PREC)
        # after the GEMM, so that kept projections hold no registers during it
        if KEPT:  # stored in the dtype as proj_tile rounds them: the same g and u as recomputed
            pre = pre_ptr + rows64[:, None] * spr + offs_n[None, :]
            pm = rows_ok[:, None] & n_ok[None, :]
            if GATED:
                g = tl.load(pre, mask=pm, other=0.0).to(tl.float32)
                u = tl.load(pre + I, mask=pm, other=0.0).to(tl.float32)
            else:
                u = tl.load(pre, mask=pm, other=0.0).to(tl.float32)
                g = u
        else:
            scale = load_scale(s_ptr, rows, rows_ok, HAS_SCALE, DT)
            g, u = proj_tile(x_ptr, sxt, sxh, tok, scale, rows_ok, e64, n0, H, I,
                             wg_ptr, sge, sgi, sgh, wu_ptr, sue, sui, suh, bg_ptr, sbge, bu_ptr, sbue,
                             GATED, HAS_BG, HAS_BU, HAS_SCALE, BLOCK_M, BLOCK_N, BLOCK_K, PREC)
        if GATED:
            h = act_fwd(g, u, ACT, alpha, limit).to(DT)
        else:
            h = act_fwd(u, 1.0, ACT, alpha, limit).to(DT)
        mask = rows_ok[:, None] & n_ok[None, :]
        tl.store(h_ptr + rows64[:, None] * I + offs_n[None, :], h, mask=mask)
        if HAS_CW:
            cw = tl.load(cw_ptr + rows, mask=rows_ok, other=0.0).to(tl.float32)
            tl.store(pcw_ptr + rows64 * n_tiles + pid_n, tl.sum(h.to(tl.float32) * G, axis=1),
                     mask=rows_ok)
            G = G * cw[:, None]
        dh = G.to(DT).to(tl.float32)  # the reference's grad of h is in the weights' dtype
        if GATED:
            dg, du = act_bwd(g, u, dh, ACT, alpha, limit)
            tl.store(dg_ptr + rows64[:, None] * sdr + offs_n[None, :], dg.to(DT), mask=mask)
        else:
            du, _unused = act_bwd(u, 1.0, dh, ACT, alpha, limit)
        tl.store(du_ptr + rows64[:, None] * sdr + offs_n[None, :], du.to(DT), mask=mask)


@triton.jit
def _dx_kernel(
    x_ptr, sxt, sxh, tok_ptr, counts_ptr, dg_ptr, du_ptr, sdr, dxs_ptr, ps_ptr, dout_ptr, bd_ptr, sbde, pbd_ptr,
    wg_ptr, sge, sgi, sgh, wu_ptr, sue, sui, suh, E, H, I, num_tiles,
    GATED: tl.constexpr, HAS_SCALE: tl.constexpr, BD_DCW: tl.constexpr, GROUP_M: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr, PREC: tl.constexpr,
):
    """Grid (row tiles x H tiles, in tile_of's order): dxs = dg @ Wg[e] + du @ Wu[e] stored by row (the combine
    kernel sums each token's rows times the row scale into dx); partial <dxs, x[tok]> for the scale's gradient
    and <bd, dout[tok]> for the combine weights'."""
    n_tiles = tl.cdiv(H, BLOCK_N)
    t, pid_n = tile_of(tl.program_id(0), num_tiles, n_tiles, GROUP_M)
    e, rows, rows_ok, valid = locate(t, counts_ptr, E, BLOCK_M, BLOCK_E)
    if valid:
        DT = wu_ptr.dtype.element_ty
        e64 = e.to(tl.int64)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < H
        rows64 = rows.to(tl.int64)
        tok = tl.load(tok_ptr + rows, mask=rows_ok, other=0).to(tl.int64)
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for k0 in range(0, I, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_ok = offs_k < I
            a_mask = rows_ok[:, None] & k_ok[None, :]
            w_mask = k_ok[:, None] & n_ok[None, :]
            du = tl.load(du_ptr + rows64[:, None] * sdr + offs_k[None, :], mask=a_mask, other=0.0)
            wu = tl.load(wu_ptr + e64 * sue + offs_k[:, None] * sui + offs_n[None, :] * suh, mask=w_mask, other=0.0)
            acc += tl.dot(du, wu, input_precision=PREC)
            if GATED:
                dg = tl.load(dg_ptr + rows64[:, None] * sdr + offs_k[None, :], mask=a_mask, other=0.0)
                wg = tl.load(wg_ptr + e64 * sge + offs_k[:, None] * sgi + offs_n[None, :] * sgh, mask=w_mask,
                             other=0.0)
                acc += tl.dot(dg, wg, input_precision=PREC)
        acc = acc.to(DT).to(tl.float32)  # the reference's grad of the gathered rows is in the weights' dtype
        mask = rows_ok[:, None] & n_ok[None, :]
        if HAS_SCALE:
            x = tl.load(x_ptr + tok[:, None] * sxt + offs_n[None, :] * sxh, mask=mask, other=0.0)
            x = x.to(DT).to(tl.float32)
            tl.store(ps_ptr + rows64 * n_tiles + pid_n, tl.sum(acc * x, axis=1), mask=rows_ok)
        tl.store(dxs_ptr + rows64[:, None] * H + offs_n[None, :], acc.to(DT), mask=mask)
        if BD_DCW:
            d = tl.load(dout_ptr + tok[:, None] * H + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
            bd = tl.load(bd_ptr + e64 * sbde + offs_n, mask=n_ok, other=0.0).to(tl.float32)
            tl.store(pbd_ptr + rows64 * n_tiles + pid_n, tl.sum(d * bd[None, :], axis=1), mask=rows_ok)


def fused_experts_backward(dout_TH, x_TH, token_ids_B, tokens_per_expert_E, combine_weights_B, w_gate_EIH, w_up_EIH,
                           w_down_EHI, b_gate_EI=None, b_up_EI=None, b_down_EH=None, input_scale_B=None, *,
                           activation="silu", alpha=1.702, limit=7.0, config=None, src_B=None, weight_grads=None,
                           all_rows=False, pre_B=None, wgrads=(True, True), dx=True):
    """Gradients of ``fused_experts`` for (x, combine_weights, w_gate, w_up, w_down, b_gate, b_up, b_down,
    input_scale), None where that input is None. Deterministic: no float atomics (``src_B`` as in
    ``fused_experts``). Weight gradients are written once, where ``weight_grads`` (views for dWg, dWu, dWd)
    says: the halves of one fused gate/up gradient, say; by default new tensors with each weight's own strides
    (``empty_like``: a transposed weight gets a transposed gradient, no copy to its layout afterwards). Bias
    gradients are contiguous. ``config``: one tile configuration for every kernel
    (``{"gemm": {...}, "wgrad": {...}}``, or one GEMM configuration for dh and dx; ``tuning.VENDOR`` for the
    vendor GEMM, ``vendor.py``); None lets each kernel take the tuner's (``tuning.py``). ``all_rows``: as there.
    ``pre_B``: the projections ``fused_experts(keep=True)`` kept; dh reads them instead of recomputing them (the
    same values, so the same gradients bit for bit). ``wgrads``: whether to launch the weight-gradient kernels of
    (gate/up, down); one not launched gives None for its weights and biases (frozen experts). ``dx=False``: the dx
    kernel is not launched either, and x, the scale and the down bias's share of the combine weights' gradient
    get none (None for the first two: the caller asks for none of them)."""
    B, E, H, I = check_expert_args(x_TH, token_ids_B, tokens_per_expert_E, w_gate_EIH, w_up_EIH, w_down_EHI,
                                   b_gate_EI, b_up_EI, b_down_EH, input_scale_B, activation)
    check_pre("pre_B", pre_B, B, I, w_gate_EIH is not None, w_up_EIH.dtype)
    token_ids_B, combine_weights_B, input_scale_B = rows_contiguous(token_ids_B, combine_weights_B, input_scale_B)
    one = config is not None and ("BLOCK_M" in config or tuning.is_vendor(config))
    config = {"gemm": config} if one else (config or {})
    T = x_TH.shape[0]
    dt = w_up_EIH.dtype
    gated = w_gate_EIH is not None
    counts = tokens_per_expert_E.contiguous()
    dout = dout_TH.contiguous()
    dev = x_TH.device
    shape = dict(dtype=dt, device=dev, B=B, E=E, H=H, I=I, gated=gated)
    # only the counted rows are written and read (dropped tail rows never are): no memset
    h_BI = torch.empty(B, I, dtype=dt, device=dev)
    # [dg | du] side by side (gated) so one weight-gradient launch computes both; du alone when ungated
    dgu = torch.empty(B, 2 * I if gated else I, dtype=dt, device=dev)
    dg_BI, du_BI = (dgu[:, :I], dgu[:, I:]) if gated else (dgu, dgu)
    has_cw = combine_weights_B is not None
    wg = w_gate_EIH if gated else w_up_EIH
    (bg, sbg), (bu, sbu), (bd, sbd) = opt_bias(b_gate_EI, wg), opt_bias(b_up_EI, wg), opt_bias(b_down_EH, wg)
    s = input_scale_B if input_scale_B is not None else token_ids_B
    cw = combine_weights_B if has_cw else token_ids_B
    partial = {}  # per-column-tile partial sums: their width depends on the tile

    def common(cfg):
        return dict(BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"],
                    BLOCK_E=triton.next_power_of_2(E), PREC=dot_precision(dt), num_warps=cfg["num_warps"],
                    num_stages=cfg["num_stages"], GROUP_M=group_m(cfg))

    def launch_dh(cfg):
        n_i = triton.cdiv(I, cfg["BLOCK_N"])
        partial["cw"] = pcw = torch.zeros(B, n_i, dtype=torch.float32, device=dev) if has_cw else dout
        tiles = max_tiles(B, E, cfg["BLOCK_M"])
        launch_kernel(
            _dh_kernel, (tiles * n_i,),
            x_TH, x_TH.stride(0), x_TH.stride(1), token_ids_B, s, cw, counts, dout, h_BI, dg_BI, du_BI,
            dgu.stride(0), pcw, pre, spr, wg, *wg.stride(), w_up_EIH, *w_up_EIH.stride(), w_down_EHI,
            *w_down_EHI.stride(), bg, sbg, bu, sbu, E, H, I, tiles, float(alpha), float(limit),
            GATED=gated, HAS_BG=b_gate_EI is not None, HAS_BU=b_up_EI is not None,
            HAS_SCALE=input_scale_B is not None, HAS_CW=has_cw, ACT=ACT_CODES[activation], KEPT=pre_B is not None,
            **common(cfg),
        )

    def vendor_dh():
        partial["cw"] = vd.dh(x_TH, token_ids_B, input_scale_B, combine_weights_B, counts, dout, w_gate_EIH, w_up_EIH,
                              w_down_EHI, b_gate_EI, b_up_EI, activation=activation, alpha=alpha, limit=limit,
                              h_out=h_BI, dgu_out=dgu, all_rows=all_rows, pre=pre_B)

    pre, spr = (pre_B, pre_B.stride(0)) if pre_B is not None else (dgu, 0)
    run_role("dh" if pre_B is None else "dh_kept", config.get("gemm"), launch_dh, vd.candidate(dt, H, I, vendor_dh),
             **shape)
    dxs_BH = torch.empty(B, H, dtype=dt, device=dev) if dx else None  # dropped tail rows: never written nor read
    has_s = input_scale_B is not None
    bd_dcw = has_cw and b_down_EH is not None

    def launch_dx(cfg):
        n_h = triton.cdiv(H, cfg["BLOCK_N"])
        partial["s"] = ps = torch.zeros(B, n_h, dtype=torch.float32, device=dev) if has_s else dxs_BH
        partial["bd"] = pbd = torch.zeros(B, n_h, dtype=torch.float32, device=dev) if bd_dcw else dxs_BH
        tiles = max_tiles(B, E, cfg["BLOCK_M"])
        launch_kernel(
            _dx_kernel, (tiles * n_h,),
            x_TH, x_TH.stride(0), x_TH.stride(1), token_ids_B, counts, dg_BI, du_BI, dgu.stride(0), dxs_BH, ps,
            dout, bd, sbd, pbd, wg, *wg.stride(), w_up_EIH, *w_up_EIH.stride(), E, H, I, tiles,
            GATED=gated, HAS_SCALE=has_s, BD_DCW=bd_dcw, **common(cfg),
        )

    def vendor_dx():
        partial["s"], partial["bd"] = vd.dx(x_TH, token_ids_B, counts, dgu, dout, w_gate_EIH, w_up_EIH, b_down_EH,
                                            dxs_out=dxs_BH, scale=has_s, bd_dcw=bd_dcw, all_rows=all_rows)

    if dx:
        run_role("dx", config.get("gemm"), launch_dx, vd.candidate(dt, H, I, vendor_dx), **shape)
    xs = dict(c=x_TH.contiguous(), c_tok=token_ids_B, c_scale=input_scale_B)
    want_db = b_gate_EI is not None or b_up_EI is not None
    wargs = dict(counts=counts, E=E, dtype=dt, config=config.get("wgrad"), all_rows=all_rows)
    launched = (wgrads[0], wgrads[0], wgrads[1])  # a frozen weight's gradient is not even allocated
    out_g, out_u, out_d = weight_grads or (None if w is None or not go else torch.empty_like(w)
                                           for w, go in zip((w_gate_EIH, w_up_EIH, w_down_EHI), launched))
    dwg = dbg = dwu = dbu = dwd = dbd = None
    if wgrads[0] and gated:  # dWg and dWu in one launch, from [dg | du]
        both = [out_g, out_u] if out_g.stride() == out_u.stride() else None  # else new, then copied in
        (dwg, dwu), (dbg, dbu) = gw.wgrad("wgrad_up", dgu, None, None, **xs, want_db=want_db, split=I, out=both,
                                        **wargs)
        if both is None:
            dwg, dwu = out_g.copy_(dwg), out_u.copy_(dwu)
    elif wgrads[0]:
        (dwu,), (dbu,) = gw.wgrad("wgrad_up", dgu, None, None, **xs, want_db=want_db, out=[out_u], **wargs)
    dbg, dbu = (dbg if b_gate_EI is not None else None), (dbu if b_up_EI is not None else None)
    if wgrads[1]:
        (dwd,), (dbd,) = gw.wgrad("wgrad_down", dout, token_ids_B, combine_weights_B, h_BI, None, None,
                                want_db=b_down_EH is not None, out=[out_d], **wargs)
    dcw = None
    if has_cw:
        dcw = partial["cw"].sum(1) + (partial["bd"].sum(1) if bd_dcw and dx else 0)
        dcw = dcw.to(combine_weights_B.dtype)
    if not dx:
        return None, dcw, dwg, dwu, dwd, dbg, dbu, dbd, None
    ds = partial["s"].sum(1).to(input_scale_B.dtype) if has_s else None
    grad_x = cb.combine(dxs_BH, cb.token_rows(token_ids_B, T, src_B), counts, input_scale_B, out_dtype=x_TH.dtype,
                        round_weights=True)
    return grad_x, dcw, dwg, dwu, dwd, dbg, dbu, dbd, ds


# ---- compile targets (CI compiles each for sm_90) ------------------------------------------------------------


def compile_targets():
    """dh and dx kernels: every GPU tile configuration (Mixtral-like flags), every flag set and activation on one
    configuration, dh both recomputing and reading the kept projections (the weight-gradient kernel's:
    ``grouped_wgrad.py``)."""

    def ptrs(dt):
        names = ("x_ptr", "wg_ptr", "wu_ptr", "wd_ptr", "bg_ptr", "bu_ptr", "bd_ptr", "h_ptr", "dg_ptr", "du_ptr",
                 "dxs_ptr", "pre_ptr")
        return {**{n: dt for n in names}, "tok_ptr": torch.int64, "counts_ptr": torch.int64}

    def pair(dt, cfg, flag_set, block_e, with_dx=True, launch=REAL_LAUNCH, kept=False):
        """dh (N halved as the rule halves it; ``kept``: reading the kept projections) and dx."""
        gated, bg, bu, bd, sc, cw, act = flag_set
        consts = dict(BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], BLOCK_E=block_e,
                      PREC=dot_precision(dt), GATED=gated, HAS_SCALE=sc, GROUP_M=group_m(cfg))
        opts = dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **launch)
        dh_consts = dict(consts, BLOCK_N=halved_n(cfg)["BLOCK_N"], HAS_BG=bg, HAS_BU=bu, HAS_CW=cw, ACT=act,
                         KEPT=kept)
        out = [target(_dh_kernel, ptrs(dt), dh_consts, **opts)]
        if with_dx:
            out.append(target(_dx_kernel, ptrs(dt), dict(consts, BD_DCW=bool(bd and cw)), **opts))
        return out

    out = []
    for i, (dt, cfg) in enumerate(gpu_configs()):
        out += pair(dt, cfg, FLAG_SETS[0], (8, 128, 256)[i % 3])
        out += pair(dt, cfg, FLAG_SETS[0], (8, 128, 256)[i % 3], with_dx=False, kept=True)
    for i, (role, dt, cfg) in enumerate(tuner_configs(("dh", "dh_kept", "dx"))):  # every one the tuner may time
        if role != "dx":  # pair() halves N for dh as the rule does; the tuner's N is the dh kernel's own
            cfg = dict(cfg, BLOCK_N=2 * cfg["BLOCK_N"])
        out.append(pair(dt, cfg, FLAG_SETS[0], (8, 128, 256)[i % 3], kept=role == "dh_kept")[role == "dx"])
    cfg = gpu_config(1024, torch.bfloat16)
    out += pair(torch.bfloat16, cfg, FLAG_SETS[0], 8, launch={})  # nothing specialised
    for flag_set in FLAG_SETS[1:]:
        out += pair(torch.bfloat16, cfg, flag_set, 32)
        out += pair(torch.bfloat16, cfg, flag_set, 32, with_dx=False, kept=True)
    for name, act in ACT_CODES.items():
        if act not in (f[-1] for f in FLAG_SETS):
            flags = (name != "relu2", False, False, False, False, True, act)
            out += pair(torch.bfloat16, cfg, flags, 64, False) + pair(torch.bfloat16, cfg, flags, 64, False, kept=True)
    return out
