"""SR compression of the experts an expert domain gathers (hybridep.md §IV-B, issue 25 item 5): bytes saved and
the loss curve against exact experts, training on the bundled text.

    python benchmarks/bench_compress.py [--steps 300] [--q 1 0.1 0.02] [--whole-decode 0.1]
        [--out benchmarks/compress.md] [--plot benchmarks/compress.png]

4 ranks (gloo, spawned here), a 1-D mesh and one domain of all 4 (``expert_domains={"ep": 4}``: every rank
gathers every expert, so every expert's bytes are what compression acts on); a tiny Mixtral (byte vocabulary,
2 layers, 8 experts, top-2) on windows of ``benchmarks/data/corpus.txt``, each rank its own, AdamW; the same
initial model and data for every run: exact experts (``compress=None``) and each ``--q`` (the fraction of
residual entries sent). Per run: the bytes each rank sends per step in the experts' all-gathers and in the
shared expert's all-reduce (counted as a ring all-reduce sends), the bytes the last step's forward kept for backward
(each storage a saved tensor holds, once), the peak of what the last step allocated, forward and backward
(torch.profiler, as benchmarks/vendor_memory.py), the loss (mean of the first and last 10 steps), and the seconds; the
plot draws the loss curves. ``--whole-decode q`` runs q once more with the domain's copies decoded whole before the
experts (``moe.sr_decode``, as before the experts decoded with use; ``distribute.DECODE_WITH_USE``), for the peak.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import time
from datetime import timedelta

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from bench_replication import _windows  # noqa: E402  (the same windows of the bundled text)
from vendor_memory import _peak  # noqa: E402  (the peak of what torch.profiler saw allocated)


def _run_one(q, args, text, rank, mesh, whole=False):
    import torch

    import moecompile
    from moecompile.models.hf import tiny_model
    from moecompile.passes import distribute

    distribute.DECODE_WITH_USE = not whole  # (read when the first call compiles)
    torch.manual_seed(0)
    model = tiny_model("mixtral", vocab_size=256, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                       num_local_experts=8, num_experts_per_tok=2, num_hidden_layers=2,
                       max_position_embeddings=args.seq).train()
    moecompile.parallelize(model, mesh, _windows(text, rank, 0, args.batch, args.seq),
                           expert_domains={"ep": mesh.size()}, compress=q)
    compiled = torch.compile(model, backend="moe", options={"inner": "aot_eager"})
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    losses, sent, kept, peak, start = [], 0, {}, 0, time.perf_counter()
    for step in range(args.steps):
        moecompile.comm_stats(reset=True)
        ids = _windows(text, rank, step + 1, args.batch, args.seq)
        last = step == args.steps - 1 and step  # (not while compiling: the proofs differentiate with torch.func)
        out = []

        def step_fn():
            with torch.autograd.graph.saved_tensors_hooks(lambda t: (_hold(kept, t), t)[1], lambda t: t) if last \
                    else contextlib.nullcontext():
                out.append(compiled(ids, labels=ids))
            out[0].loss.backward()

        if last:  # the last step's peak allocation, forward and backward
            peak = _peak(step_fn)
        else:
            step_fn()
        out = out[0]
        opt.step()
        opt.zero_grad()
        losses.append(float(out.loss.detach()))
        stats = moecompile.comm_stats().values()
        sent = sum(layer.get("domain_gather.peer", 0) for layer in stats)
        shared = sum(layer.get("expert_mean.peer", 0) for layer in stats)
    distribute.DECODE_WITH_USE = True
    return {"losses": losses, "sent": sent, "shared": shared, "saved": sum(kept.values()), "peak": peak,
            "seconds": time.perf_counter() - start}


def _hold(kept: dict, t) -> None:
    """The bytes of the storage ``t`` holds, counted once however many views of it are saved."""
    kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()


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
        for q, whole in [(None, False), *[(q, False) for q in args.q], *[(q, True) for q in args.whole_decode]]:
            results.append((q, whole, _run_one(q, args, text, rank, mesh, whole)))
            if rank == 0:
                print(f"done: compress={q}{' decoded whole' if whole else ''} ({results[-1][2]['seconds']:.0f} s)",
                      flush=True)
        if rank == 0:
            torch.save(results, f"{tmp}/results.pt")
    finally:
        dist.destroy_process_group()


def _table(results, args) -> str:
    exact = results[0][2]["sent"]
    lines = [f"{args.steps} steps, 4 ranks (gloo, CPU), one domain of all 4, tiny Mixtral (2 layers, 8 experts, "
             f"top-2, hidden {args.hidden}), {args.batch}x{args.seq} bytes per rank per step, AdamW lr {args.lr}.",
             "", "| compress | all-gather B/step/rank | shared expert's all-reduce B/step/rank | total, of exact | "
             "kept for backward B/rank | peak of a step B/rank | loss, first 10 | loss, last 10 | seconds |",
             "|---|---|---|---|---|---|---|---|---|"]
    for q, whole, run in results:
        first, last = run["losses"][:10], run["losses"][-10:]
        label = "None (exact)" if q is None else f"{q} (decoded whole)" if whole else f"{q}"
        lines.append(f"| {label} | {run['sent']} | {run['shared']} | "
                     f"{(run['sent'] + run['shared']) / exact:.3f} | {run['saved']} | {run['peak']} | "
                     f"{sum(first) / len(first):.4f} | "
                     f"{sum(last) / len(last):.4f} | {run['seconds']:.0f} |")
    return "\n".join(lines)


def _plot(path, results) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for q, whole, run in results:
        if not whole:  # (decoded whole or with use: the same numbers)
            ax.plot(run["losses"], label=f"compress={q}" if q is not None else "exact experts", linewidth=1)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (rank 0's batch)")
    ax.set_title("SR compression of the gathered experts")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    import torch
    import torch.multiprocessing as mp

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--q", type=float, nargs="+", default=[1.0, 0.1, 0.02])
    p.add_argument("--whole-decode", type=float, nargs="*", default=[],
                   help="these q also with the domain's copies decoded whole before the experts (moe.sr_decode), "
                        "as before the experts decoded with use")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--out", default="")
    p.add_argument("--plot", default="")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(4, tmp, args), nprocs=4, join=True)
        results = torch.load(f"{tmp}/results.pt")
    text = _table(results, args)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(f"# SR compression of gathered experts (issue 25, item 5)\n\n`python benchmarks/bench_compress.py "
                    f"{' '.join(sys.argv[1:] if argv is None else argv)}` on {os.cpu_count()} CPU cores.\n\n{text}\n")
    if args.plot:
        _plot(args.plot, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
