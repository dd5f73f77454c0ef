"""Benchmark one MoE layer's expert-parallel dispatch + combine under the link emulation, with and without
hierarchical dedup, at 2 and 4 emulated nodes; predicted (cost model) beside measured, and the bytes beside what
transformers' own expert parallelism would move for the same layer.

    torchrun --standalone --nproc-per-node 8 benchmarks/bench_ep.py [--out benchmarks/ep_results.md]

8 ranks as meshes (2 nodes x 4) and (4 nodes x 2). Routing: uniform top-K of E experts per token (HierMoE's
Table II setting). The experts pass their rows through (the exchange is what is timed; each run's result is
checked). The links are emulated (``moecompile.runtime.comm.exchange.emulate_links``): every all-to-all waits alpha +
beta x bytes of its kind on top of loopback, by default a cluster slowed 100-fold so the emulated links outweigh
loopback on a small machine (across nodes 100 MB/s and 5 ms per all-to-all, inside a node 2 GB/s and 1 ms; the flat
all-to-all is priced as the node links; ``--link links.json`` takes a calibrated model instead).

``loopback alone``: the same exchange with no emulation (this machine's own cost: gloo, copies, and 8 processes
sharing few cores), so ``measured - loopback`` is the emulated links' share, the part the cost model predicts.

transformers (5.23) columns, per rank and per dispatch + combine, for the same tokens: ``all_to_all`` (its
``ep_implementation="all_to_all"``: one row per (token, expert) to the expert's rank and back, our dedup="off"
bytes) and ``all_reduce`` (every rank runs its experts on the batch the EP group shares and the outputs are
summed: a ring all-reduce of [T_all, H], 2 (W - 1) / W x T_all x H x element bytes, before gathering the batch).
"""

from __future__ import annotations

import argparse
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import moecompile
from moecompile.distributed.calibrate import time_dispatch
from moecompile.runtime.comm.cost_model import LinkModel, dispatch_times
from moecompile.runtime.comm.plan import Placement, dedup_stats
from moecompile.runtime.comm.exchange import emulate_links

from measure import torchrun_report

DEFAULT_LINK = LinkModel({"flat": (5e-3, 1e-8), "node": (5e-3, 1e-8), "local": (1e-3, 5e-10)})


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--tokens", type=int, default=256, help="tokens per rank")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--link", default="", help="a link model JSON (python -m moecompile calibrate); default: "
                                              "the scaled-down cluster above")
    p.add_argument("--out", default="")
    args = p.parse_args()
    dist.init_process_group("gloo", timeout=timedelta(seconds=300))
    torch.set_num_threads(1)
    world, rank = dist.get_world_size(), dist.get_rank()
    link = LinkModel.load(args.link) if args.link else DEFAULT_LINK
    E, K, T, H = args.experts, args.top_k, args.tokens, args.hidden
    gen = torch.Generator().manual_seed(0)
    ids = torch.rand(world * T, E, generator=gen).argsort(-1)[:, :K]  # the same routing on every rank
    source = torch.arange(world).repeat_interleave(T)
    row = H * 4
    all_reduce = 2 * (world - 1) / world * world * T * row
    lines = [f"E={E}, K={K}, {T} tokens per rank, H={H} fp32, {world} ranks; link model {link.params}", "",
             "| mesh | dedup | predicted ms | measured ms | loopback alone ms | measured - loopback ms | inter-node MB/rank | all links MB/rank | "
             "(token, node) sends removed | transformers all_to_all MB/rank | transformers all_reduce MB/rank |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for nodes in (2, 4):
        if world % nodes:
            continue
        mesh = init_device_mesh("cpu", (nodes, world // nodes), mesh_dim_names=("node", "local"))
        placement = Placement.contiguous(E, (nodes, world // nodes))
        predicted = dispatch_times(ids, placement, source, H, 4, link)
        removed = dedup_stats(ids, placement)[0]["removed"]
        for dedup in ("off", "node"):
            moecompile.comm_stats(reset=True)
            with emulate_links(link):
                measured = time_dispatch(ids, source, E, mesh, H, dedup, repeats=args.repeats, layer="bench")
            stats = moecompile.comm_stats(reset=True)["bench"]
            loopback = time_dispatch(ids, source, E, mesh, H, dedup, repeats=args.repeats, layer="bench")
            runs = args.repeats + 1
            mine = torch.tensor([sum(v for k, v in stats.items() if k.endswith(".node")) / runs,
                                 sum(v for k, v in stats.items() if k.split(".")[-1] in ("node", "local")) / runs,
                                 (stats.get("dispatch.node", 0) + stats.get("dispatch.local", 0) +
                                  stats.get("combine.node", 0) + stats.get("combine.local", 0)) / runs],
                                dtype=torch.float64)
            dist.all_reduce(mine)
            mine /= world
            if dedup == "off":
                a2a = float(mine[2])  # one row per (token, expert) each way: transformers' all_to_all moves the same
            lines.append(f"| {nodes}x{world // nodes} | {dedup} | {predicted[dedup] * 1e3:.1f} | "
                         f"{measured * 1e3:.1f} | {loopback * 1e3:.1f} | {(measured - loopback) * 1e3:.1f} | "
                         f"{mine[0] / 1e6:.3f} | {mine[1] / 1e6:.3f} | "
                         f"{removed if dedup == 'node' else 0:.0%} | {a2a / 1e6:.3f} | {all_reduce / 1e6:.3f} |")
    if rank == 0:
        torchrun_report("Expert-parallel dispatch + combine under the link emulation", "bench_ep.py", world, lines,
                        args.out)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
