"""The one ordered list of MoE graph passes, and the runner that applies it.

Each pass is ``<name>_pass(gm, example_inputs, *, config, report) -> gm``. After each pass the graph is linted
and recompiled. The invariants between passes are written down in passes/README.md.

No model stops the user's program: a pass that raises leaves the graph as it came in from Dynamo (restored from a
copy taken before the first pass), the report is rolled back to where it stood before that graph, and the failure
(pass, block, error) is recorded in ``report.failures``, counted (``pipeline.failed.<pass>``) and warned about.
With ``strict=True`` it raises ``MoECompileError`` instead, naming the pass and the passes that ran before it; so
it does for a whole graph with no MoE layer at all (``_no_moe_found``).

An activation-checkpointed region (``torch.utils.checkpoint``) reaches the backend as a ``tag_activation_checkpoint``
call of a body graph: after the graph's own passes, the passes run on each body as on a graph of their own
(``checkpointed_regions``), so the MoE layers inside are rewritten there and AOT autograd still recomputes the
region in backward. A body whose pass fails is restored alone; the graph's copy holds its bodies' too, for a
failure of the whole graph (the inner compiler, the first run).

Progress, pass by pass and layer by layer, goes to the ``logging`` logger "moecompile" at INFO: the CLI shows it on
stderr; a library user sees nothing unless they turn that logger on.
"""

from __future__ import annotations

import copy
import logging
import sys
import time
import warnings
from collections import Counter
from dataclasses import dataclass

import torch
import torch._dynamo.utils as dynamo_utils
import torch.fx as fx

from moecompile.passes.canonicalize import canonicalize_moe_pass
from moecompile.passes.detect import detect_moe_pass
from moecompile.passes.graph_utils import hint, placeholder_values
from moecompile.passes.distribute import distribute_moe_pass
from moecompile.passes.kept import looked_up
from moecompile.passes.lower import LoweringUnavailable, lower_moe_pass
from moecompile.passes.recompute import forget as forget_exchanges
from moecompile.passes.recompute import region_exchanges
from moecompile.passes.report import FailureRecord, PassReport
from moecompile.passes.routing import selections_in
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
log = logging.getLogger(__name__)  # "moecompile.pipeline": INFO lines of progress (the CLI shows them)


class MoECompileError(RuntimeError):
    """A pass failed, or (with strict=True) an MoE block was left unrewritten or a whole graph had none."""


class MoEFallbackWarning(UserWarning):
    """A pass failed on a graph, which runs as it came in (its MoE blocks not rewritten); explain() says which."""


def run_passes(gm: fx.GraphModule, example_inputs, config: MoEOptions, report: PassReport,
               checkpoint: Checkpoint | None = None) -> fx.GraphModule:
    checkpoint = checkpoint or Checkpoint.take(gm, report)
    gm, ok = _apply(gm, example_inputs, config, report, checkpoint)
    if not ok:
        return gm
    _rewrite_regions(gm, example_inputs, config, report, checkpoint.index)
    complete_missing_experts(report)
    if config.strict and report.skipped:
        lines = "\n".join(f"  {s.region}: {s.reason}" for s in report.skipped)
        raise MoECompileError(f"strict=True and some MoE blocks were not rewritten:\n{lines}")
    if config.strict and _no_moe_found(gm, config, report, checkpoint):
        raise MoECompileError(
            f"strict=True and no MoE layer found in the graph ({_which(gm, checkpoint)}): no router selects experts "
            "in it (no top-k, argmax or sort over a router's scores, nothing detect could take for an MoE block). "
            "Check that the model is an MoE model whose MoE layers run in this forward, or drop strict=True to "
            "compile it as it is.")
    return gm


def checkpointed_regions(gm: fx.GraphModule, example_inputs) -> list[tuple[str, list]]:
    """(attribute, example inputs) of each activation-checkpointed region of ``gm``: Dynamo traces
    ``torch.utils.checkpoint.checkpoint(fn, ...)`` (transformers' gradient checkpointing) into a
    ``tag_activation_checkpoint`` call of a body graph, a submodule of ``gm``, that AOT autograd recomputes in
    backward. The passes run on each body as on a graph of its own, its signature kept: the inputs are the
    outer graph's values where they are its inputs (the parameters, real), else random tensors of the traced
    shapes (activations: the passes read only their shapes, and probe the tokens with their own)."""
    values = placeholder_values(gm, example_inputs)
    return [(name, [values[a] if isinstance(a, fx.Node) and a in values else _stand_in(a) for a in hop.args[1:]])
            for name, hop in _bodies(gm)]


