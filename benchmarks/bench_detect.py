"""How long parallelize's detection takes: explain() of the whole model against the MoE blocks traced alone
(moecompile/distributed/find_blocks.py), each block traced and a block of the code and shapes of one traced before
taking its report (twins.py), side by side, alternating, on tiny models (CPU, one thread).

    python benchmarks/bench_detect.py                      # mixtral, deepseek_v3, qwen3_moe at 2 and 8 layers
    python benchmarks/bench_detect.py --families mixtral --layers 2,16 --repeats 5
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from moecompile.distributed.find_blocks import explain_blocks
from moecompile.explain import explain
from moecompile.models import hf


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", default="mixtral,deepseek_v3,qwen3_moe")
    parser.add_argument("--layers", default="2,8", help="decoder layers of each tiny model")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, {args.repeats} rounds, median seconds (each round: whole model, each block, "
          "twins)")
    print("| family | layers | whole model (s) | each block traced (s) | twins untraced (s) | whole / each | "
          "whole / twins | same layers |")
    print("|---|---|---|---|---|---|---|---|")
    for family in args.families.split(","):
        for layers in (int(n) for n in args.layers.split(",")):
            model = hf.tiny_model(family, num_hidden_layers=layers)
            ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
            runs = {"whole": lambda: explain(model, ids), "each": lambda: explain_blocks(model, (ids,), twins=False),
                    "twins": lambda: explain_blocks(model, (ids,))}
            times, same = {name: [] for name in runs}, True
            for _ in range(args.repeats):
                out = {}
                for name, run in runs.items():
                    times[name].append(_timed(lambda: out.setdefault(name, run())))
                same &= all([(r.path, str(r.spec)) for r in out["whole"].layers] ==
                            [(r.path, str(r.spec)) for r in out[name].layers] for name in ("each", "twins"))
            w, e, t = (statistics.median(times[name]) for name in runs)
            print(f"| {family} | {layers} | {w:.2f} | {e:.2f} | {t:.2f} | {w / e:.1f}x | {w / t:.1f}x | {same} |")


if __name__ == "__main__":
    main()
