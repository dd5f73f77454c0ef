"""The planner against this machine, and its speed (issue 26, items 3 and 4).

    python benchmarks/bench_plan.py [--out benchmarks/plan.md]

Part 1, 4 ranks spawned (gloo) as 2 nodes x 2 GPUs, mesh ("node", "local"): the links of a cluster file
(``LEVELS``: across nodes 5 ms + 5 MB/s, inside 1 ms + 50 MB/s) become the link model the planner builds for the
group (``plan.cost.link_model``), which ``exchange.emulate_links`` makes every collective wait; ``calibrate``
measures it back, and the planner, given that calibration in place of the levels' figures, predicts one MoE
layer's dispatch + combine (uniform routing, fp32 rows) for dedup off, at "node", and expert domains over "local",
"node" and both (with the domains' all-gather); each is measured (the exchange's result checked) beside it.
Part 2: planning DeepSeek-V3 (61 layers, 256 experts) on 128 x 8 GPUs and on 1000 datacenters x 8 GPUs, timed.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from datetime import timedelta

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
LEVELS = [{"name": "node", "count": 2, "alpha_s": 5e-3, "GBps": 0.005},
          {"name": "local", "count": 2, "alpha_s": 1e-3, "GBps": 0.05}]
GPU = {"name": "cpu", "bf16_tflops": 0.1, "hbm_TBps": 0.01, "memory_GB": 24}
E, K, HIDDEN, TOKENS, EXPERT_BYTES = 16, 4, 256, 64, 64 * 1024
CASES = [("dedup off", "off", None), ("dedup at node", "node", None), ("domains local=2", None, {"local": 2}),
         ("domains node=2", None, {"node": 2}), ("domains node=2,local=2", None, {"node": 2, "local": 2})]


def compare(mesh, repeats: int = 3) -> list[tuple[str, float, float]]:
    """In a 4-rank process group on ``mesh``: (case, predicted seconds, measured seconds) per case."""
    import torch

    from moecompile.distributed.calibrate import calibrate, time_dispatch
    from moecompile.distributed.domains import time_hybrid
    from moecompile.plan.cluster import read_cluster
    from moecompile.plan.cost import domain_times, exchange_times, link_model
    from moecompile.runtime.comm.exchange import emulate_links

    given = read_cluster({"gpu": GPU, "levels": LEVELS})
    emulated, _ = link_model(given.levels, [2, 2])
    gen = torch.Generator().manual_seed(0)
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(4 * TOKENS)])
    source = torch.arange(4).repeat_interleave(TOKENS)
    rows = []
    with emulate_links(emulated):
        fitted = calibrate(mesh, sizes=(1 << 12, 1 << 15, 1 << 17), repeats=2, progress=False)
        levels = read_cluster({"gpu": GPU, "levels": [{"name": lv["name"], "count": lv["count"]} for lv in LEVELS]},
                              {"params": fitted.params}).levels
        for name, dedup, domains in CASES:
            if domains is None:
                predicted = sum(exchange_times(levels, [2, 2], TOKENS, K, E, HIDDEN * 4, dedup))
                measured = time_dispatch(ids, source, E, mesh, HIDDEN, dedup, repeats=repeats)
            else:
                sizes = [domains.get(lv["name"], 1) for lv in LEVELS]
                predicted = sum(domain_times(levels, [2, 2], sizes, TOKENS * K * HIDDEN * 4, EXPERT_BYTES, 0.0,
                                             E // 4))
                measured = time_hybrid(ids, source, E, mesh, HIDDEN, dict(zip(("node", "local"), sizes)), EXPERT_BYTES,
                                       repeats=repeats)
            rows.append((name, predicted, measured))
    return rows


def _worker(rank, world, tmp):
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rdv", rank=rank, world_size=world,
                            timeout=timedelta(seconds=300))
    try:
        rows = compare(init_device_mesh("cpu", (2, 2), mesh_dim_names=("node", "local")))
        if rank == 0:
            torch.save(rows, f"{tmp}/rows.pt")
    finally:
        dist.destroy_process_group()


def _planning_speed() -> list[tuple[str, int, float]]:
    from moecompile.plan import plan, read_cluster, read_config

    shape = read_config(os.path.join(ROOT, "models", "configs", "deepseek_v3.json"))
    h100 = {"name": "H100", "bf16_tflops": 800, "hbm_TBps": 3.35, "memory_GB": 80}
    out = []
    for name, levels in (("128 nodes x 8", [{"name": "node", "count": 128, "alpha_s": 1e-5, "GBps": 25},
                                             {"name": "local", "count": 8, "alpha_s": 3e-6, "GBps": 450}]),
                         ("1000 datacenters x 8", [{"name": "dc", "count": 1000, "alpha_s": 1e-3, "GBps": 1.25},
                                                   {"name": "local", "count": 8, "alpha_s": 3e-6, "GBps": 450}])):
        start = time.perf_counter()
        result = plan(shape, read_cluster({"gpu": h100, "levels": levels}), 4096)
        out.append((name, len(result["plans"]), time.perf_counter() - start))
    return out


def main(argv=None) -> int:
    import torch
    import torch.multiprocessing as mp

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(4, tmp), nprocs=4, join=True)
        rows = torch.load(f"{tmp}/rows.pt")
    lines = [f"One MoE layer (E {E}, top-{K}, hidden {HIDDEN}, fp32 rows, {TOKENS} tokens per rank, experts of "
             f"{EXPERT_BYTES} B per rank), 4 ranks as 2 x 2, links emulated as the cluster file's and calibrated back:",
             "", "| case | predicted ms | measured ms | measured / predicted |", "|---|---|---|---|"]
    lines += [f"| {name} | {pred * 1e3:.1f} | {meas * 1e3:.1f} | {meas / pred:.2f} |" for name, pred, meas in rows]
    lines += ["", "| planning DeepSeek-V3 on | plans | seconds |", "|---|---|---|"]
    lines += [f"| {name} | {n} | {s:.3f} |" for name, n, s in _planning_speed()]
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            cmd = " ".join(sys.argv[1:] if argv is None else argv)
            f.write(f"# The planner against emulated links, and its speed (issue 26)\n\n`python "
                    f"benchmarks/bench_plan.py {cmd}` on {os.cpu_count()} CPU cores.\n\n{text}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