def _rewrite_regions(gm: fx.GraphModule, example_inputs, config: MoEOptions, report: PassReport, index: int) -> None:
    """The passes on the body of each activation-checkpointed region of ``gm`` (graph ``index``), their MoE layers
    rewritten inside them, and so on into regions nested in a body."""
    for name, inputs in checkpointed_regions(gm, example_inputs):
        body = getattr(gm, name)
        body, ok = _apply(body, inputs, config, report, Checkpoint.take(body, report, index, name))
        if ok:
            region_exchanges(body, config, report)
            _rewrite_regions(body, inputs, config, report, index)


def _bodies(gm: fx.GraphModule) -> list[tuple[str, fx.Node]]:
    """(attribute of the body, the call) for each ``tag_activation_checkpoint`` call in ``gm``."""
    calls = gm.graph.find_nodes(op="call_function", target=torch.ops.higher_order.tag_activation_checkpoint)
    return [(hop.args[0].target, hop) for hop in calls if hop.args[0].op == "get_attr"
            and isinstance(getattr(gm, hop.args[0].target, None), fx.GraphModule)]


def _stand_in(a):
    """A real value shaped as the traced value of ``a`` (a node of the outer graph), or ``a`` when it is none."""
    v = a.meta.get("example_value") if isinstance(a, fx.Node) else a
    if isinstance(v, torch.Tensor):
        shape = [hint(s) for s in v.shape]
        if v.is_floating_point():
            return torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(v.dtype).to(v.device)
        return torch.zeros(shape, dtype=v.dtype, device=v.device)
    return hint(v) if isinstance(v, torch.SymInt) else v


def _apply(gm: fx.GraphModule, example_inputs, config: MoEOptions, report: PassReport,
           checkpoint: Checkpoint) -> tuple[fx.GraphModule, bool]:
    """The passes in order on one graph: (the graph, True), or (the graph as it came in, False) after a failure."""
    if config.record_graphs:
        report.graphs.append(("input", gm.print_readable(print_output=False)))
    done: list[str] = []
    for name, fn in PASSES:
        if name in config.disable_passes:
            continue
        before, start = Counter(report.counters), time.perf_counter()
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
            return checkpoint.restore(report, name, exc, config), False
        done.append(name)
        log.info("graph %d: %s: %s (%.1f s)", checkpoint.index, name, _counted(name, before, report.counters),
                 time.perf_counter() - start)
        if config.record_graphs:
            report.graphs.append((name, gm.print_readable(print_output=False)))
    return gm, True


