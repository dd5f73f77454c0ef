"""Expert domains (HybridEP) against plain expert parallelism and dedup across a slow link, as data per rank grows
(hybridep.md Table V's sweep, scaled down), and the all-gather's overlap in a training step.

    torchrun --standalone --nproc-per-node 8 benchmarks/bench_hybrid.py [--out benchmarks/hybrid.md]
        [--plot benchmarks/hybrid.png] [--units 6 24 96 192] [--no-step] [--no-sweep] [--compress Q]

8 ranks as 2 "datacenters" x 4 (mesh ("node", "local")); the inter-datacenter link emulated slow
(``exchange.emulate_links``: every all-to-all and all-gather waits alpha + beta x bytes of its kind on top of
loopback; default across datacenters 5 ms + 50 MB/s, inside one 1 ms + 2 GB/s, the flat kind priced as the slow
link). One MoE layer (E experts, top-K, hidden H, gated experts of intermediate I, fp32), uniform routing of
``units x 8`` tokens per rank. Per data size, one forward's expert communication (the experts pass rows through;
each result checked): plain expert parallelism (dedup "off"), dedup over "node", and expert domains sized by the
stream model (``expert_domains="auto"``'s choice, ``runtime/comm/stream.py``); predicted beside measured, and the
bytes per rank that cross the slow link. ``loopback alone``: the same exchange without the emulation (this
machine's own cost: gloo, copies, 8 processes on few cores), so ``measured - loopback`` is the emulated links'
share, the part the models predict. This is one layer's communication, not Table V's iteration time.

The step part (item 4): a tiny Mixtral trained on the same mesh with one domain per datacenter's ranks
(``{"local": 4}``, and with ``compress=Q`` too when given) and with the model's choice; a training step's time
under the emulated links, without them (compute and loopback alone), and the link seconds the emulation charged
per step: with the all-gather (exact or compressed) started ahead of the experts, the step takes less than the
sum of its parts.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import moecompile
from moecompile.distributed.calibrate import time_dispatch
from moecompile.distributed.domains import time_hybrid
from moecompile.runtime.comm import exchange, stream
from moecompile.runtime.comm.cost_model import LinkModel, dispatch_times
from moecompile.runtime.comm.plan import Placement

from measure import torchrun_report

SLOW = LinkModel({"flat": (5e-3, 2e-8), "node": (5e-3, 2e-8), "local": (1e-3, 5e-10)})
NAMES = ("node", "local")


def _sweep(args, mesh, world: int) -> tuple[list[str], dict]:
    E, K, H, I = args.experts, args.top_k, args.hidden, args.intermediate
    P_E = 3 * H * I * (E // world) * 4
    shape = tuple(mesh.shape)
    lines = [f"E={E}, K={K}, H={H}, I={I} (gated, fp32: P_E = {P_E / 1e6:.2f} MB of experts per rank), {world} "
             f"ranks as {shape[0]} x {shape[1]}; link model {SLOW.params}", "",
             "| units | tokens/rank | D MB/rank | mode | predicted ms | measured ms | loopback alone ms | "
             "measured - loopback ms | MB/rank over the slow link (measured) |",
             "|---|---|---|---|---|---|---|---|---|"]
    curves: dict[str, list[float]] = {"expert parallelism": [], "dedup node": [], "hybrid (auto)": []}
    for units in args.units:
        T = units * 8
        gen = torch.Generator().manual_seed(units)
        ids = torch.rand(world * T, E, generator=gen).argsort(-1)[:, :K]
        source = torch.arange(world).repeat_interleave(T)
        D = T * K * H * 4
        predicted = dispatch_times(ids, Placement.contiguous(E, shape), source, H, 4, SLOW, names=NAMES)
        preds = [stream.predict(ids, source, shape, NAMES, c, E, H * 4, P_E, SLOW) for c in stream.candidates(shape)]
        best = stream.choose(preds)
        sizes = dict(zip(NAMES, best.domain_sizes))
        rows = []
        runs = args.repeats + 1
        for mode, name in (("off", "expert parallelism"), ("node", "dedup node"), ("hybrid", "hybrid (auto)")):
            if mode == "hybrid":
                run = lambda: time_hybrid(ids, source, E, mesh, H, sizes, P_E, repeats=args.repeats,  # noqa: E731
                                          layer="bench")
                pred, name = best.ag + best.a2a, f"hybrid (auto) {sizes}"
            else:
                run = lambda: time_dispatch(ids, source, E, mesh, H, mode, repeats=args.repeats,  # noqa: E731
                                            layer="bench")
                pred = predicted[mode]
            moecompile.comm_stats(reset=True)
            with exchange.emulate_links(SLOW):
                measured = run()
            stats = moecompile.comm_stats(reset=True).get("bench", {})
            loopback = run()  # this machine's own cost of the same exchange
            slow = torch.tensor([sum(v for k, v in stats.items() if k.endswith(".node")) / runs],
                                dtype=torch.float64)
            dist.all_reduce(slow)
            rows.append((name, pred, measured, loopback, float(slow) / world))
        for name, pred, measured, loopback, slow in rows:
            curves["hybrid (auto)" if name.startswith("hybrid") else name].append((measured - loopback) * 1e3)
            lines.append(f"| {units} | {T} | {D / 1e6:.2f} | {name} | {pred * 1e3:.1f} | {measured * 1e3:.1f} | "
                         f"{loopback * 1e3:.1f} | {(measured - loopback) * 1e3:.1f} | {slow / 1e6:.3f} |")
    return lines, curves


def _steps(args, mesh) -> list[str]:
    from moecompile.models.hf import tiny_model

    lines = ["", "| expert domains | step ms, emulated links | step ms, no emulation | link ms charged per step | "
                 "sum of parts ms | overlap saved ms |", "|---|---|---|---|---|---|"]
    rank, world = dist.get_rank(), dist.get_world_size()
    runs = [({"local": 4}, None)] + ([({"local": 4}, args.compress)] if args.compress else []) + [("auto", None)]
    for domains, q in runs:
        model = tiny_model("mixtral").train()
        vocab = model.config.vocab_size
        ids = torch.randint(0, vocab, (world, 4, 32), generator=torch.Generator().manual_seed(1))[rank]
        with exchange.emulate_links(SLOW):
            moecompile.parallelize(model, mesh, ids, expert_domains=domains, link_model=SLOW, compress=q)
        compiled = torch.compile(model, backend="moe", options={"inner": "aot_eager"})
        opt = torch.optim.SGD(model.parameters(), lr=0.01)

        def step():
            compiled(ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()

        step()  # compiles
        times = {}
        for emulated in (True, False):
            samples = []
            exchange.charged_seconds(reset=True)
            for _ in range(args.repeats):
                dist.barrier()
                start = time.perf_counter()
                if emulated:
                    with exchange.emulate_links(SLOW):
                        step()
                else:
                    step()
                took = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
                dist.all_reduce(took, op=dist.ReduceOp.MAX)
                samples.append(float(took))
            charged = torch.tensor([exchange.charged_seconds(reset=True) / args.repeats], dtype=torch.float64)
            dist.all_reduce(charged, op=dist.ReduceOp.MAX)
            times[emulated] = (statistics.median(samples), float(charged))
        chosen = [re.search(r"expert domains (\{[^}]*\})", r.sharding).group(1)
                  for r in model._moe_parallel.report.layers]
        with_links, charged = times[True]
        alone = times[False][0]
        parts = alone + charged
        name = f"{domains}" + (f", compress={q:g}" if q is not None else "")
        lines.append(f"| {name} ({', '.join(sorted(set(chosen)))}) | {with_links * 1e3:.1f} | {alone * 1e3:.1f} | "
                     f"{charged * 1e3:.1f} | {parts * 1e3:.1f} | {(parts - with_links) * 1e3:.1f} |")
    return lines


def _plot(path: str, units, curves) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, ys in curves.items():
        ax.plot(units, ys, marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("data per rank (units of 8 tokens)")
    ax.set_ylabel("one layer's forward communication\nmeasured - loopback alone, ms")
    ax.set_title("2 x 4 ranks, the link between the 2 groups emulated slow")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--intermediate", type=int, default=256)
    p.add_argument("--units", type=int, nargs="+", default=[6, 24, 96, 192])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-step", action="store_true", help="skip the training-step part")
    p.add_argument("--no-sweep", action="store_true", help="skip the data-size sweep (the training steps alone)")
    p.add_argument("--compress", type=float, default=None,
                   help="also time steps with {'local': 4} and compress=q (the compressed gather started ahead)")
    p.add_argument("--out", default="")
    p.add_argument("--plot", default="")
    args = p.parse_args()
    dist.init_process_group("gloo", timeout=timedelta(seconds=600))
    torch.set_num_threads(1)
    world = dist.get_world_size()
    if world % 2:
        raise SystemExit("run on an even number of ranks (2 groups)")
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=NAMES)
    lines, curves = _sweep(args, mesh, world) if not args.no_sweep else ([], {})
    if not args.no_step:
        lines += _steps(args, mesh)
    if dist.get_rank() == 0:
        torchrun_report("Expert domains across a slow link (issue 25, items 3, 4 and 7)", "bench_hybrid.py", world,
                        lines, args.out)
        if args.plot and curves:
            _plot(args.plot, args.units, curves)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
