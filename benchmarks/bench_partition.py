"""A replicating layer's slot rows in rank order (``ExpertPartition.flatten`` and ``unflatten``, every optimizer
step: the slot gradients in, the assembled weights out), against the index gather they replaced (an int64 index of
one expert's elements and its inverse, kept per layer and copied to the rows' device at every call), side by side in
one run, one thread.

    python benchmarks/bench_partition.py [--hidden 1024] [--intermediate 2048] [--ranks 8] [--slots 8]

One expert: a fused gate/up weight [2I, H] and a down weight [H, I] (DeepSeek-V3's: H 7168, I 2048, whose index
pair is 672 MiB a layer). Printed per layout: building the partition, the index bytes it keeps, and the best of 3
flatten + unflatten of ``--slots`` experts.
"""

from __future__ import annotations

import argparse
import math
import time


def main() -> None:
    import torch

    from moecompile.runtime.placement.expert_state import ExpertPartition

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=2048)
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--slots", type=int, default=8)
    args = parser.parse_args()
    torch.set_num_threads(1)
    H, I, n = args.hidden, args.intermediate, args.slots
    full = [torch.empty(1, 2 * I, H).expand(8, 2 * I, H), torch.empty(1, H, I).expand(8, H, I)]  # (8 experts)
    start = time.perf_counter()
    part = ExpertPartition(full, 0, args.ranks)
    built = {"runs (ExpertPartition)": time.perf_counter() - start}
    starts = [0]  # where each weight's elements begin in one expert's weights laid end to end
    for shape in part.shapes:
        starts.append(starts[-1] + math.prod(shape))
    start = time.perf_counter()
    order = torch.cat([torch.arange(begin + lo, begin + hi) for runs in part.runs
                       for (lo, hi), begin in zip(runs, starts)])
    inverse = torch.argsort(order)
    built["index gather"] = time.perf_counter() - start

    def gathered(weights):
        rows = torch.cat([w.reshape(n, -1) for w in weights], 1)[:, order.to(weights[0].device)]
        back = rows[:, inverse.to(rows.device)]
        return [back[:, a:b].reshape(n, *shape) for a, b, shape in zip(starts, starts[1:], part.shapes)]

    weights = [torch.randn(n, 2 * I, H), torch.randn(n, H, I)]
    runs = {"runs (ExpertPartition)": lambda: part.unflatten(part.flatten(weights)),
            "index gather": lambda: gathered(weights)}
    for name, run in runs.items():
        assert all(torch.equal(a, b) for a, b in zip(run(), weights))
        best = min(_timed(run) for _ in range(3))
        kept = 0 if run is runs["runs (ExpertPartition)"] else (order.numel() + inverse.numel()) * 8
        print(f"{name:24} build {built[name]:6.2f} s   index kept {kept / 2**20:7.1f} MiB   "
              f"flatten+unflatten of {n} experts {best * 1e3:7.1f} ms")


def _timed(run) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


if __name__ == "__main__":
    main()
