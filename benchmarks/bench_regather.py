"""``reshard_after_forward=True``: the gathers again in backward started ahead (``passes/regather.py``) against
waited for where AOT autograd's partitioner alone puts them (right before their wait), side by side.

    torchrun --standalone --nproc-per-node 2 benchmarks/bench_regather.py [--out benchmarks/regather.md]
        [--hidden 256] [--layers 4] [--tokens 128] [--repeats 9] [--alpha-ms 2] [--MBps 100]

A Mixtral from the tiny config (``--hidden``, ``--layers``; 8 experts, intermediate size = hidden, heads of 32)
trained with SGD on W ranks, one expert domain of every rank (``expert_domains={"ep": W}``) freed after forward;
every collective waits as the emulated link says (``exchange.emulate_links``: ``alpha + bytes / bandwidth``, on top
of loopback). Both modes are compiled first, then their steps alternate (noise falls on both alike), after one
untimed round. Per mode: the median step, and the milliseconds the step spent in ``moe.domain_gather_wait`` in
forward and in backward (``domains._finish`` timed): a gather started ahead has run, while other ops did, part of
what its wait would otherwise take.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import moecompile
import moecompile.backend as backend
from moecompile.runtime.comm import domains, exchange
from moecompile.runtime.comm.cost_model import LinkModel

from measure import torchrun_report

WAITED = {"forward": 0.0, "backward": 0.0}
_PHASE = ["forward"]


def _timed_finish(finish):
    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return finish(*args, **kwargs)
        finally:
            WAITED[_PHASE[0]] += time.perf_counter() - start
    return timed


def _build(args, mesh, ids, ahead: bool):
    from moecompile.models.hf import tiny_model

    heads = args.hidden // 32  # attention as wide as the model (the tiny config's is 32 wide)
    model = tiny_model("mixtral", hidden_size=args.hidden, intermediate_size=args.hidden, num_hidden_layers=args.layers,
                       num_attention_heads=heads, num_key_value_heads=heads, head_dim=32).train()
    moecompile.parallelize(model, mesh, ids, expert_domains={"ep": dist.get_world_size()},
                           reshard_after_forward=True)
    compiled = torch.compile(model, backend="moe", options={"inner": "aot_eager", "strict": True})
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    pass_ = backend.start_regathers_early
    if not ahead:  # the backward graph as AOT autograd's partitioner gives it
        backend.start_regathers_early = lambda graph: 0
    try:
        _step(compiled, opt, ids)  # compiles forward and backward
    finally:
        backend.start_regathers_early = pass_
    return compiled, opt


def _step(compiled, opt, ids) -> tuple[float, float, float]:
    """(seconds of the step, waited in forward, in backward): the slowest rank's."""
    for k in WAITED:
        WAITED[k] = 0.0
    dist.barrier()
    start = time.perf_counter()
    _PHASE[0] = "forward"
    loss = compiled(ids, labels=ids).loss
    _PHASE[0] = "backward"
    loss.backward()
    opt.step()
    opt.zero_grad()
    out = torch.tensor([time.perf_counter() - start, WAITED["forward"], WAITED["backward"]], dtype=torch.float64)
    dist.all_reduce(out, op=dist.ReduceOp.MAX)
    return tuple(out.tolist())


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--tokens", type=int, default=128, help="tokens per rank (batches of 64)")
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--alpha-ms", type=float, default=2.0)
    p.add_argument("--MBps", type=float, default=100.0)
    p.add_argument("--out", default="")
    args = p.parse_args()
    dist.init_process_group("gloo", timeout=timedelta(seconds=600))
    torch.set_num_threads(1)
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    link = LinkModel({"flat": (args.alpha_ms * 1e-3, 1 / (args.MBps * 1e6))})
    domains._finish = _timed_finish(domains._finish)
    vocab = 128
    ids = torch.randint(0, vocab, (world, max(1, args.tokens // 64), min(64, args.tokens)),
                        generator=torch.Generator().manual_seed(1))[rank]
    modes = {name: _build(args, mesh, ids, ahead) for name, ahead in (("started ahead", True),
                                                                     ("at its wait", False))}
    samples = {name: [] for name in modes}
    with exchange.emulate_links(link):
        for repeat in range(args.repeats + 1):  # (the first round warms up: its first step took seconds once)
            for name, (compiled, opt) in modes.items():
                took = _step(compiled, opt, ids)
                if repeat:
                    samples[name].append(took)
    lines = [f"{world} ranks, one domain of all; Mixtral hidden {args.hidden}, {args.layers} layers, 8 experts, "
             f"{ids.numel()} tokens per rank; link {args.alpha_ms:g} ms + {args.MBps:g} MB/s; median of "
             f"{args.repeats} steps each, alternating", "",
             "| backward's gather again | step ms | waited in forward ms | waited in backward ms |",
             "|---|---|---|---|"]
    for name, rows in samples.items():
        step, fwd, bwd = (statistics.median(col) * 1e3 for col in zip(*rows))
        lines.append(f"| {name} | {step:.1f} | {fwd:.1f} | {bwd:.1f} |")
    if rank == 0:
        torchrun_report("Gathers again in backward, started ahead or not", "bench_regather.py", world, lines, args.out)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
