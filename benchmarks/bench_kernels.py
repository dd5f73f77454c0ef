"""Each grouped GEMM of one MoE layer, ours against ``torch._grouped_mm`` (CUTLASS, what transformers runs), with the
layer's roofline measured in the same run.

    python benchmarks/bench_kernels.py --out benchmarks/kernels_h100.md      # GPU: Mixtral, Qwen3, DeepSeek-V3 shapes
    python benchmarks/bench_kernels.py --tiny --tokens 32                    # CPU smoke test (Triton interpreter)

Per (shape, T), bf16 on a GPU: the time and TFLOP/s of each GEMM ours and CUTLASS's for the same work

    up      x[tok] @ [Wg | Wu]^T      ours: gather + both projections + activation (up_act), the projections
                                      also stored (kept for backward, as training runs it)
    down    h @ Wd^T                  ours: the down GEMM storing y rows (down)
    dh      dout[tok] @ Wd            ours: the dh kernel reading the kept projections (dh_kept: act' fused)
    dx      [dg | du] @ [Wg | Wu]     ours: the dx kernel (its rows; the combine into dx is listed apart)
    dWgu    [dg | du]^T @ x[tok]      ours: wgrad_up, into the fused parameter's layout
    dWd     (cw dout[tok])^T @ h      ours: wgrad_down

and the layer's roofline: max(FLOPs / the dense-matmul rate, bytes / the copy rate), both rates measured in the
same run (a [B, H] x [H, 2I] matmul; a copy of the expert weights), against the sum of our kernels' times. Bytes:
the expert weights read in the forward, read again in the backward and their gradients written, plus x, out,
dout and dx. Decode sizes (--decode, forward only): the bound is reading the weights of the experts that get a
token, at the copy rate. Kernel times come from the profiler (device time per kernel); on CPU only the total of
each call is timed (the interpreter: a check that the script runs, no figure of speed).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

SHAPES = {"mixtral": ("Mixtral-8x7B", 4096, 14336, 8, 2), "qwen3": ("Qwen3-30B-A3B", 2048, 768, 128, 8),
          "dsv3": ("DeepSeek-V3", 7168, 2048, 256, 8)}
TINY = {"mixtral": ("tiny-mixtral", 64, 96, 8, 2), "qwen3": ("tiny-qwen3", 64, 48, 16, 4),
        "dsv3": ("tiny-dsv3", 96, 64, 16, 4)}
KERNELS = {"_up_act_kernel": "up", "_down_kernel": "down", "_dh_kernel": "dh", "_dx_kernel": "dx",
           "_combine_kernel": "combine"}


def bench_ms(fn, device) -> float:
    if device.type == "cuda":
        from triton.testing import do_bench

        return do_bench(fn, warmup=10, rep=50, return_mode="median")
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def kernel_ms(fn, device) -> dict[str, float]:
    """Device time of each of our kernels in one call of ``fn`` (the profiler; the two weight-gradient launches
    in their order: dWgu then dWd); empty on CPU."""
    if device.type != "cuda":
        return {}
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    out: dict[str, float] = {}
    wgrads = 0
    for e in sorted(prof.events(), key=lambda e: e.time_range.start):
        name = e.name
        if name == "_wgrad_kernel":
            key = ("dWgu", "dWd")[min(wgrads, 1)]
            wgrads += 1
        else:
            key = KERNELS.get(name)
        if key is not None:
            out[key] = out.get(key, 0.0) + e.device_time_total / 1e3
    return out


def problem(H, I, E, K, T, dtype, device, seed=0):
    g = torch.Generator(device).manual_seed(seed)
    rnd = lambda *s, scale=1.0: (torch.randn(*s, generator=g, device=device) * scale).to(dtype)  # noqa: E731
    x = rnd(T, H)
    gate_up = rnd(E, 2 * I, H, scale=H ** -0.5)
    wd = rnd(E, H, I, scale=I ** -0.5)
    ids = torch.rand(T, E, generator=g, device=device).topk(K, dim=1).indices
    from moecompile.runtime import reference as ref

    tok, _, counts, cw, src = ref.build_pft_ref(ids, torch.rand(T, K, generator=g, device=device), E)
    return x, gate_up, wd, tok, counts, cw, src


def _kernel_config(role, dt, dev, B, E, H, I, gated):
    """The tiles the launcher takes for ``role`` without tuning now (tuned before, shipped or the rule), the rule's
    where that is the vendor GEMM: a configuration our kernel runs."""
    from moecompile.runtime.kernels import tiles, tuning

    rule = (lambda: tiles.wgrad_gpu_config(dt)) if role.startswith("wgrad") else (
        lambda: tiles.rule_config(role, B / E, dt))
    cfg = tuning.tuner().lookup(role, tuning.key(role, dt, H, I, E, B, gated), dt, dev, rule)[0]
    return rule() if tuning.is_vendor(cfg) else cfg


def tile_order(label, T, calls, dims, dev, order_rows):
    """Our kernels in their program order (the GEMMs' grouped tiles, ``grouped_common.tile_of``; the weight
    gradients expert by expert) against the order before (GROUP_M = 0), each on the same tiles: ``calls`` are
    (kind, role, launch(cfg), gated, (h, i) as the role's tuning key has them)."""
    from moecompile.runtime.kernels import tiles, tuning

    dt, dev, B, E, H, I = dims
    for kind, role, call, gated, (h, i) in calls:
        cfg = _kernel_config(role, dt, dev, B, E, h, i, gated)
        ms = {g: bench_ms(lambda g=g: call(dict(cfg, GROUP_M=g)), dev) for g in (tiles.GROUP_M, 0)}
        order_rows.append((label, T, kind, tuning.describe(cfg), ms[tiles.GROUP_M], ms[0], ms[0] / ms[tiles.GROUP_M]))


def run_shape(name, label, H, I, E, K, T, args, rows, decode_rows, order_rows):
    from moecompile.runtime import triton_ops  # noqa: F401  (registers moe::fused_experts and _keep)
    from moecompile.runtime.kernels import grouped_mlp as gm
    from moecompile.runtime.kernels import grouped_wgrad as gw

    dev, dt = args.device, args.dtype
    elt = torch.finfo(dt).bits // 8
    x, gate_up, wd, tok, counts, cw, src = problem(H, I, E, K, T, dt, dev)
    B = T * K
    wg, wu = gate_up[:, :I], gate_up[:, I:]
    fl_up, fl_dn = 2 * B * H * 2 * I, 2 * B * I * H
    if args.decode:  # forward only: bound by reading the weights of the experts that get a token
        fwd = lambda: torch.ops.moe.fused_experts(x, tok, counts, cw, None, None, wd, None, None, None, None,  # noqa
                                                  "silu", 1.702, 7.0, T, src, gate_up, "chunk")
        touched = int((counts > 0).sum())
        copy_rate = _copy_rate(gate_up, dev)  # bytes / ms
        bound = touched * 3 * H * I * elt / copy_rate
        ms = bench_ms(fwd, dev)
        decode_rows.append((label, T, touched, ms, bound, bound / ms))
        return
    # the same-run rates: a dense matmul of the up GEMM's size; a copy of the expert weights
    dense_rate = fl_up / _matmul_ms(B, H, 2 * I, dt, dev)  # FLOP / ms
    copy_rate = _copy_rate(gate_up, dev)
    # CUTLASS (torch._grouped_mm) for the same six GEMMs, with the gathers done beforehand
    offs = torch.cumsum(counts, 0).to(torch.int32)
    xg, dout = x[tok], torch.randn(T, H, device=dev).to(dt)
    h, dgu = torch.randn(B, I, device=dev).to(dt), torch.randn(B, 2 * I, device=dev).to(dt)
    gmm = torch._grouped_mm
    base = {
        "up": bench_ms(lambda: gmm(xg, gate_up.transpose(1, 2), offs=offs), dev),
        "down": bench_ms(lambda: gmm(h, wd.transpose(1, 2), offs=offs), dev),
        "dh": bench_ms(lambda: gmm(dout[tok], wd, offs=offs), dev),  # the projections kept by the forward
        "dx": bench_ms(lambda: gmm(dgu, gate_up, offs=offs), dev),
        "dWgu": bench_ms(lambda: gmm(dgu.t(), xg, offs=offs), dev),
        "dWd": bench_ms(lambda: gmm((dout[tok] * cw[:, None].to(dt)).t(), h, offs=offs), dev),
    }
    flops = {"up": fl_up, "down": fl_dn, "dh": fl_dn, "dx": fl_up, "dWgu": fl_up, "dWd": fl_dn}
    # ours: the forward kernels called alone (up keeping its projections, as training runs it), the backward's
    # through the profiler
    pre = torch.empty(B, 2 * I, device=dev, dtype=dt)
    ours = {"up": bench_ms(lambda: gm.up_act(x, tok, counts, wg, wu, zero_tail=False, pre_out=pre), dev)}
    h_ours = gm.up_act(x, tok, counts, wg, wu)
    ours["down"] = bench_ms(lambda: gm.down_combine(h_ours, tok, counts, wd, combine=False), dev)
    dgu_out = torch.empty(E, 2 * I, H, device=dev, dtype=dt)
    tile_order(label, T, [
        ("up", "up_act_kept", lambda cfg: gm.up_act(x, tok, counts, wg, wu, zero_tail=False, pre_out=pre, config=cfg),
         True, (H, I)),
        ("down", "down", lambda cfg: gm.down_combine(h_ours, tok, counts, wd, combine=False, config=cfg), False,
         (H, I)),
        ("dWgu", "wgrad_up", lambda cfg: gw.wgrad("wgrad_up", dgu, None, None, x, tok, None, counts, E, False, dt,
                                                  cfg, split=I, out=[dgu_out[:, :I], dgu_out[:, I:]]),
         True, (H, 2 * I)),
    ], (dt, dev, B, E, H, I), dev, order_rows)
    leaves = [t.detach().requires_grad_() for t in (x, gate_up, wd)]

    def fwd_bwd():
        out, _pre = torch.ops.moe.fused_experts_keep(leaves[0], tok, counts, cw, None, None, leaves[2], None, None,
                                                     None, None, "silu", 1.702, 7.0, T, src, leaves[1], "chunk")
        torch.autograd.grad(out, leaves, dout.to(out.dtype))  # returned and dropped: DeepSeek-V3's 22 GB of
        # weight gradients accumulated in .grad beside the weights and the backward's buffers ran an H100 out of memory

    total = bench_ms(fwd_bwd, dev)
    ours.update({k: v for k, v in kernel_ms(fwd_bwd, dev).items() if k not in ours})
    weights = 3 * E * H * I * elt
    bytes_moved = 3 * weights + 4 * T * H * elt
    roof = max(3 * (fl_up + fl_dn) / dense_rate, bytes_moved / copy_rate)
    for k in ("up", "down", "dh", "dx", "dWgu", "dWd"):
        # on CUDA, a role no kernel of ours ran for is one the tuner gave to torch._grouped_mm; on CPU the
        # backward's kernels are not timed one by one (no CUDA profiler)
        mine = ours.get(k, "vendor" if dev.type == "cuda" else "n/a")
        ok = not isinstance(mine, str)
        rows.append((label, T, k, mine, flops[k] / mine / 1e9 if ok else mine, base[k], flops[k] / base[k] / 1e9,
                     base[k] / mine if ok else mine))
    rows.append((label, T, "layer fwd+bwd (all launches)", total, 3 * (fl_up + fl_dn) / total / 1e9, roof,
                 3 * (fl_up + fl_dn) / roof / 1e9, roof / total))

    def fwd_bwd_again():  # moe::fused_experts, whose backward runs the gate/up GEMM again (inference's op)
        out = torch.ops.moe.fused_experts(leaves[0], tok, counts, cw, None, None, leaves[2], None, None, None, None,
                                          "silu", 1.702, 7.0, T, src, leaves[1], "chunk")
        torch.autograd.grad(out, leaves, dout.to(out.dtype))

    again = bench_ms(fwd_bwd_again, dev)
    rows.append((label, T, "layer fwd+bwd, projections recomputed", again, 3 * (fl_up + fl_dn) / again / 1e9, roof,
                 3 * (fl_up + fl_dn) / roof / 1e9, roof / again))


def _matmul_ms(M, K, N, dt, dev) -> float:
    a, b = torch.randn(M, K, device=dev).to(dt), torch.randn(K, N, device=dev).to(dt)
    return bench_ms(lambda: a @ b, dev)


def _copy_rate(t, dev) -> float:
    """Bytes per ms of a device copy of ``t`` (read + write)."""
    dst = torch.empty_like(t)
    return 2 * t.numel() * t.element_size() / bench_ms(lambda: dst.copy_(t), dev)


def report(args, rows, decode_rows, order_rows=(), failed=()) -> str:
    import triton

    dev = torch.cuda.get_device_name(args.device) if args.device.type == "cuda" else "cpu (Triton interpreter)"
    out = ["# Grouped GEMMs of one MoE layer: ours vs torch._grouped_mm", "",
           f"- device: {dev}; dtype {str(args.dtype).removeprefix('torch.')}; torch {torch.__version__}, "
           f"triton {triton.__version__}", ""]
    if rows:
        out += ["| shape | T | GEMM | ours ms | ours TFLOP/s | grouped_mm ms | grouped_mm TFLOP/s | ours vs grouped_mm |",
                "|---|---|---|---|---|---|---|---|"]
        num = lambda v, spec, unit="": v if isinstance(v, str) else f"{v:{spec}}{unit}"  # noqa: E731
        out += [f"| {a} | {b} | {c} | {num(d, '.3f')} | {num(e, '.0f')} | {f:.3f} | {g:.0f} | {num(h, '.2f', 'x')} |"
                for a, b, c, d, e, f, g, h in rows]
        out += ["", "The layer rows: ours against the roofline (its columns: roofline ms and TFLOP/s; the last, the "
                "fraction of it reached), as training runs it (the projections kept for backward) and with its "
                "backward running the gate/up GEMM again (the op before). `vendor`: the tuner gave that GEMM to "
                "torch._grouped_mm on this device (it timed faster than our tiles), so no kernel of ours ran for it."]
    if order_rows:
        out += ["", "Program order: our up (keeping its projections), down and gate/up weight-gradient kernels on "
                "the same tiles, in their order (the GEMMs: GROUP_M row tiles walk the columns together; the weight "
                "gradient: expert by expert) against the order before (the GEMMs: row tile by row tile for each "
                "column; the weight gradient: every expert for each tile).", "",
                "| shape | T | kernel | tiles | now ms | before ms | before / now |", "|---|---|---|---|---|---|---|"]
        out += [f"| {a} | {b} | {c} | {d} | {e:.3f} | {f:.3f} | {g:.2f}x |" for a, b, c, d, e, f, g in order_rows]
    if decode_rows:
        out += ["", "| shape | T | experts touched | fwd ms | weight-read bound ms | fraction of bound |",
                "|---|---|---|---|---|---|"]
        out += [f"| {a} | {b} | {c} | {d:.3f} | {e:.3f} | {f:.2f} |" for a, b, c, d, e, f in decode_rows]
    if failed:
        out += ["", "Failed:", ""] + [f"- {f}" for f in failed]
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="mixtral,qwen3,dsv3")
    p.add_argument("--tokens", help="comma-separated (default 4096,16384; 16,256 with --decode; 32 with --tiny)")
    p.add_argument("--decode", action="store_true", help="forward only, against the weight-read bound")
    p.add_argument("--tiny", action="store_true", help="small widths (runs on CPU in the interpreter)")
    p.add_argument("--out", help="also write the markdown report here")
    args = p.parse_args(argv)
    args.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.device.type == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
        if not args.tiny:
            p.error("without a GPU only --tiny runs (the kernels run in Triton's interpreter)")
    args.dtype = torch.bfloat16 if args.device.type == "cuda" else torch.float32
    default = "32" if args.tiny else ("16,256" if args.decode else "4096,16384")
    tokens = [int(t) for t in (args.tokens or default).split(",")]
    rows, decode_rows, order_rows = [], [], []
    failed: list[str] = []
    for name in args.models.split(","):
        label, H, I, E, K = (TINY if args.tiny else SHAPES)[name]
        for T in tokens:
            try:
                run_shape(name, label, H, I, E, K, T, args, rows, decode_rows, order_rows)
                print(f"{label} T={T} done", file=sys.stderr, flush=True)
            except Exception as exc:  # noqa: BLE001 - an out-of-memory shape is a line of the report, not its end
                failed.append(f"{label} T={T}: {type(exc).__name__}: {' '.join(str(exc).split())[:200]}")
                print(failed[-1], file=sys.stderr, flush=True)
            if args.device.type == "cuda":
                torch.cuda.empty_cache()
            if args.out:  # rewritten after every shape: a run stopped at a time limit keeps what it measured
                Path(args.out).write_text(report(args, rows, decode_rows, order_rows, failed))
    text = report(args, rows, decode_rows, order_rows, failed)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
