"""Peak memory the vendor GEMM's backward roles allocate (runtime/kernels/vendor.py ``dh``, ``dh_kept`` reading
the projections the forward kept, ``dx`` and ``wgrad`` for the gate/up and down weight gradients), on CPU.

    python benchmarks/vendor_memory.py [--rows 4096] [--hidden 512] [--inter 2048] [--slices-as 32768x14336]
                                       [--wgrad-slices-as 4096x14336]

One bf16 Mixtral-like layer (8 experts, top-2, gated SiLU, combine weights) at ``--rows`` routed rows; each role runs
once under ``torch.profiler`` with memory profiling, and the peak of the allocations made inside it (its output
buffers come from outside, as the kernel's launcher hands them in) is printed in MiB and in [rows, I] bf16 tensors.
``--slices-as RxI`` sets ``vendor.CHUNK`` so that the float32 epilogues run in as many slices of rows as they would
at R rows and intermediate size I (default: Mixtral-8x7B at 16384 tokens); ``--slices-as none`` keeps the shipped
CHUNK. ``--wgrad-slices-as HxI`` sets ``vendor.WGRAD_CHUNK`` so that the gate/up weight gradient is made in as
many slices of columns as at hidden size H and intermediate size I (default Mixtral-8x7B); ``none`` keeps it.
Memory only: the times are not measured here.
"""

from __future__ import annotations

import argparse
import math

import torch
from torch.profiler import ProfilerActivity, profile

from moecompile.runtime import reference as ref
from moecompile.runtime.kernels import vendor as vd


def _peak(fn) -> int:
    """The peak of the bytes allocated and not yet freed while ``fn()`` runs."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    live = peak = 0
    for _, n in events:
        live += n
        peak = max(peak, live)
    return peak


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=4096, help="routed rows (tokens x top-2)")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--inter", type=int, default=2048)
    p.add_argument("--slices-as", default="32768x14336")
    p.add_argument("--wgrad-slices-as", default="4096x14336")
    args = p.parse_args(argv)
    E, K, dt = 8, 2, torch.bfloat16
    T, H, I = args.rows // K, args.hidden, args.inter
    if args.slices_as != "none":
        R, width = (int(v) for v in args.slices_as.split("x"))
        slices = math.ceil(R / max(1, vd.CHUNK // width))
        vd.CHUNK = max(1, math.ceil(args.rows / slices)) * I
    if args.wgrad_slices_as != "none":
        Hr, Ir = (int(v) for v in args.wgrad_slices_as.split("x"))
        wslices = len(vd._column_slices(2 * Ir, E * Hr))
        vd.WGRAD_CHUNK = max(8, math.ceil(2 * I / wslices / 8) * 8) * E * H
    gen = torch.Generator().manual_seed(0)
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)])
    tok, _, counts, cw, _ = ref.build_pft_ref(ids, torch.rand(T, K, generator=gen), E)
    x, dout = torch.randn(T, H, generator=gen).to(dt), torch.randn(T, H, generator=gen).to(dt)
    wg, wu = ((torch.randn(E, I, H, generator=gen) * H ** -0.5).to(dt) for _ in range(2))
    wd = (torch.randn(E, H, I, generator=gen) * I ** -0.5).to(dt)
    B = tok.shape[0]
    h, dgu, dxs = torch.empty(B, I, dtype=dt), torch.empty(B, 2 * I, dtype=dt), torch.empty(B, H, dtype=dt)
    pre = torch.randn(B, 2 * I, generator=gen).to(dt)  # the projections fused_experts_keep keeps
    unit = B * I * dt.itemsize
    roles = {
        "dh": lambda: vd.dh(x, tok, None, cw, counts, dout, wg, wu, wd, None, None, activation="silu", alpha=1.702,
                            limit=7.0, h_out=h, dgu_out=dgu),
        "dh_kept": lambda: vd.dh(x, tok, None, cw, counts, dout, wg, wu, wd, None, None, activation="silu",
                                 alpha=1.702, limit=7.0, h_out=h, dgu_out=dgu, pre=pre),  # as training runs it
        "dx": lambda: vd.dx(x, tok, counts, dgu, dout, wg, wu, None, dxs_out=dxs, scale=False, bd_dcw=False),
    }
    d_gate_up, d_down = torch.empty(E, 2 * I, H, dtype=dt), torch.empty(E, H, I, dtype=dt)  # as triton_ops hands in
    roles["wgrad_up"] = lambda: vd.wgrad(dgu, None, None, x, tok, None, counts, [d_gate_up[:, :I], d_gate_up[:, I:]],
                                         None, split=I, dtype=dt)
    roles["wgrad_down"] = lambda: vd.wgrad(dout, tok, cw, h, None, None, counts, [d_down], None, split=None, dtype=dt)
    print(f"{B} rows, H={H}, I={I}, bf16; CHUNK={vd.CHUNK} elements "
          f"({math.ceil(B / max(1, vd.CHUNK // I))} slices of the [rows, I] epilogues)")
    print(f"WGRAD_CHUNK={vd.WGRAD_CHUNK} elements ({len(vd._column_slices(2 * I, E * H))} slices of the gate/up "
          f"weight gradient, {(2 * I * E * H * dt.itemsize) / 2**20:.1f} MiB whole)")
    for name, fn in roles.items():
        peak = _peak(fn)
        print(f"  {name}: peak allocation inside the role {peak / 2**20:.1f} MiB = {peak / unit:.1f} [rows, I] bf16")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
