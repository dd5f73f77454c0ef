"""Adaptive expert replication on skewed routing: tokens dropped and the straggler's rows, per step, against
static placement and against re-placing every 10/50/100 steps (the FlexMoE-style baseline, which moves each
re-placed expert's optimizer state with it: its bytes are counted).

    python benchmarks/bench_replication.py [--steps 120] [--out benchmarks/replication.md] [--plot benchmarks/replication.png]

Four ranks (gloo, one process each, on this machine) train a tiny GPT-style MoE (transformers' Mixtral:
byte-level vocabulary, 2 layers, 8 experts, top-1 routing) on windows of a bundled text
(``benchmarks/data/corpus.txt``: a snapshot of this repository's README), each rank its own windows, with
``moecompile.parallelize(..., replication=..., slots_per_rank=4)`` (16 slots for 8 experts) and
``moecompile.ExpertOptimizer`` (AdamW), compiled with ``backend="moe"`` (aot_eager). Runs, each from the same
initial model and data:

- with a capacity factor (``--capacity 1.0``; each instance holds ceil(factor x routed rows / slots) rows):
  static placement, adaptive every step, and adaptive every 10, 50 and 100 steps (``place_every``);
- dropless: static against adaptive every step.

Printed per run (both layers together, over the steps): routed rows dropped (% of routed, mean per step), the
largest rows one rank's slots received in a step divided by the mean over ranks (the straggler; 1.0 is even),
every rank's bytes per step: the gradient all-reduce's inputs, what the gradient collection and the weight
distribution sent to other ranks, and (the paper's Appendix A count, every link: network, host-device and
device copies) the gradients the optimizer received and the weights the slots received, and
the bytes a design moving optimizer state with its experts would have moved to re-place them (``coupled``: the
slots whose expert changed x their fp32 master weights and AdamW state). The plot shows, for the adaptive run
with a capacity, layer 0's rows routed to each expert per step and the instances each got for the next.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from datetime import timedelta

RUNS = [("static", 1, True), ("adaptive", 1, True), ("adaptive", 10, True), ("adaptive", 50, True),
        ("adaptive", 100, True), ("static", 1, False), ("adaptive", 1, False)]  # (mode, place_every, capacity)
HERE = os.path.dirname(os.path.abspath(__file__))


def _windows(text: bytes, rank: int, step: int, batch: int, seq: int):
    import torch

    gen = torch.Generator().manual_seed(1000 * step + rank)
    starts = torch.randint(0, len(text) - seq, (batch,), generator=gen).tolist()
    return torch.tensor([list(text[s:s + seq]) for s in starts], dtype=torch.long)


def _run_one(mode, every, capped, args, text, rank, world, mesh):
    import torch
    import torch.distributed as dist

    import moecompile
    from moecompile.models.hf import tiny_model

    model = tiny_model("mixtral", vocab_size=256, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                       num_local_experts=8, num_experts_per_tok=1, num_hidden_layers=2,
                       max_position_embeddings=args.seq).train()
    example = _windows(text, rank, 0, args.batch, args.seq)
    moecompile.parallelize(model, mesh, example, replication=mode, slots_per_rank=4,
                           capacity_factor=args.capacity if capped else None)
    compiled = torch.compile(model, backend="moe", options={"inner": "aot_eager"})
    optimizer = {"adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}[args.optimizer]
    opt = moecompile.ExpertOptimizer(model, optimizer, lr=args.lr, place_every=every)
    losses, start = [], time.perf_counter()
    for step in range(args.steps):
        ids = _windows(text, rank, step + 1, args.batch, args.seq)
        out = compiled(ids, labels=ids)
        out.loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(out.loss.detach()))
    loss = torch.tensor(losses[-10:]).mean()
    dist.all_reduce(loss)
    phases = {"reduce": ("reduce",), "collect": ("collect",), "distribute": ("distribute",),  # to other ranks
              "to_optimizer": ("collect", "collect.local"),  # every link, as the paper's Appendix A counts
              "to_slots": ("distribute", "distribute.local", "distribute.copy")}
    sent = torch.tensor([sum(h["bytes"].get(k, 0) for step in opt.history for h in step.values() for k in keys)
                         for keys in phases.values()], dtype=torch.float64)
    dist.all_reduce(sent)  # every rank's
    return {"history": opt.history, "loss": float(loss) / world, "seconds": time.perf_counter() - start,
            "slots": 4, "world": world, "sent": dict(zip(phases, sent.tolist()))}


def _summary(run) -> dict:
    hist, S, W = run["history"], run["slots"], run["world"]
    routed = dropped = coupled = 0
    stragglers = []
    for step in hist:
        worst = mean = 0.0
        for h in step.values():
            routed += sum(h["popularity"])
            dropped += h["dropped"]
            coupled += h["coupled_state_bytes"]
            per_rank = [sum(h["rows_per_slot"][r * S:(r + 1) * S]) for r in range(W)]
            worst, mean = worst + max(per_rank), mean + sum(per_rank) / W
        stragglers.append(worst / mean if mean else 1.0)
    n = len(hist)
    return {"dropped_pct": 100.0 * dropped / routed if routed else 0.0, "dropped_per_step": dropped / n,
            "straggler": sum(stragglers) / n, "coupled_total": coupled,
            **{f"{k}_per_step": v / n for k, v in run["sent"].items()}}


def _worker(rank, world, tmp, args):
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=world,
                            timeout=timedelta(seconds=900))
    try:
        mesh = init_device_mesh("cpu", (world,))
        with open(os.path.join(HERE, "data", "corpus.txt"), "rb") as f:
            text = f.read()
        results = []
        for mode, every, capped in [RUNS[i] for i in args.runs]:
            torch.manual_seed(0)
            results.append(((mode, every, capped), _run_one(mode, every, capped, args, text, rank, world, mesh)))
            if rank == 0:
                print(f"done: {mode} every {every} {'capacity' if capped else 'dropless'} "
                      f"({results[-1][1]['seconds']:.0f} s)", flush=True)
        if rank == 0:
            torch.save(results, f"{tmp}/results.pt")
    finally:
        dist.destroy_process_group()


def _table(results, args) -> str:
    lines = [f"{args.steps} steps, 4 ranks (gloo, CPU), tiny Mixtral (2 layers, 8 experts, top-1, hidden "
             f"{args.hidden}), {args.batch}x{args.seq} bytes per rank per step, 4 slots per rank, {args.optimizer}; "
             "bytes per step, every rank's: collect and distribute sent to other ranks, all-reduce its inputs; "
             "to optimizer, to slots: every link (network, host-device, device copies), the paper's count.",
             "",
             "| run | capacity | dropped % | dropped rows/step | straggler (max/mean rank rows) | all-reduce B/step "
             "| collect B/step | distribute B/step | to optimizer B/step | to slots B/step | coupled state B (total) "
             "| loss (last 10) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for (mode, every, capped), run in results:
        s = _summary(run)
        name = mode if mode == "static" else f"adaptive, every {every} step{'s' if every > 1 else ''}"
        lines.append(f"| {name} | {args.capacity if capped else 'dropless'} | {s['dropped_pct']:.2f} | "
                     f"{s['dropped_per_step']:.1f} | {s['straggler']:.3f} | {s['reduce_per_step']:.0f} | "
                     f"{s['collect_per_step']:.0f} | "
                     f"{s['distribute_per_step']:.0f} | {s['to_optimizer_per_step']:.0f} | "
                     f"{s['to_slots_per_step']:.0f} | {s['coupled_total']:.0f} | {run['loss']:.3f} |")
    return "\n".join(lines)


def _plot(results, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run = next(r for (mode, every, capped), r in results if mode == "adaptive" and every == 1 and capped)
    layer = next(iter(run["history"][0]))
    popularity = [h[layer]["popularity"] for h in run["history"]]
    instances = [h[layer]["instances"] for h in run["history"]]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    steps = range(1, len(popularity) + 1)
    for e in range(len(popularity[0])):
        top.plot(steps, [p[e] for p in popularity], label=f"expert {e}")
        bottom.step(steps, [i[e] for i in instances], where="post")
    top.set_ylabel("rows routed (all ranks)")
    top.set_title(f"{layer}: popularity and instances (adaptive, every step)")
    top.legend(ncol=4, fontsize=7)
    bottom.set_ylabel("instances next step")
    bottom.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main() -> int:
    import torch.multiprocessing as mp

    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--capacity", type=float, default=1.0)
    p.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw")
    p.add_argument("--runs", type=int, nargs="*", default=list(range(len(RUNS))),
                   help="which runs, by index: " + ", ".join(f"{i}: {r}" for i, r in enumerate(RUNS)))
    p.add_argument("--out", default="")
    p.add_argument("--plot", default="")
    args = p.parse_args()
    import torch

    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(4, tmp, args), nprocs=4, join=True)
        results = torch.load(f"{tmp}/results.pt")
    table = _table(results, args)
    print(table)
    if args.out:
        with open(args.out, "w") as f:
            f.write("# Adaptive expert replication: drops and stragglers\n\n`python benchmarks/bench_replication.py "
                    f"--steps {args.steps} --out {args.out}`\n\n{table}\n")
    if args.plot:
        _plot(results, args.plot)
        print(f"plot: {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