@dataclass
class Checkpoint:
    """A graph as it came in from Dynamo, and where the report stood before its passes ran."""

    gm: fx.GraphModule
    graph: fx.Graph  # a copy: the passes edit ``gm.graph`` in place (node meta is copied shallowly)
    index: int  # which graph of the report this is (0 for the first)
    layers: int
    skipped: int
    counters: Counter
    bodies: dict[str, fx.Graph]  # copies of the graphs of its activation-checkpointed regions (submodules)
    region: str = ""  # the body's attribute, for an activation-checkpointed region's body

    @classmethod
    def take(cls, gm: fx.GraphModule, report: PassReport, index: int | None = None, region: str = "") -> Checkpoint:
        """``index``, ``region``: the body ``region`` of a checkpointed region of graph ``index`` (no graph of its
        own)."""
        if index is None:
            report.graphs_seen += 1
        bodies = {name: _copy(getattr(gm, name).graph) for name, _ in _bodies(gm)}
        return cls(gm, _copy(gm.graph), report.graphs_seen - 1 if index is None else index, len(report.layers),
                   len(report.skipped), Counter(report.counters), bodies, region)

    def rewrote(self, report: PassReport) -> bool:
        """Whether the passes changed the graph (only proved layers are rewritten)."""
        return len(report.layers) > self.layers

    def restore(self, report: PassReport, stage: str, exc: Exception, config: MoEOptions) -> fx.GraphModule:
        """Put the graph back as it came in and make the report say so: the failure, and each layer this graph
        had proved turned into a skip (nothing of this graph is rewritten); this graph's pass counters are void."""
        proved = report.layers[self.layers:]
        del report.layers[self.layers:]
        new_skips = len(report.skipped) - self.skipped
        where = f"graph {self.index}" + (f", its checkpointed region {self.region}" if self.region else "")
        region = getattr(exc, "moe_region", None) or where + (
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
        for name, graph in self.bodies.items():
            getattr(self.gm, name).graph = graph
            getattr(self.gm, name).recompile()
        forget_exchanges(self.gm)  # no exchange is left to keep
        if config.record_graphs:
            report.graphs.append(("fallback", self.gm.print_readable(print_output=False)))
        warnings.warn(f"moecompile: {failure.what} failed on {region} ({failure.error}); that "
                      f"{'region' if self.region else 'graph'} runs as it came in, its MoE blocks not rewritten. "
                      "moecompile.explain() reports it; options={'strict': True} raises instead.",
                      MoEFallbackWarning, stacklevel=2)
        return self.gm


def _copy(graph: fx.Graph) -> fx.Graph:
    out = copy.deepcopy(graph)
    for old, new in zip(graph.nodes, out.nodes):  # what Dynamo sets on nodes (placeholders' sources)
        new.__dict__.update(old.__dict__)
    return out


def _short(text: str, n: int = 300) -> str:
    text = " ".join(text.split())
    return text if len(text) <= n else text[: n - 1] + "…"


def _counted(name: str, before: Counter, after: Counter) -> str:
    """What a pass counted on this graph: its own counters and the skips, as they grew."""
    grew = [(k, after[k] - before[k]) for k in sorted(after) if (k.startswith(name + ".") or k == "skipped")
            and after[k] != before[k]]
    return ", ".join(f"{k.removeprefix(name + '.')}={n}" for k, n in grew) or "nothing to do"


def _no_moe_found(gm: fx.GraphModule, config: MoEOptions, report: PassReport, checkpoint: Checkpoint) -> bool:
    """Whether detect found nothing MoE-like in a graph of a whole frame: no block, no skip, no selection op (a
    top-k, argmax or sort that steers nothing was looked at and let go). A graph that a graph break cut, or one
    traced while a frame that a graph break cut is running (a callee, the rest after the break), may be the part of
    an MoE model around its MoE layers: never said to have none."""
    if "detect" in config.disable_passes or report.counters["detect.blocks"] > checkpoint.counters["detect.blocks"]:
        return False
    if len(report.skipped) > checkpoint.skipped or len(report.layers) > checkpoint.layers:
        return False
    reason = getattr(gm, "compile_subgraph_reason", None)  # set by Dynamo on the graphs it hands a backend
    if (reason is not None and reason.graph_break) or _inside_a_cut_frame():
        return False
    nodes = list(gm.graph.nodes)
    return not selections_in(nodes) and not any(looked_up(n) for n in nodes)


def _inside_a_cut_frame() -> bool:
    """Whether code that Dynamo compiled from a frame is running below this call: Dynamo cut that frame (a graph
    break) and now traces a frame it calls, or its rest after the break."""
    compiled = getattr(dynamo_utils, "orig_code_map", None)  # Dynamo's compiled code -> the code it was made from
    frame = sys._getframe()
    while frame is not None:
        if compiled is None or frame.f_code in compiled:
            return True
        frame = frame.f_back
    return False


def _which(gm: fx.GraphModule, checkpoint: Checkpoint) -> str:
    """The graph's index and the frame Dynamo traced it from: 'graph 0, of forward at modeling_llama.py:512'."""
    stack = getattr(getattr(gm, "compile_subgraph_reason", None), "user_stack", None)
    frame = f", of {stack[-1].name} at {stack[-1].filename.rsplit('/', 1)[-1]}:{stack[-1].lineno}" if stack else ""
    return f"graph {checkpoint.index}{frame}"


def _drop_unproved(gm: fx.GraphModule) -> None:
    """Nothing unproved is rewritten: without verify, canonicalize has nothing to do."""
    for n in gm.graph.nodes:
        n.meta.pop("moe", None)
