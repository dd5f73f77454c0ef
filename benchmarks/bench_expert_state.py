"""The host optimizer's exchanges alone (``runtime/placement/expert_state.py``): one layer's gradient reduction,
collection and weight distribution per step, timed on 4 gloo ranks (one process each, this machine), for several
expert counts under a skewed placement (one hot expert).

    python benchmarks/bench_expert_state.py [--experts 16 64 128] [--steps 5]

Each expert is one [64, 32] fp32 weight, each rank has E/4 + 4 slots; the placement is the paper's Algorithm 1 on
a popularity with one expert 20x the others'. Printed: milliseconds per step (mean of ``--steps`` after one
warm-up step, rank 0's clock between barriers) and the point-to-point messages each rank posted per step.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from datetime import timedelta

WORLD = 4


def _worker(rank, tmp, experts, steps, out):
    import torch
    import torch.distributed as dist

    from moecompile.runtime.placement.expert_state import ExpertPartition, Groups, collect, distribute, reduce_instances
    from moecompile.runtime.placement.replication import schedule

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=300))
    try:
        groups = Groups(dist.group.WORLD, timedelta(seconds=300))
        posted = []
        real = dist.batch_isend_irecv

        def counting(ops):
            posted.append(len(ops))
            return real(ops)

        dist.batch_isend_irecv = counting
        for E in experts:
            S = E // WORLD + 4
            popularity = torch.randint(1, 100, (E,), generator=torch.Generator().manual_seed(0))
            popularity[3] = 2000
            placement = schedule(popularity, WORLD, S)
            part = ExpertPartition([torch.randn(E, 64, 32)], rank, WORLD)
            grads = torch.randn(S, 64 * 32)
            for step in range(steps + 1):
                if step == 1:
                    dist.barrier()
                    start, posted[:] = time.perf_counter(), []
                reduced = reduce_instances(grads, placement, groups)
                part.master.grad = collect(reduced, placement, part, dist.group.WORLD)
                distribute(part, placement, dist.group.WORLD, "cpu")
            dist.barrier()
            if rank == 0:
                out.put((E, (time.perf_counter() - start) / steps * 1e3, sum(posted) / steps))
        dist.batch_isend_irecv = real
    finally:
        dist.destroy_process_group()


def main() -> int:
    import torch.multiprocessing as mp

    p = argparse.ArgumentParser()
    p.add_argument("--experts", type=int, nargs="*", default=[16, 64, 128])
    p.add_argument("--steps", type=int, default=5)
    args = p.parse_args()
    queue = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_worker, args=(tempfile.mkdtemp(), args.experts, args.steps, queue), nprocs=WORLD)
    print("| experts | ms per step | point-to-point ops posted per step (rank 0) |\n|---|---|---|")
    while not queue.empty():
        E, ms, ops = queue.get()
        print(f"| {E} | {ms:.1f} | {ops:.0f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
