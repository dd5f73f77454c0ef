"""MoE blocks beside a "tp" mesh dimension, per rank: ``moe_tp`` "off", "ssmb" and "ted" side by side.

    python benchmarks/bench_moe_tp.py [--world 4] [--steps 3] [--seq 64] [--hidden 128] [--out benchmarks/moe_tp.md]

World W on gloo (CPU), mesh ("dp", "tp") = (W / 2, 2): the two ranks of a tp group hold the same batch. For a
Mixtral-like and a DeepSeek-V3-like small transformers model (the tiny test configs, 8 experts, top-2, at
``--hidden`` with experts half as wide; random weights, fp32) and each mode, every rank parallelizes the model,
compiles each MoE block alone with ``backend="moe"`` (aot_eager) and trains ``--steps`` SGD steps after one warm-up
step, reporting per rank: the bytes autograd saves for backward while the MoE blocks run (saved-tensor hooks around
each block's call; each storage once, the parameters' own left out), the rows and bytes its exchanges send per step
(dispatch and combine, tp gathers and reductions; by link: "tp" is a rank of the same tp group, "dp" one of
another), its expert parameter bytes, and the median step time. One table, rank by rank; timings on this shared CPU
machine are noisy, the bytes are exact.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

MODES = ("off", "ssmb", "ted")
FAMILIES = {"Mixtral-like": "mixtral", "DeepSeek-V3-like": "deepseek_v3"}


def _saved_in_blocks(model, blocks):
    """Forward hooks that count the storages autograd saves while each MoE block runs, the parameters' own left
    out (activations only); returns the counter."""
    seen: dict[int, int] = {}
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def pack(t):
        if t.untyped_storage().data_ptr() not in weights:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    ctx = []

    def enter(module, args):
        ctx.append(torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t))
        ctx[-1].__enter__()

    def leave(module, args, out):
        ctx.pop().__exit__(None, None, None)

    for block in blocks:
        block.register_forward_pre_hook(enter)
        block.register_forward_hook(leave)
    return seen


def _run(family, mode, mesh, args):
    import moecompile
    from moecompile.models.hf import build_model, tiny_config

    rank = dist.get_rank()
    sizes = dict(hidden_size=args.hidden, intermediate_size=args.hidden // 2)
    if family == "deepseek_v3":
        sizes["moe_intermediate_size"] = args.hidden // 2
    model = build_model(tiny_config(family, **sizes)).train()
    gen = torch.Generator().manual_seed(7)
    batches = torch.randint(0, model.config.vocab_size, (mesh.shape[0], 2, args.seq), generator=gen)
    mine = batches[mesh.get_coordinate()[0]]
    moecompile.parallelize(model, mesh, mine, moe_tp=mode)
    blocks = [model.get_submodule(r.path) for r in model._moe_parallel.report.layers]
    for block in blocks:
        block.compile(backend="moe", options={"inner": "aot_eager"})
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    experts = sum(p.numel() * p.element_size() for p in moecompile.expert_parameters(model))
    model(mine, labels=mine).loss.backward()  # warm-up: compiles
    opt.zero_grad()
    seen = _saved_in_blocks(model, blocks)
    moecompile.comm_stats(reset=True)
    times, saved = [], 0
    for _ in range(args.steps):
        seen.clear()
        dist.barrier()
        start = time.perf_counter()
        out = model(mine, labels=mine)
        saved = sum(seen.values())
        out.loss.backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - start)
    stats = moecompile.comm_stats()
    sent = {}
    for layer in stats.values():
        for key, value in layer.items():
            phase, _, link = key.partition(".")
            if phase in ("dispatch", "combine", "tp_gather", "tp_reduce") and link != "self":
                sent[link] = sent.get(link, 0) + value // args.steps
    rows = sum(v for layer in stats.values() for k, v in layer.items() if k.startswith("dispatch.")) // args.steps
    row_bytes = model.config.hidden_size * 4
    return dict(rank=rank, saved=saved, rows=rows // row_bytes, sent=sent, experts=experts,
                ms=statistics.median(times) * 1e3)


def _worker(rank, world, tmp, args):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=world,
                            timeout=timedelta(seconds=300))
    try:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
        results = []
        for name, family in FAMILIES.items():
            for mode in MODES:
                row = _run(family, mode, mesh, args)
                every = [None] * world
                dist.all_gather_object(every, row)
                results += [(name, mode, r) for r in every]
        if rank == 0:
            Path(f"{tmp}/results.txt").write_text(repr(results))
    finally:
        dist.destroy_process_group()


def _table(results, args) -> str:
    mib = lambda b: f"{b / 2**20:.3f}"  # noqa: E731
    lines = [f"`python benchmarks/bench_moe_tp.py --world {args.world} --steps {args.steps} --seq {args.seq} "
             f"--hidden {args.hidden}` "
             f"(gloo, CPU, fp32; mesh ({args.world // 2}, 2) (\"dp\", \"tp\"); 2 x {args.seq} tokens per rank)", "",
             "| model | moe_tp | rank | MoE activations saved MiB | rows dispatched | MiB sent to tp | MiB sent to dp "
             "| expert params MiB | step ms |", "|---|---|---|---|---|---|---|---|---|"]
    for name, mode, r in results:
        lines.append(f"| {name} | {mode} | {r['rank']} | {mib(r['saved'])} | {r['rows']} | "
                     f"{mib(r['sent'].get('tp', 0))} | {mib(r['sent'].get('dp', 0))} | {mib(r['experts'])} | "
                     f"{r['ms']:.1f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=128, help="hidden size (expert intermediate: half of it)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if args.world % 2 or args.world < 2:
        parser.error("--world must be even (a tp size of 2)")
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(args.world, tmp, args), nprocs=args.world, join=True)
        import ast

        table = _table(ast.literal_eval(Path(f"{tmp}/results.txt").read_text()), args)
    print(table)
    if args.out:
        Path(args.out).write_text(table)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    sys.exit(main())
