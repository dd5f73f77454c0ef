"""Command line: ``python -m moecompile demo``, ``python -m moecompile inspect <family | config.json>`` and
``torchrun --nproc-per-node N -m moecompile calibrate --mesh NODESxLOCAL --out links.json``."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
import time

import torch

from .config import LOWERINGS

log = logging.getLogger("moecompile.cli")  # __name__ is "__main__" under python -m


@contextlib.contextmanager
def progress(stream=None):
    """The compile's progress on ``stream`` (stderr) while it runs: the INFO lines of the logger "moecompile", a
    line per pass and graph and one per layer proved (moecompile/pipeline.py, passes/verify.py)."""
    logger = logging.getLogger("moecompile")
    handler, level = logging.StreamHandler(stream or sys.stderr), logger.level
    handler.setFormatter(logging.Formatter("moecompile: %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def families() -> list[str]:
    """The families ``inspect`` and ``demo`` take by name: every MoE family of the installed transformers (the
    README's family table), each built as the family walk builds it (``models.hf.walk_config``)."""
    import transformers

    from moecompile.models import hf

    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # other families' default configs warn of their token ids
    try:
        return sorted(set(hf.FAMILIES) | set(hf.moe_families_in_transformers()))
    finally:
        transformers.logging.set_verbosity(verbosity)


def _model_for(target: str, dtype: torch.dtype, full_size: bool = False):
    from moecompile.models import handwritten, hf

    if os.path.exists(target):
        config = hf.load_config(target)
        if not full_size:
            small = hf.shrink_config(config.model_type, base=config)
            if small is None:
                raise SystemExit(f"could not shrink {target}; pass --full-size to build it as it is")
            print(f"{target}: sizes shrunk to a tiny random model, routing and dense layers kept "
                  "(--full-size builds it as is)")
            config = small
        return hf.build_model(config, dtype=dtype)
    if target in handwritten.HANDWRITTEN:
        return handwritten.TinyMoELM(target).to(dtype).eval()
    known = families()
    if target not in known:
        raise SystemExit(f"unknown model {target!r}: give a path to a config.json, a family ({', '.join(known)}) "
                         f"or a hand-written kind ({', '.join(handwritten.HANDWRITTEN)})")
    config = hf.walk_config(target)
    if config is None:
        raise SystemExit(f"{target}: transformers' default config of it could not be shrunk to a tiny model here; "
                         "give the path to a config.json of it")
    return hf.build_model(config, dtype=dtype)


LOWERING_HELP = ("the form of each proved layer: 'auto' (default, or $MOECOMPILE_LOWERING) times every form and "
                 "keeps the fastest; 'original', 'torch', 'grouped' or 'triton' forces one ('triton' on CPU needs "
                 "TRITON_INTERPRET=1 in the environment)")


def _lowering(args) -> dict:
    """The lowering option if given on the command line (else the option's default)."""
    return {} if args.lowering is None else {"lowering": args.lowering}


def inspect(args) -> int:
    import moecompile

    dtype = getattr(torch, args.dtype)
    model = _model_for(args.model, dtype, args.full_size)
    log.info("%s built; Dynamo traces it, then the passes run (the first compile of a process takes longest)",
             args.model)
    ids = torch.randint(0, min(64, model.config.vocab_size if hasattr(model, "config") else 64), (args.batch, args.seq))
    report = moecompile.explain(model, ids, inner=args.inner, capture=not args.no_capture, **_lowering(args))
    print(report)
    if args.graphs:
        for stage, code in report.graphs:
            print(f"\n===== graph after {stage} =====\n{code}")
    return 0


def demo(args) -> int:
    """Train a tiny MoE model (Mixtral's by default) for a few steps with backend="moe" and with eager, side by
    side."""
    import moecompile

    torch.manual_seed(0)
    ids = torch.randint(0, 128, (2, 16))  # every tiny model's vocabulary is 128
    eager, compiled_src = _model_for(args.family, torch.float32), _model_for(args.family, torch.float32)
    compiled_src.load_state_dict(eager.state_dict())
    with torch.enable_grad():  # the forms chosen for training, as the steps below run
        print(moecompile.explain(compiled_src, ids, **_lowering(args)))
    compiled = torch.compile(compiled_src, backend="moe", options={"inner": args.inner, **_lowering(args)})
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (eager, compiled_src)]
    print(f"\ntraining {args.steps} steps of {args.family} (inner compiler: {args.inner})")
    for step in range(args.steps):
        losses = []
        for fwd, opt in zip((eager, compiled), opts):
            t0 = time.perf_counter()
            loss = fwd(ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append((loss.item(), time.perf_counter() - t0))
        (le, te), (lc, tc) = losses
        print(f"  step {step}: loss eager {le:.6f}  moe {lc:.6f}  |diff| {abs(le - lc):.2e}   "
              f"time eager {te * 1e3:.0f} ms  moe {tc * 1e3:.0f} ms")
    worst = max((a - b).abs().max().item() for a, b in zip(eager.parameters(), compiled_src.parameters()))
    print(f"largest parameter difference after training: {worst:.2e}")
    return 0 if worst < 1e-4 else 1


def _calibrate(args) -> int:
    from .distributed.calibrate import main as calibrate_main

    return calibrate_main(args)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m moecompile")
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("inspect", help="explain what the moe backend does to a model")
    p.add_argument("model", help="a family name (e.g. mixtral), a hand-written kind, or a path to a config.json")
    p.add_argument("--graphs", action="store_true", help="print the graph before and after each pass")
    p.add_argument("--full-size", action="store_true", help="build a config.json at its real size (random weights)")
    p.add_argument("--inner", default="aot_eager", choices=("inductor", "aot_eager"))
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--lowering", default=None, choices=LOWERINGS, help=LOWERING_HELP)
    p.add_argument("--no-capture", action="store_true",
                   help="trace with Dynamo's defaults (option capture=False): expert loops over nonzero()/where() "
                        "then break the graph and are reported, not rewritten")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=8)
    p.set_defaults(fn=inspect)
    d = sub.add_parser("demo", help="train a tiny MoE model with backend='moe' next to eager")
    d.add_argument("--family", default="mixtral", help="a family or hand-written kind, as inspect takes")
    d.add_argument("--steps", type=int, default=3)
    d.add_argument("--inner", default="inductor", choices=("inductor", "aot_eager"))
    d.add_argument("--lowering", default=None, choices=LOWERINGS, help=LOWERING_HELP)
    d.set_defaults(fn=demo)
    c = sub.add_parser("calibrate", help="under torchrun: time all-to-alls at each mesh level, fit alpha and beta, "
                                         "save the link model (JSON) that parallelize(dedup='auto') reads")
    c.add_argument("--mesh", required=True, help="NODESxLOCAL (e.g. 2x2; 2x2x2 for racks x nodes x local) or N for a "
                                                 "1-D mesh; the sizes multiply to torchrun's world size")
    c.add_argument("--names", default="", help="the mesh's level names, outermost first, comma-separated (default: "
                                               "node,local for 2x2, rack,node,local for 2x2x2)")
    c.add_argument("--out", default="links.json")
    c.add_argument("--sizes", default="", help="comma-separated bytes each rank sends each other rank")
    c.add_argument("--repeats", type=int, default=5, help="timings per size (the median is fitted)")
    c.add_argument("--emulate", default="", help="a link model JSON the runtime's link emulation waits by "
                                                 "(loopback machines: to check the fit recovers it)")
    c.add_argument("--cpu", action="store_true", help="gloo on CPU even where CUDA is available")
    c.add_argument("--timeout", type=float, default=300,
                   help="seconds a collective may wait before the ranks raise (a dead rank never hangs the others)")
    c.set_defaults(fn=_calibrate)
    from .plan.cli import add_parser as add_plan

    add_plan(sub)
    args = parser.parse_args(argv)
    with progress() if args.cmd in ("inspect", "demo") else contextlib.nullcontext():
        return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
