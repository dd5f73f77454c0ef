"""explain(): compile a model with the moe passes and report what was found, proved, rewritten and skipped."""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import inspect
import warnings

import torch

from moecompile.passes import aliases, forms
from moecompile.passes.report import FailureRecord, LayerRecord, PassReport, SkipRecord

from . import recompiles
from .backend import capture_failed, compile_graph, run_uncompiled
from .tracing import break_sites, capture, ddp, frames
from .config import MoEOptions, parse_options
from .pipeline import MoEFallbackWarning


@dataclasses.dataclass
class ExplainReport:
    """``layers``: one record per proved MoE layer (module path, MoESpec, proof error, the form it runs in: its
    ``lowering``, "original" for one measured fastest as the model wrote it, and the timings of every form);
    ``skipped``: (region, reason) for every MoE-looking region left as it was; ``graphs``: (stage, code) for
    the graph before and after each pass; ``counters``: per-pass counts; ``num_graphs``: graphs Dynamo made;
    ``config_mismatches``: where the detected experts or top-k disagree with ``model.config`` (alias table);
    ``failures``: (stage, region, error) for every pass, inner compile or first run that raised: that graph ran as
    it came in; ``loops``: the forwards whose loop over ``nonzero()`` rows Dynamo traced as a loop over every expert,
    or whose loop over the experts it traced without the skip of experts that received no tokens
    (moecompile/tracing/loops.py); ``lost_to_recompiles``: frames that hit Dynamo's recompile limit under a moe
    backend since the last explain() (which resets Dynamo), so ran eagerly, unrewritten (moecompile/recompiles.py);
    ``retraced``: where Dynamo's trace failed with data-dependent shapes captured -> its error: that frame was
    traced again with Dynamo's defaults (moecompile/tracing/capture.py); ``graph_breaks``: Dynamo's graph breaks
    (its reason, first lines -> how many) other than those the capture settings would avoid (``skipped`` says
    those): a block a graph break cuts is in no one graph, so it cannot be found; ``graph_break_sites``: for a reason
    of ``graph_breaks``, where its breaks happened (``path:line`` of the innermost frame of the user's stack, read
    from Dynamo's graph-break log: moecompile/tracing/break_sites.py), where the log said."""

    layers: list[LayerRecord]
    skipped: list[SkipRecord]
    graphs: list[tuple[str, str]]
    counters: dict
    num_graphs: int
    config_mismatches: list[str] = dataclasses.field(default_factory=list)  # detected spec vs model.config
    failures: list[FailureRecord] = dataclasses.field(default_factory=list)
    loops: dict[str, str] = dataclasses.field(default_factory=dict)  # forward whose nonzero() loop was rewritten
    parallel: str = ""  # a parallelized model: its sharding, each layer's dedup and why, and what it has sent
    lost_to_recompiles: dict[str, str] = dataclasses.field(default_factory=dict)  # frame -> the limit it hit
    retraced: dict[str, str] = dataclasses.field(default_factory=dict)  # frame -> its capture-on trace's error
    graph_breaks: dict[str, int] = dataclasses.field(default_factory=dict)  # Dynamo's reason -> how many
    graph_break_sites: dict[str, list[str]] = dataclasses.field(default_factory=dict)  # reason -> path:line, ...

    def __str__(self) -> str:
        kept = sum(rec.lowering == "original" for rec in self.layers)  # proved, and measured faster as written
        out = [f"moecompile: {len(self.layers) - kept} MoE layer(s) rewritten, "
               + (f"{kept} proved and left as written (the fastest form), " if kept else "")
               + f"{len(self.skipped)} skipped, "
               f"{self.num_graphs} graph(s)" + (f", {len(self.failures)} failure(s)" if self.failures else "")]
        out += [f"  warning: {m}" for m in self.config_mismatches]
        for where, why in self.lost_to_recompiles.items():
            out.append(f"  warning: since the last explain(), {where} hit {why}: it ran eagerly from then on, its MoE "
                       "layers not rewritten (compile with dynamic=True for changing sizes)")
        for where, error in self.retraced.items():
            out.append(f"  {where}: traced again with Dynamo's defaults: {error} (raised with data-dependent "
                       "shapes captured; strict=True raises instead)")
        for why, n in self.graph_breaks.items():
            out.append(_graph_break_line(why, n, self.graph_break_sites.get(why, [])))
        if not self.num_graphs:
            out.append("  Dynamo made no graph: the model ran as written (a graph break inside a loop, say, makes "
                       "Dynamo run the whole function eagerly)")
        for f in self.failures:
            out.append(f"  failed: {f.what} raised on {f.region}: {f.error}; that graph runs as it came in "
                       "(strict=True raises)")
        for rec in self.layers:
            verb = "proved, left as written:" if rec.lowering == "original" else "rewritten"
            out.append(f"  {verb} {rec.path} ({rec.spec.block_type}) lowering={rec.lowering} "
                       f"proof error={rec.max_error:.2g} after {rec.candidates_tried} candidate(s)"
                       + (f" (proved as {rec.proved_as}: the same code and shapes)" if rec.proved_as else ""))
            out.append(f"      {rec.spec.summary()}")
            out += [f"      lowering: {note}" for note in rec.lowering_notes]
            out += [f"      form {form}: {t.describe()}{'  <- runs' if form == rec.lowering else ''}"
                    for form, t in rec.forms.items()]
            if rec.lowering_error is not None:
                out.append(f"      kernels checked against the references on probes: error {rec.lowering_error:.2g}")
            if rec.kernel_tiles:
                out.append(f"      kernel tiles: {rec.kernel_tiles}")
            if rec.checkpointed:
                out.append(f"      {rec.checkpointed}")
        for name, where in self.loops.items():
            out.append(f"  traced {name}'s expert loop as one over every expert, without data-dependent control "
                       f"flow ({where})")
        for s in self.skipped:
            out.append(f"  skipped {s.region}: {s.reason}")
        if self.counters:
            out.append("  counters: " + ", ".join(f"{k}={v}" for k, v in sorted(self.counters.items())))
        if self.parallel:
            out.append(self.parallel)
        return "\n".join(out)

    def graph(self, stage: str, index: int = 0) -> str:
        """Readable code of the ``index``-th graph after ``stage`` ("input", "detect", ..., "lower")."""
        codes = [code for s, code in self.graphs if s == stage]
        if not codes:
            raise ValueError(f"no graph recorded for stage {stage!r}; stages: {sorted({s for s, _ in self.graphs})}")
        return codes[index]


