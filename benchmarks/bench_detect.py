"""How long parallelize's detection takes: explain() of the whole model against the MoE blocks traced alone
(moecompile/distributed/find_blocks.py), side by side, alternating, on tiny models (CPU, one thread).

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
    print(f"torch {torch.__version__}, {args.repeats} rounds, median seconds (each round: whole model, then blocks)")
    print("| family | layers | whole model (s) | blocks alone (s) | ratio | same layers |")
    print("|---|---|---|---|---|---|")
    for family in args.families.split(","):
        for layers in (int(n) for n in args.layers.split(",")):
            model = hf.tiny_model(family, num_hidden_layers=layers)
            ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
            whole_t, blocks_t, same = [], [], True
            for _ in range(args.repeats):
                out = {}
                whole_t.append(_timed(lambda: out.setdefault("whole", explain(model, ids))))
                blocks_t.append(_timed(lambda: out.setdefault("blocks", explain_blocks(model, (ids,)))))
                same &= [(r.path, str(r.spec)) for r in out["whole"].layers] == \
                        [(r.path, str(r.spec)) for r in out["blocks"].layers]
            w, b = statistics.median(whole_t), statistics.median(blocks_t)
            print(f"| {family} | {layers} | {w:.2f} | {b:.2f} | {w / b:.1f}x | {same} |")


if __name__ == "__main__":
    main()
