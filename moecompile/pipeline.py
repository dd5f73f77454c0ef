"""The one ordered list of MoE graph passes, and the runner that applies it.

Each pass is ``<name>_pass(gm, example_inputs, *, config, report) -> gm``. After each pass the graph is linted
and recompiled; a failure is re-raised naming the pass and the passes that ran before it. The invariants
between passes are written down in passes/README.md.
"""

from __future__ import annotations

import torch.fx as fx

from moecompile.passes.canonicalize import canonicalize_moe_pass
from moecompile.passes.detect import detect_moe_pass
from moecompile.passes.lower import lower_moe_pass
from moecompile.passes.report import PassReport
from moecompile.passes.verify import verify_moe_pass

from .config import MoEOptions

PASSES = (
    ("detect", detect_moe_pass),
    ("verify", verify_moe_pass),
    ("canonicalize", canonicalize_moe_pass),
    ("lower", lower_moe_pass),
)


class MoECompileError(RuntimeError):
    """A pass failed, or (with strict=True) an MoE block was left unrewritten."""


def run_passes(gm: fx.GraphModule, example_inputs, config: MoEOptions, report: PassReport) -> fx.GraphModule:
    if config.record_graphs:
        report.graphs.append(("input", gm.print_readable(print_output=False)))
    done: list[str] = []
    for name, fn in PASSES:
        if name in config.disable_passes:
            continue
        if name == "canonicalize" and "verify" in config.disable_passes:
            _drop_unproved(gm)
        try:
            gm = fn(gm, example_inputs, config=config, report=report)
            gm.graph.lint()
            gm.recompile()
        except Exception as exc:
            raise MoECompileError(f"moecompile pass {name!r} failed (after {done or 'no passes'}): {exc}") from exc
        done.append(name)
        if config.record_graphs:
            report.graphs.append((name, gm.print_readable(print_output=False)))
    if config.strict and report.skipped:
        lines = "\n".join(f"  {s.region}: {s.reason}" for s in report.skipped)
        raise MoECompileError(f"strict=True and some MoE blocks were not rewritten:\n{lines}")
    return gm


def _drop_unproved(gm: fx.GraphModule) -> None:
    """Nothing unproved is rewritten: without verify, canonicalize has nothing to do."""
    for n in gm.graph.nodes:
        n.meta.pop("moe", None)