def explain(model: torch.nn.Module, *args, **keywords) -> ExplainReport:
    """Run ``model(*args, **model_keywords)`` once through the moe passes (graphs run eagerly afterwards) and report.
    The model runs in the caller's grad mode, as the caller would compile it (no backward runs): with it on, the
    forms are chosen (``lowering="auto"``) as for training, and a layer the model runs under ``torch.no_grad()`` is
    seen as such.

    A model ``moecompile.parallelize`` sharded exchanges rows as it runs: call it on every rank together.
    A keyword argument named as a backend option (see ``moecompile.MoEOptions``) is that option; any other goes to
    the model (``labels=ids``, ``attention_mask=mask``), unless its forward takes no such argument or the name is
    close to an option's (a typo: ``ValueError``). The model itself is not changed (a model compiled
    in place by ``model.compile()`` is traced as written, its compiled call put back after), but Dynamo's caches are
    reset before and after (so the model is captured afresh; other compiled code recompiles).
    """
    options, model_keywords = _split_keywords(model, keywords)
    return explain_calls(model, [(model, args, model_keywords)], **options)


def _split_keywords(model: torch.nn.Module, keywords: dict) -> tuple[dict, dict]:
    """explain()'s keyword arguments: (backend options, the model's keyword arguments)."""
    names = [f.name for f in dataclasses.fields(MoEOptions)]
    forward = getattr(getattr(model, "_orig_mod", model), "forward", model)
    try:
        params = inspect.signature(forward).parameters
    except (TypeError, ValueError):  # a builtin without a signature: take every keyword as the model's
        params = {"kwargs": inspect.Parameter("kwargs", inspect.Parameter.VAR_KEYWORD)}
    named = {n for n, p in params.items() if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
    open_ended = any(p.kind == p.VAR_KEYWORD for p in params.values())
    options, model_keywords = {}, {}
    for key, value in keywords.items():
        near = difflib.get_close_matches(key, names, n=1, cutoff=0.8)
        if key in names:
            options[key] = value
        elif key in named or (open_ended and not near):
            model_keywords[key] = value
        else:
            what = f"a keyword argument of {type(model).__name__}.forward ({sorted(named)})"
            hint = f"; did you mean the option {near[0]!r}?" if near else ""
            raise ValueError(f"explain() got {key}={value!r}: neither a moecompile option ({names}) nor {what}{hint}")
    return options, model_keywords


def explain_calls(model: torch.nn.Module, calls, **options) -> ExplainReport:
    """``explain`` of each ``(module, args, kwargs)`` of ``calls`` in turn, modules of ``model`` (the model itself
    or one of its submodules, traced alone), the layers named by their path in ``model``; one report of them all.
    Dynamo's caches are reset before each call and after the last."""
    config = dataclasses.replace(parse_options(options), record_graphs=True)
    report = PassReport()
    graphs = []

    def backend(gm, example_inputs, **_):
        graphs.append(gm)
        return compile_graph(gm, example_inputs, config, report, inner=run_uncompiled)

    setattr(backend, capture.MARK, config.capture)  # Dynamo captures data-dependent shapes for it (tracing/capture.py)
    setattr(backend, capture.RETRACE, lambda options, where, error: capture_failed(config, where, error))
    setattr(backend, ddp.WHOLE, lambda gm, example_inputs, kwargs, split: backend(gm, example_inputs))  # (uncut)
    lost = dict(recompiles.lost)  # what the program lost so far; the reset below gives those frames a fresh start
    recompiles.lost.clear()
    breaks_before, other_before = _data_dependent_breaks(), _other_breaks()
    capture.retraced.clear()
    training = forms.TRAINING.set(torch.is_grad_enabled())  # the forms chosen as the caller would run the model
    alone = any(module is not model for module, _, _ in calls)  # a submodule's layers named by their path in model
    running = frames.RUNNING_MODEL.set(model if alone else None)  # (else found on the call stack, as by compile)
    messages: list[str] = []  # Dynamo's graph-break log: where each break happened
    try:
        for module, args, kwargs in calls:
            torch._dynamo.reset()
            capture.install()  # reset() dropped Dynamo's compile callbacks, the capture scope's among them
            with warnings.catch_warnings(), break_sites.recording(messages):  # the caller's grad mode, as compiled
                warnings.simplefilter("ignore", MoEFallbackWarning)  # the report says it
                with _as_written(module):
                    torch.compile(module, backend=backend)(*args, **kwargs)
    finally:
        forms.TRAINING.reset(training)
        frames.RUNNING_MODEL.reset(running)
    torch._dynamo.reset()
    capture.install()
    breaks = _data_dependent_breaks() - breaks_before
    other = {why: n - other_before.get(why, 0) for why, n in _other_breaks().items() if n > other_before.get(why, 0)}
    sites = break_sites.sites_by_reason(messages, {why: _REASON_LINES[why] for why in other})
    retraced = dict(capture.retraced)
    if breaks:
        report.skipped.append(SkipRecord("<graph breaks>", DATA_DEPENDENT_BREAKS.format(n=breaks)))
    mismatches = _check_against_config(getattr(model, "config", None), report.layers)
    parallel = ""
    if getattr(model, "_moe_parallel", None) is not None:
        from .distributed.comm import comm_report

        parallel = f"{model._moe_parallel}\n{comm_report(model)}"
        if model._moe_parallel.replicas:
            from .distributed.expert_optimizer import replication_report

            parallel += f"\n{replication_report(model)}"
    return ExplainReport(report.layers, report.skipped, report.graphs, dict(report.counters), len(graphs), mismatches,
                         report.failures, dict(report.loops), parallel, lost, retraced, other, sites)


@contextlib.contextmanager
def _as_written(module: torch.nn.Module):
    """``module`` and its submodules without the compiled call ``.compile()`` gave them, put back after: Dynamo runs
    that call rather than trace the module again where it does not inline it (the model itself; a decoder layer
    behind FSDP2's hooks, which break the graph around it), so explain() saw no graph or missed the layer."""
    compiled = {m: m._compiled_call_impl for m in module.modules() if getattr(m, "_compiled_call_impl", None)}
    for m in compiled:
        m._compiled_call_impl = None
    try:
        yield
    finally:
        for m, call in compiled.items():
            m._compiled_call_impl = call


DATA_DEPENDENT_BREAKS = (
    "Dynamo reported {n} graph break(s) at data-dependent shapes (nonzero(), where(mask), .item(), .tolist()): "
    "an MoE block whose experts loop over such results is cut into pieces the backend cannot recognise. Fix: leave "
    "the option capture at True, its default (see docs/detection.md, 'Expert loops')"
)


def _data_dependent_breaks() -> int:
    """Graph breaks so far that Dynamo's capture settings (option capture, moecompile.capture()) would have avoided."""
    from torch._dynamo.utils import counters

    return sum(n for why, n in counters["unimplemented"].items() if _capture_avoids(why))


def _capture_avoids(why: str) -> bool:
    """Whether Dynamo's reason for a graph break names a setting of the capture scope (``tracing/capture.py``)."""
    return "capture_dynamic_output_shape_ops" in why or "capture_scalar_outputs" in why


def _other_breaks() -> dict[str, int]:
    """Dynamo's graph breaks so far, by reason (its first line and explanation), those the capture settings would
    have avoided left out (``_data_dependent_breaks``). A break is counted under ``graph_break`` where Dynamo went
    on after it and under ``unimplemented`` where it traced the frame again or ran it eagerly, under both in
    some cases: the larger count per reason."""
    from torch._dynamo.utils import counters

    out: dict[str, int] = {}
    reasons = {why: max(counters["graph_break"].get(why, 0), counters["unimplemented"].get(why, 0))
               for why in {*counters["graph_break"], *counters["unimplemented"]}}
    for why, n in sorted(reasons.items()):
        if _capture_avoids(why):
            continue
        lines = [line.strip() for line in str(why).splitlines() if line.strip()]
        said = [lines[0]] + [line for line in lines[1:2] if line.startswith("Explanation:")]
        short = ": ".join(line.removeprefix("Explanation: ").rstrip(".") for line in said)
        out[short] = out.get(short, 0) + n
        _REASON_LINES[short] = tuple(said)  # what its log message says too (break_sites)
    return out


_REASON_LINES: dict[str, tuple[str, ...]] = {}


def _graph_break_line(why: str, n: int, sites: list[str]) -> str:
    """explain()'s line for one graph-break reason, with where it happened when Dynamo's log said."""
    where = (" at " + ", ".join(sites[:3]) + (f" and {len(sites) - 3} more" if len(sites) > 3 else "")) if sites else ""
    if why.startswith(GENERATOR):  # (convert_frame refuses the generator's own frame, which runs as written)
        return (f"  graph break ({n}x): {why}. Dynamo met a generator function (a context manager's, say) called from "
                "code that runs as written, outside every graph, and ran it as written too: it cuts no graph itself")
    if break_sites.in_wrapper(sites):
        return (f"  graph break ({n}x){where}: {why}. In DistributedDataParallel's or FSDP2's code, at the edge of a "
                "module it wraps: it cuts an MoE block only where a module inside the block is wrapped")
    return (f"  graph break ({n}x){where}: {why}. An MoE block it cuts is in no one graph and is not found "
            f"(TORCH_LOGS=graph_breaks shows {'the stack' if sites else 'where it happened'})")


GENERATOR = "Attempt to trace generator"


def _check_against_config(config, layers: list[LayerRecord]) -> list[str]:
    """Detection reads the graph; where the model has a config, say where the two disagree."""
    if config is None:
        return []
    out = []
    for field, got in (("num_experts", lambda s: s.experts.num_experts), ("top_k", lambda s: s.routing.top_k)):
        want = aliases.config_value(config, field)
        if not isinstance(want, int):
            continue
        for rec in layers:
            if got(rec.spec) != want:
                names = "|".join(aliases.CONFIG_ALIASES[field])
                out.append(f"{rec.path}: detected {field}={got(rec.spec)} but config {names} says {want}")
    return out
