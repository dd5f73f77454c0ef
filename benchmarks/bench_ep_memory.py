"""Memory of expert parallelism, per rank: parameter, gradient and optimizer-state bytes and process memory, with the
experts sharded (``moecompile.parallelize``) against every rank holding the whole model (plain data parallelism), and
with ``--copies C`` > 1 also C copies of the experts over an outermost mesh dimension, each expert-parallel group of
RANKS / C ranks: kept whole on each copy (``"dp_replicate"``; with a plain AdamW, or with the experts' state
partitioned over the copies by ``moecompile.expert_zero_optimizer``, ZeRO-1) or split over the copies' ranks
(``"dp_shard"``, its gathered weights kept for backward or gathered again there: ``reshard_after_forward``), and
the experts replicating in each copy (``replication="adaptive"``, E / group + 1 slots a rank, ``ExpertOptimizer``'s
AdamW: the master weights and their state on the host, whole on each copy under ``"dp_replicate"``, in shares over
``"dp_shard"``).

    python benchmarks/bench_ep_memory.py [--ranks 4] [--copies 2] [--out benchmarks/ep_memory.md]

runs ``torchrun --standalone --nproc-per-node RANKS`` once per mode, each in fresh processes (so one mode's peak is
not the other's), and prints a table of rank 0's figures, with the mean time of the steps after the first. Each rank
builds the same Mixtral-style model (experts are most of its bytes), compiles it with ``backend="moe"`` (aot_eager)
and trains a few AdamW steps on its own batch. Process memory is the resident set (``VmRSS``) after building the
model, after parallelize (or not), after the steps, and its peak (``VmHWM``); tensors of a few hundred kB and more
are ``mmap``-ed, so the resident set falls when the experts of other ranks are dropped.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from datetime import timedelta

MODES = ("replicated", "sharded", "dp_replicate", "dp_replicate_zero", "dp_shard", "dp_shard_reshard",
         "dp_replicate_slots", "dp_shard_slots")
LABELS = {"replicated": "every rank holds the whole model", "sharded": "experts sharded over all",
          "dp_replicate": "copies whole (dp_replicate)", "dp_replicate_zero": "copies whole, ZeRO-1 of their experts",
          "dp_shard": "copies split (dp_shard)",
          "dp_shard_reshard": "split, gathered again in backward",
          "dp_replicate_slots": "replicating, copies whole (dp_replicate)",
          "dp_shard_slots": "replicating, master parts in shares (dp_shard)"}


def _rss_mb() -> dict[str, float]:
    fields = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                fields[key] = int(value.split()[0]) / 1024
    return fields


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _run(mode: str, args) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import moecompile
    from moecompile.distributed.zero import local
    from moecompile.models.hf import tiny_model

    dist.init_process_group("gloo", timeout=timedelta(seconds=600))
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    model = tiny_model("mixtral", hidden_size=args.hidden, intermediate_size=args.intermediate,
                       num_local_experts=args.experts, num_hidden_layers=args.layers).train()
    whole = _nbytes(model.parameters())
    out = {"whole_model_bytes": whole, "rss_built": _rss_mb()["VmRSS"]}
    ids = torch.randint(0, model.config.vocab_size, (args.batch, args.seq), generator=torch.Generator().manual_seed(rank))
    if mode == "sharded":
        moecompile.parallelize(model, init_device_mesh("cpu", (world,)), ids)
    elif mode != "replicated":  # copies of the experts over the outermost dimension
        names = ("dp_shard" if "shard" in mode else "dp_replicate", "ep")
        mesh = init_device_mesh("cpu", (args.copies, world // args.copies), mesh_dim_names=names)
        slots = dict(replication="adaptive", slots_per_rank=args.experts * args.copies // world + 1) if mode.endswith(
            "slots") else {}
        moecompile.parallelize(model, mesh, ids, reshard_after_forward=mode.endswith("reshard"), **slots)
    out["rss_parallelized"] = _rss_mb()["VmRSS"]
    compiled = torch.compile(model, backend="moe", options={"inner": "aot_eager"})
    if mode == "dp_replicate_zero":  # the experts' AdamW state partitioned over the copies (expert_zero_optimizer)
        experts = moecompile.expert_parameters(model)
        opts = [torch.optim.AdamW([p for p in model.parameters() if p not in experts], lr=1e-3),
                moecompile.expert_zero_optimizer(model, torch.optim.AdamW, lr=1e-3)]
    elif mode.endswith("slots"):  # (the experts' master weights and AdamW state on the host: ExpertOptimizer)
        opts = [moecompile.ExpertOptimizer(model, torch.optim.AdamW, lr=1e-3)]
    else:
        opts = [torch.optim.AdamW(model.parameters(), lr=1e-3)]
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        compiled(ids, labels=ids).loss.backward()
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=False)
        times.append(time.perf_counter() - start)
    out["step_s"] = sum(times[1:]) / max(1, len(times) - 1)
    held = [o for opt in opts for o in ([opt.dense, opt.experts] if mode.endswith("slots") else [local(opt)])
            if o is not None]
    masters = [layer.part.master for layer in opts[0].layers] if mode.endswith("slots") else []
    out.update(param_bytes=_nbytes(model.parameters()), grad_bytes=_nbytes(p.grad for p in model.parameters()),
               optim_bytes=_nbytes(v for opt in held for s in opt.state.values()
                                   for v in s.values() if isinstance(v, torch.Tensor) and v.dim() > 0),
               master_bytes=_nbytes(masters))
    memory = _rss_mb()
    out.update(rss_trained=memory["VmRSS"], rss_peak=memory["VmHWM"])
    every = [None] * world
    dist.all_gather_object(every, out)
    if rank == 0:
        with open(args.json, "w") as f:
            json.dump(every, f)
    dist.destroy_process_group()


def _table(results: dict, args) -> str:
    mb = lambda b: f"{b / 2 ** 20:.1f}"  # noqa: E731
    rows = [("parameters (MiB)", "param_bytes", mb), ("gradients (MiB)", "grad_bytes", mb),
            ("AdamW state (MiB)", "optim_bytes", mb),
            ("replicating experts' master weights, host (MiB)", "master_bytes", mb),
            ("resident after build (MiB)", "rss_built", "{:.0f}".format),
            ("resident after parallelize (MiB)", "rss_parallelized", "{:.0f}".format),
            ("resident after the steps (MiB)", "rss_trained", "{:.0f}".format),
            ("peak resident (MiB)", "rss_peak", "{:.0f}".format),
            ("step after the first (s)", "step_s", "{:.2f}".format)]
    modes = [m for m in MODES if m in results]
    first = results[MODES[0]][0]
    copies = f"; copies: {args.copies} of a {args.ranks // args.copies}-rank expert-parallel group" if len(
        modes) > 2 else ""
    lines = [f"Mixtral-style model, {args.layers} layers, {args.experts} experts, hidden {args.hidden}, intermediate "
             f"{args.intermediate}, fp32 ({mb(first['whole_model_bytes'])} MiB of parameters); {args.ranks} ranks on "
             f"gloo, {args.steps} AdamW steps, batch {args.batch} x {args.seq} per rank{copies}; rank 0's figures, and "
             "the largest peak of any rank; in brackets, the ratio to the first column.", "",
             "| per rank | " + " | ".join(LABELS[m] for m in modes) + " |", "|---" * (len(modes) + 1) + "|"]
    for label, key, fmt in rows + [("peak resident, largest of the ranks (MiB)", "", "{:.0f}".format)]:
        values = [max(r["rss_peak"] for r in results[m]) if not key else results[m][0][key] for m in modes]
        ratio = (lambda v: f" ({v / values[0]:.2f})") if values[0] else (lambda v: "")  # noqa: E731
        lines.append(f"| {label} | {fmt(values[0])} | " + " | ".join(f"{fmt(v)}{ratio(v)}" for v in values[1:]) + " |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--intermediate", type=int, default=2048)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--copies", type=int, default=2, help="copies of the experts (1: no copy modes)")
    p.add_argument("--out", default="")
    p.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)  # set for the torchrun children
    p.add_argument("--json", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.mode:
        _run(args.mode, args)
        return 0
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in MODES if args.copies > 1 else MODES[:2]:
            path = os.path.join(tmp, f"{mode}.json")
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.ranks}",
                   __file__, "--mode", mode, "--json", path] + sys.argv[1:]
            subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=1800)
            with open(path) as f:
                results[mode] = json.load(f)
    table = _table(results, args)
    print(table)
    if args.out:
        with open(args.out, "w") as f:
            f.write(f"# Expert parallelism: memory per rank\n\n`python benchmarks/bench_ep_memory.py --ranks "
                    f"{args.ranks} --out {args.out}`\n\n{table}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
