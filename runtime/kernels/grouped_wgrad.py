"""The weight-gradient kernel of the grouped expert layer's backward (``grouped_mlp_bwd.py`` launches it twice):
dW[e] = A_e^T @ C_e reduced over each expert's rows of the padding-free buffer, with the bias gradients as the
column sums of A_e, written straight into the parameter's own layout.

Legend: E experts, N1 x N2 the gradient's shape per expert, K the rows reduced over (BLOCK_K at a time).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import vendor as vd
from .common import dot_precision, launch_kernel, target
from .grouped_common import load_scale, segments
from .tiles import group_m, run_role, tuner_configs, wgrad_gpu_config


@triton.jit
def _wgrad_kernel(
    a_ptr, sa, a_tok_ptr, a_scale_ptr, c_ptr, sc, c_tok_ptr, c_scale_ptr, counts_ptr, dw_ptr, db_ptr,
    dw2_ptr, db2_ptr, E, N1, N2, N_SPLIT, swe, swr, swc,
    A_GATHER: tl.constexpr, A_SCALE: tl.constexpr, C_GATHER: tl.constexpr, C_SCALE: tl.constexpr,
    HAS_DB: tl.constexpr, SPLIT: tl.constexpr, EXPERT_MAJOR: tl.constexpr, BLOCK_N1: tl.constexpr,
    BLOCK_N2: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr, PREC: tl.constexpr,
):
    """Grid E x (N1 tiles x N2 tiles), 1-D: dW[e] = A_e^T @ C_e, reducing over expert e's rows (a variable-length
    segment, masked in BLOCK_K steps); A row r is a[tok[r]] * scale[r] when gathered and scaled, C likewise.
    EXPERT_MAJOR: programs run expert by expert, N2 tiles fastest, so one expert's C rows (gathered x, a few MB)
    and an A column strip stay in L2 while its tiles run; else (the order before) every expert for one tile, then
    the next tile: a wave then touched all experts' rows, more than the L2 at Mixtral's widths, read again
    wave after wave.
    db[e] = column sums of A_e (only the N2-tile-0 programs write it). SPLIT: A holds two operands side by side
    ([dg | du], N1 = 2 N_SPLIT) and output rows from N_SPLIT on go to dw2/db2: both gradients in one launch.
    dW is written through strides (swe, swr, swc): into the parameter's own layout (a transposed view, or the
    gate and up halves of one fused [E, 2I, H] parameter), so the gradient exists once."""
    DT = dw_ptr.dtype.element_ty
    n2_tiles = tl.cdiv(N2, BLOCK_N2)
    tiles = tl.cdiv(N1, BLOCK_N1) * n2_tiles
    pid = tl.program_id(0)
    if EXPERT_MAJOR:
        e, t = pid // tiles, pid % tiles
    else:
        e, t = pid % E, pid // E
    pid_n1 = t // n2_tiles
    pid_n2 = t % n2_tiles
    offs_1 = pid_n1 * BLOCK_N1 + tl.arange(0, BLOCK_N1)
    offs_2 = pid_n2 * BLOCK_N2 + tl.arange(0, BLOCK_N2)
    offs_e, counts, first_row = segments(counts_ptr, E, BLOCK_E)
    row0 = tl.sum(tl.where(offs_e == e, first_row, 0), axis=0)
    nrows = tl.sum(tl.where(offs_e == e, counts, 0), axis=0)
    acc = tl.zeros((BLOCK_N1, BLOCK_N2), tl.float32)
    colsum = tl.zeros((BLOCK_N1,), tl.float32)
    for k0 in range(0, nrows, BLOCK_K):
        rows = row0 + k0 + tl.arange(0, BLOCK_K)
        r_ok = (k0 + tl.arange(0, BLOCK_K)) < nrows
        ra = rows.to(tl.int64)
        if A_GATHER:
            ra = tl.load(a_tok_ptr + rows, mask=r_ok, other=0).to(tl.int64)
        rc = rows.to(tl.int64)
        if C_GATHER:
            rc = tl.load(c_tok_ptr + rows, mask=r_ok, other=0).to(tl.int64)
        a = tl.load(a_ptr + ra[:, None] * sa + offs_1[None, :], mask=r_ok[:, None] & (offs_1[None, :] < N1),
                    other=0.0)
        if A_SCALE:  # (dout[tok] * cw) rounded once, as the reference's combine adjoint
            a = a.to(tl.float32) * tl.load(a_scale_ptr + rows, mask=r_ok, other=0.0).to(tl.float32)[:, None]
        a = a.to(DT)
        c = tl.load(c_ptr + rc[:, None] * sc + offs_2[None, :], mask=r_ok[:, None] & (offs_2[None, :] < N2),
                    other=0.0).to(DT)
        if C_SCALE:  # x[tok].to(dtype) * s.to(dtype), as the reference's gather
            c = (c.to(tl.float32) * load_scale(c_scale_ptr, rows, r_ok, True, DT)[:, None]).to(DT)
        acc += tl.dot(tl.trans(a), c, input_precision=PREC)
        if HAS_DB:
            colsum += tl.sum(a.to(tl.float32), axis=0)
    e64 = e.to(tl.int64)
    mask_1 = offs_1 < N1
    if SPLIT:  # rows past N_SPLIT belong to the second gradient (a [E, N_SPLIT, N2] view of its own)
        second = offs_1 >= N_SPLIT
        row = tl.where(second, offs_1 - N_SPLIT, offs_1).to(tl.int64)
        at = e64 * swe + row * swr
        dw_rows = tl.where(second, dw2_ptr + at, dw_ptr + at)  # [N1] row pointers
        db_rows = tl.where(second, db2_ptr + row + e64 * N_SPLIT, db_ptr + row + e64 * N_SPLIT)
    else:
        row = offs_1.to(tl.int64)
        dw_rows = dw_ptr + e64 * swe + row * swr
        db_rows = db_ptr + row + e64 * N1
    tl.store(dw_rows[:, None] + offs_2[None, :].to(tl.int64) * swc, acc.to(DT),
             mask=mask_1[:, None] & (offs_2[None, :] < N2))
    if HAS_DB:
        if pid_n2 == 0:
            tl.store(db_rows, colsum.to(db_ptr.dtype.element_ty), mask=mask_1)


# ---- host launcher -------------------------------------------------------------------------------------------


def wgrad(role, a, a_tok, a_scale, c, c_tok, c_scale, counts, E, want_db, dtype, config, split=None, out=None,
           all_rows=False):
    """dW [E, N1, N2] (and db [E, N1]); with ``split`` the two [E, split, N2] halves of A's columns instead. ``out``:
    the views to write dW into (one, or two with ``split``, sharing strides), else new contiguous tensors. The
    tile configuration is ``config`` or the tuner's for ``role`` (``"GROUP_M": 0`` in it: the old program order,
    every expert for one tile, then the next)."""
    N1, N2 = a.shape[1], c.shape[1]
    n_out = split or N1
    new = lambda *shape: torch.empty(*shape, dtype=dtype, device=a.device)  # noqa: E731 (all written)
    dws = list(out) if out is not None else [new(E, n_out, N2) for _ in range(2 if split else 1)]
    assert all(dw.shape == (E, n_out, N2) and dw.stride() == dws[0].stride() for dw in dws)
    dbs = [new(E, n_out) for _ in dws] if want_db else dws

    def launch(cfg):
        grid = (E * triton.cdiv(N1, cfg["BLOCK_N1"]) * triton.cdiv(N2, cfg["BLOCK_N2"]),)
        launch_kernel(
            _wgrad_kernel, grid,
            a, a.stride(0), a_tok if a_tok is not None else counts, a_scale if a_scale is not None else a,
            c, c.stride(0), c_tok if c_tok is not None else counts, c_scale if c_scale is not None else c,
            counts, dws[0], dbs[0], dws[-1], dbs[-1], E, N1, N2, n_out, *dws[0].stride(),
            A_GATHER=a_tok is not None, A_SCALE=a_scale is not None, C_GATHER=c_tok is not None,
            C_SCALE=c_scale is not None, HAS_DB=want_db, SPLIT=split is not None,
            EXPERT_MAJOR=group_m(cfg) != 0, BLOCK_N1=cfg["BLOCK_N1"],
            BLOCK_N2=cfg["BLOCK_N2"], BLOCK_K=cfg["BLOCK_K"], BLOCK_E=triton.next_power_of_2(E),
            PREC=dot_precision(dtype), num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        )

    rows = a.shape[0] if a_tok is None else c.shape[0]  # the buffer's routed rows (the other may be [T, ...])
    vendor = vd.candidate(dtype, N1, N2, vd.wgrad, a, a_tok, a_scale, c, c_tok, c_scale, counts, dws,
                          dbs if want_db else None, split=split, dtype=dtype, all_rows=all_rows)
    run_role(role, config, launch, vendor, dtype=dtype, device=a.device, B=rows, E=E, H=N2, I=N1,
             gated=split is not None, rule=lambda: wgrad_gpu_config(dtype))
    return dws, (dbs if want_db else [None] * len(dws))


# ---- compile targets (CI compiles each for sm_90) ------------------------------------------------------------


def compile_targets():
    """The weight-gradient kernel in each of its three uses (gate/up, down, ungated), per dtype and for every
    configuration the tuner may time."""
    f32 = torch.float32
    out = []
    # (role, dtype, config, uses); a use is (A dtype, A_GATHER, A_SCALE, C_GATHER, C_SCALE, HAS_DB, SPLIT)
    up, down, ungated = (True, False, False, True, True, True, True), (f32, True, True, False, False, True, False), \
        (True, False, False, True, False, False, False)
    real = dict(aligned=("sa", "sc", "N1", "N2", "N_SPLIT", "swe", "swr"), unit=("swc",))
    wgrad = [("rule", dt, wgrad_gpu_config(dt), (up, down, ungated), real)
             for dt in (f32, torch.float16, torch.bfloat16)]
    wgrad += [(role, dt, cfg, (up,) if role == "wgrad_up" else (down,), real)
              for role, dt, cfg in tuner_configs(("wgrad_up", "wgrad_down"))]
    # a transposed weight's gradient (GPT-OSS) is written with a column stride: nothing specialised
    wgrad.append(("rule", torch.bfloat16, wgrad_gpu_config(torch.bfloat16), (up, down), {}))
    for _role, dt, w, uses, launch in wgrad:
        w = dict(w)
        opts = dict(num_warps=w.pop("num_warps"), num_stages=w.pop("num_stages"), **launch)
        w.update(PREC=dot_precision(dt), BLOCK_E=(8, 128, 256)[len(out) % 3])
        for a_dt, ag, asc, cg, csc, db, split in uses:
            a_dt = dt if a_dt is True else a_dt
            p = {"a_ptr": a_dt, "c_ptr": dt, "dw_ptr": dt, "db_ptr": dt, "dw2_ptr": dt, "db2_ptr": dt,
                 "a_tok_ptr": torch.int64, "c_tok_ptr": torch.int64, "counts_ptr": torch.int64}
            out.append(target(_wgrad_kernel, p, dict(w, A_GATHER=ag, A_SCALE=asc, C_GATHER=cg, C_SCALE=csc,
                                                      HAS_DB=db, SPLIT=split, EXPERT_MAJOR=True), **opts))
    out.append(out[-1][:2] + ({**out[-1][2], "EXPERT_MAJOR": False},) + out[-1][3:])  # the old order ("GROUP_M": 0)
    return out
