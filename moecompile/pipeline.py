"""The one ordered list of MoE graph passes, and the runner that applies it.

Each pass is ``<name>_pass(gm, example_inputs, *, config, report) -> gm``. After each pass the graph is linted
and recompiled. The invariants between passes are written down in passes/README.md.

No model stops the user's program: a pass that raises leaves the graph as it came in from Dynamo (restored from a
copy taken before the first pass), the report is rolled back to where it stood before that graph, and the failure
(pass, block, error) is recorded in ``report.failures``, counted (``pipeline.failed.<pass>``) and warned about.
With ``strict=True`` it raises ``MoECompileError`` instead, naming the pass and the passes that ran before it.
"""

from __future__ import annotations

import copy
import warnings
from collections import Counter
from dataclasses import dataclass

import torch.fx as fx

from moecompile.passes.canonicalize import canonicalize_moe_pass
from moecompile.passes.detect import detect_moe_pass
from moecompile.passes.distribute import distribute_moe_pass
from moecompile.passes.lower import LoweringUnavailable, lower_moe_pass
from moecompile.passes.report import FailureRecord, PassReport
from moecompile.passes.sharded import expose_sharded_pass, remove_standins
from moecompile.passes.verify import verify_moe_pass

from .tracing.capture import complete_missing_experts
from .config import MoEOptions

PASSES = (
    ("expose_sharded", expose_sharded_pass),
    ("detect", detect_moe_pass),
    ("verify", verify_moe_pass),
    ("canonicalize", canonicalize_moe_pass),
    ("distribute", distribute_moe_pass),
    ("lower", lower_moe_pass),
)


class MoECompileError(RuntimeError):
    """A pass failed, or (with strict=True) an MoE block was left unrewritten."""


class MoEFallbackWarning(UserWarning):
    """A pass failed on a graph, which runs as it came in (its MoE blocks not rewritten); explain() says which."""


def run_passes(gm: fx.GraphModule, example_inputs, config: MoEOptions, report: PassReport,
               checkpoint: Checkpoint | None = None) -> fx.GraphModule:
    checkpoint = checkpoint or Checkpoint.take(gm, report)
    if config.record_graphs:
        report.graphs.append(("input", gm.print_readable(print_output=False)))
    done: list[str] = []
    for name, fn in PASSES:
        if name in config.disable_passes:
            continue
        try:
            if name == "canonicalize" and "verify" in config.disable_passes:
                _drop_unproved(gm)
            gm = fn(gm, example_inputs, config=config, report=report)
            gm.graph.lint()
            gm.recompile()
        except LoweringUnavailable:  # the user's setting, not the model's doing: raised, never a fallback
            raise
        except Exception as exc:
            if config.strict:
                raise MoECompileError(f"moecompile pass {name!r} failed (after {done or 'no passes'}): {exc}") from exc
            return checkpoint.restore(report, name, exc, config)
        done.append(name)
        if config.record_graphs:
            report.graphs.append((name, gm.print_readable(print_output=False)))
    complete_missing_experts(report)
    if config.strict and report.skipped:
        lines = "\n".join(f"  {s.region}: {s.reason}" for s in report.skipped)
        raise MoECompileError(f"strict=True and some MoE blocks were not rewritten:\n{lines}")
    return gm


@dataclass
class Checkpoint:
    """A graph as it came in from Dynamo, and where the report stood before its passes ran."""

    gm: fx.GraphModule
    graph: fx.Graph  # a copy: the passes edit ``gm.graph`` in place (node meta is copied shallowly)
    index: int  # which graph of the report this is (0 for the first)
    layers: int
    skipped: int
    counters: Counter

    @classmethod
    def take(cls, gm: fx.GraphModule, report: PassReport) -> Checkpoint:
        report.graphs_seen += 1
        graph = copy.deepcopy(gm.graph)
        for old, new in zip(gm.graph.nodes, graph.nodes):  # what Dynamo sets on nodes (placeholders' sources)
            new.__dict__.update(old.__dict__)
        return cls(gm, graph, report.graphs_seen - 1, len(report.layers), len(report.skipped), Counter(report.counters))

    def rewrote(self, report: PassReport) -> bool:
        """Whether the passes changed the graph (only proved layers are rewritten)."""
        return len(report.layers) > self.layers

    def restore(self, report: PassReport, stage: str, exc: Exception, config: MoEOptions) -> fx.GraphModule:
        """Put the graph back as it came in and make the report say so: the failure, and each layer this graph
        had proved turned into a skip (nothing of this graph is rewritten); this graph's pass counters are void."""
        proved = report.layers[self.layers:]
        del report.layers[self.layers:]
        new_skips = len(report.skipped) - self.skipped
        region = getattr(exc, "moe_region", None) or f"graph {self.index}" + (
            f" (MoE blocks {', '.join(r.path for r in proved)})" if proved else "")
        failure = FailureRecord(stage, region, _short(f"{type(exc).__name__}: {exc}"))
        report.counters.clear()
        report.counters.update(self.counters)
        if new_skips:  # this graph's skips stand: those blocks are as they came in
            report.counters["skipped"] += new_skips
        for rec in proved:
            report.skip(rec.path, f"proved, but not rewritten: {failure.what} failed on its graph "
                                  f"({failure.error}); left as it was")
        report.failures.append(failure)
        report.counters[f"pipeline.failed.{stage}"] += 1
        remove_standins(self.gm.graph)  # Dynamo reads the placeholders of the graph object it made
        self.gm.graph = self.graph
        self.gm.recompile()
        if config.record_graphs:
            report.graphs.append(("fallback", self.gm.print_readable(print_output=False)))
        warnings.warn(f"moecompile: {failure.what} failed on {region} ({failure.error}); that graph runs as it "
                      "came in, its MoE blocks not rewritten. moecompile.explain() reports it; "
                      "options={'strict': True} raises instead.", MoEFallbackWarning, stacklevel=2)
        return self.gm


def _short(text: str, n: int = 300) -> str:
    text = " ".join(text.split())
    return text if len(text) <= n else text[: n - 1] + "…"


def _drop_unproved(gm: fx.GraphModule) -> None:
    """Nothing unproved is rewritten: without verify, canonicalize has nothing to do."""
    for n in gm.graph.nodes:
        n.meta.pop("moe", None)
