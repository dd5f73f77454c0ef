"""Walk every MoE family of the installed transformers: rewritten or skipped-with-reason, never a crash, never
a changed output. The README's support table is generated from this walk (the test fails if it drifts):

    MOECOMPILE_WRITE_README=1 python -m pytest -n 0 tests/test_walk_families.py     # regenerate the table
"""

import contextlib
import copy
import os
import re
import warnings
from pathlib import Path

import pytest
import torch
from conftest import RecordingBackend, normwise

from moecompile import pipeline
from moecompile.tracing.capture import install
from moecompile.backend import compile_graph, run_uncompiled
from moecompile.models import hf
from moecompile.passes.canonicalize import canonicalize_moe_pass
from moecompile.runtime import grouped_cpu, reference

README = Path(__file__).resolve().parent.parent / "README.md"
START, END = "<!-- family-table:start -->", "<!-- family-table:end -->"
FORWARD_ONLY = {"qwen3_next": "forward only: its linear-attention backward fails under aot_autograd in torch 2.13 "
                              "with or without moecompile (e.g. backend='aot_eager')"}
# Families whose own non-MoE parts amplify float32 rounding in some gradients past 1e-5, rewrite or not (the MoE
# rewrite sums in another order): their gradients are checked in float64 instead, where they must match to 1e-5
# just the same. Measured (float32, then float64): doge's attention A 2.0e-5 / 6e-16, hy_v4's hyper-connection
# head 3.4e-4 / 4e-16, deepseek_v4's 1.3e-5 (two threads) / exact.
GRADIENTS_IN_FLOAT64 = {
    "deepseek_v4": "its hyper-connection head amplifies float32 rounding",
    "doge": "its attention's dynamic mask (A) amplifies float32 rounding",
    "hy_v4": "its hyper-connection head amplifies float32 rounding",
}


def _short(text: str, n: int = 150) -> str:
    text = re.sub(r"0x[0-9a-f]+", "0x…", " ".join(str(text).split())).replace("|", "/")
    return text if len(text) <= n else text[: n - 1] + "…"


def _build(family: str):
    """The family's model from its walk config (``hf.walk_config``), or the exception that stopped building it
    (nothing of ours ran)."""
    try:
        return hf.build_model(hf.walk_config(family))
    except Exception as exc:
        return exc


def _model_kind(family: str) -> str:
    """Which config the walk built the family from, for the table's "model" column."""
    if family in hf.FAMILIES:
        return "tiny config (models/hf.py)"
    if family in hf.WRITTEN_CONFIGS:
        return "config written for the walk (models/hf.py)"
    return "shrunk default config"


def _ids(model) -> torch.Tensor:
    return torch.randint(0, min(64, model.config.vocab_size), (1, 6), generator=torch.Generator().manual_seed(0))


def _compile_checked(family: str, model, backward: bool | None):
    """Compile ``model`` with the moe backend as a user would (nothing else changed) and run it in ``train()`` mode
    with the family's own jitter and dropout as shipped (logits, and with ``backward`` every gradient; None: only
    that), then in ``eval()`` mode without gradients, as a user evaluates (logits), each checked against an eager
    copy drawing the same random numbers. Returns ({mode: (layers rewritten, skip records) by the graphs compiled in
    that mode, "grads": (the worst gradient's normwise difference, its parameter)}, the whole report). Dynamo
    compiles the frames again for eval() (its guards read the grad mode), and AOTAutograd makes inference graphs."""
    eager, ids = copy.deepcopy(model), _ids(model)
    backend = RecordingBackend(inner="aot_eager")
    torch._dynamo.reset()
    install()  # reset() dropped Dynamo's compile callbacks; a user's fresh process has them from the import
    compiled = torch.compile(model, backend=backend)
    reports = {"grads": (0.0, "")}
    for mode in ("train", "eval") if backward is not None else ("train",):
        for m in (model, eager):
            m.train(mode == "train")
        before = len(backend.report.layers), len(backend.report.skipped)
        with torch.set_grad_enabled(mode == "train"):  # eval() as a user evaluates: no gradients recorded
            torch.manual_seed(1)
            out = compiled(ids, labels=ids)
            torch.manual_seed(1)
            want = eager(ids, labels=ids)
        assert not backend.errors, f"{family} ({mode}): backend raised {backend.errors[0]!r}"
        assert normwise(out.logits, want.logits) <= 1e-5, f"{family} ({mode}): outputs changed"
        if backward is not False and mode == "train":
            out.loss.backward()
            want.loss.backward()
            errors = [(normwise(p.grad, q.grad), name)
                      for (name, p), q in zip(model.named_parameters(), eager.parameters()) if q.grad is not None]
            reports["grads"] = max(errors, default=(0.0, ""))
        reports[mode] = backend.report.layers[before[0]:], backend.report.skipped[before[1]:]
    return reports, backend.report


def _gradients_checked(family: str, modes) -> str:
    """What the walk says of the family's gradients: all of them match eager to 1e-5 normwise, in float32, or in
    float64 for ``GRADIENTS_IN_FLOAT64`` (the experts as batched matmuls: transformers' grouped_mm takes no
    float64)."""
    if family not in GRADIENTS_IN_FLOAT64:
        err, name = modes["grads"]
        assert err <= 1e-5, f"{family}: gradient of {name} changed ({err:.3g}); if float64 agrees, list the family " \
                            "in GRADIENTS_IN_FLOAT64 with the reason"
        return "all gradients"
    model = hf.build_model(hf.walk_config(family), dtype=torch.float64, experts_implementation="batched_mm")
    err, name = _compile_checked(family, model, backward=None)[0]["grads"]
    assert err <= 1e-5, f"{family}: gradient of {name} changed in float64 ({err:.3g})"
    return f"all gradients in float64 ({GRADIENTS_IN_FLOAT64[family]})"


def _walk_one(family: str) -> tuple[str, str, str, str]:
    """(family, model, result, detail) for the table: the family compiled as a user would, in train() and eval()."""
    model_kind = _model_kind(family)
    model = _build(family)
    if isinstance(model, Exception):  # the model itself cannot be built here: nothing of ours ran
        return family, model_kind, "not built", _short(f"{type(model).__name__}: {model}")
    backward = family not in FORWARD_ONLY
    modes, rep = _compile_checked(family, model, backward and family not in GRADIENTS_IN_FLOAT64)
    (train, train_skips), (evals, eval_skips) = modes["train"], modes["eval"]
    eval_skips = [s for s in eval_skips if s.region not in {t.region for t in train_skips}]  # new in eval() only
    n = len(train)
    checked = (f"train() logits + {_gradients_checked(family, modes)}, eval() logits" if backward
               else "train() and eval() logits")
    if n or evals:
        kinds = sorted({r.spec.routing.score_fn + "/" + r.spec.experts.activation for r in rep.layers})
        count = f"{n} layer(s)" if n else f"0 layer(s) in train(), {len(evals)} in eval()"
        if eval_skips:
            count += f" (eval() recompiled and skipped: {_short(eval_skips[0].reason, 90)})"
        detail = f"{count}; routing/activation: {', '.join(kinds)}; checked: {checked}"
        if family in FORWARD_ONLY:
            detail += f" ({FORWARD_ONLY[family]})"
        skipped = f"; also skipped: {_short(train_skips[0].reason, 140)}" if train_skips else ""
        return family, model_kind, "rewritten", detail + skipped
    reason = _short(rep.skipped[0].reason, 300) if rep.skipped else "no MoE router found in the graph"
    return family, model_kind, "skipped", f"{reason}; output unchanged"


def _table(rows) -> str:
    lines = ["| family | model | result | detail |", "|---|---|---|---|"]
    lines += [f"| {f} | {m} | {r} | {d} |" for f, m, r, d in rows]
    return "\n".join(lines)


CHUNKS = 4  # the walk in four tests, so that pytest-xdist spreads it over its workers


def _families() -> list[str]:
    return sorted(set(hf.moe_families_in_transformers()) | set(hf.FAMILIES))


def _readme_rows(text: str) -> dict[str, str]:
    """The README table's rows by family."""
    lines = text.split(START)[1].split(END)[0].strip().splitlines()[2:]
    return {line.split(" | ", 1)[0].removeprefix("| "): line for line in lines}


def test_readme_table_lists_every_family_once():
    text = README.read_text()
    lines = text.split(START)[1].split(END)[0].strip().splitlines()
    assert lines[:2] == _table([]).splitlines()
    assert [line.split(" | ", 1)[0].removeprefix("| ") for line in lines[2:]] == _families()


@pytest.mark.parametrize("chunk", range(CHUNKS))
def test_every_moe_family_rewritten_or_skipped_with_reason(chunk):
    """Every CHUNKS-th family from ``chunk`` on; their rows of the README table must be what the walk finds
    (``MOECOMPILE_WRITE_README=1`` rewrites them: run it with ``-n 0``, the chunks one after the other)."""
    families = _families()[chunk::CHUNKS]
    rows = [_walk_one(f) for f in families]
    assert all(r[2] == "rewritten" for r in rows if r[0] in hf.FAMILIES), [r for r in rows if r[0] in hf.FAMILIES]
    mine = dict(zip(families, _table(rows).splitlines()[2:]))
    text = README.read_text()
    if os.environ.get("MOECOMPILE_WRITE_README"):
        every = {**_readme_rows(text), **mine}
        table = "\n".join(_table([]).splitlines() + [every[f] for f in _families() if f in every])
        head, rest = text.split(START)
        README.write_text(head + START + "\n" + table + "\n" + END + rest.split(END)[1])
    else:
        current = _readme_rows(text)
        stale = [f for f in families if current.get(f) != mine[f]]
        assert not stale, f"README family table is stale for {stale}: rerun with MOECOMPILE_WRITE_README=1 -n 0"


@pytest.mark.parametrize("family", sorted(hf.WRITTEN_CONFIGS))
def test_written_config_builds_and_runs(family):
    """Every config written for the walk builds its model and runs a forward: it is ours, never "not built"."""
    model = _build(family)
    assert not isinstance(model, Exception), f"{family}: {model!r}"
    assert model(_ids(model)).logits.shape == (1, 6, model.config.vocab_size)


def test_walk_finds_nested_and_written_families():
    """dbrx (expert count nested in ffn_config) and every family with a written config are walked; composite
    wrappers whose text model is a family of its own are not walked twice."""
    families = set(hf.moe_families_in_transformers())
    assert {"dbrx", *hf.WRITTEN_CONFIGS} <= families
    assert not families & {"llama4", "qwen3_5_moe", "qwen4_exp", "dots3_note", "gemma4"}


@pytest.mark.parametrize("family", ["mixtral"])
def test_walk_row_reports_layers(family):
    f, _, result, detail = _walk_one(family)
    assert result == "rewritten" and detail.startswith("2 layer(s)")


def test_every_family_runs_as_eager_when_a_pass_fails_or_an_op_raises_at_its_first_run(monkeypatch):
    """Both fallbacks on every family of the walk, each family traced by Dynamo once (``_TwoFailures``):

    - a pass that raises after rewriting (canonicalize, unproved, then an error): each graph comes back as it came
      in, the report names the pass and the error, a warning says so;
    - the expert MLP of moe::expert_mlp and moe::expert_mlp_keep (the references' loop, the grouped GEMMs on CPU)
      raising whenever a graph runs it (not while Dynamo compiles, where the proof runs it): each rewritten graph
      fails at its first run, the graph as it came in from Dynamo runs instead; the report names the first run and
      the error, and a warning says so.

    Both give the graph's outputs (compared with each other) and the model eager's logits. With strict=True
    (``STRICT_FAMILY``) the backend raises instead, for each. Forward only, no inner compiler."""
    def raising(real):
        def run(*args, **kwargs):
            if torch.compiler.is_compiling():
                return real(*args, **kwargs)
            raise RuntimeError("forced failure at run time")
        return run

    for module, name in ((reference, "expert_mlp_ref"), (grouped_cpu, "expert_mlp_keep")):
        monkeypatch.setattr(module, name, raising(getattr(module, name)))
    for family, model, both, warned in _walk_as_eager():
        rep = both.pass_fails.report
        assert rep.graphs_seen and len(rep.failures) == rep.graphs_seen, family
        assert all((f.stage, f.error) == ("canonicalize", "RuntimeError: forced failure after rewriting")
                   for f in rep.failures), family
        assert not rep.layers and rep.counters["pipeline.failed.canonicalize"] == rep.graphs_seen, family
        assert both.pass_warned, family
        rep = both.op_raises.report
        assert not rep.layers and all((f.stage, f.error) == ("first_run", "RuntimeError: forced failure at run time")
                                      for f in rep.failures), family
        assert rep.counters["pipeline.failed.first_run"] == len(rep.failures), family
        if family in hf.FAMILIES:
            assert sum(both.rewritten) == model.config.num_hidden_layers, family  # every block spliced, then undone
            assert rep.failures and warned, family
            undone = [s for s in rep.skipped if s.reason.startswith("proved, but not rewritten")]
            assert len(undone) == model.config.num_hidden_layers, family  # every block was proved, then undone
    model = _build(STRICT_FAMILY)
    torch._dynamo.reset()
    strict = _PassesOnly(strict=True)
    with _pipeline_passes(_failing_passes([])), pytest.raises(Exception):
        torch.compile(model, backend=strict, fullgraph=True)(_ids(model))
    assert isinstance(strict.errors[0], pipeline.MoECompileError)
    torch._dynamo.reset()
    with pytest.raises(pipeline.MoECompileError, match="raised at its first run"):
        torch.compile(model, backend=_PassesOnly(**QUICK, strict=True))(_ids(model))


# strict=True raises where the walk falls back: one code path whatever the family, so one family checks it
STRICT_FAMILY = "mixtral"
QUICK = dict(probe_tokens=16, verify_backward=False)  # a short proof, forward only


def _failing_passes(rewritten: list[int]):
    """pipeline.PASSES with canonicalize raising after it rewrote (the count of blocks it spliced in ``rewritten``)."""
    def canonicalize_then_raise(gm, example_inputs, *, config, report):
        canonicalize_moe_pass(gm, example_inputs, config=config, report=report)
        rewritten.append(report.counters["canonicalize.rewritten"])  # the graph was edited before the error
        raise RuntimeError("forced failure after rewriting")

    return ("detect", dict(pipeline.PASSES)["detect"]), ("canonicalize", canonicalize_then_raise)


@contextlib.contextmanager
def _pipeline_passes(passes):
    real, pipeline.PASSES = pipeline.PASSES, passes
    try:
        yield
    finally:
        pipeline.PASSES = real


class _TwoFailures:
    """Each graph Dynamo makes, compiled twice by the MoE passes with no inner compiler: a copy with canonicalize
    raising after it rewrote (``pass_fails``), then the graph itself with the default passes and a short proof
    (``op_raises``: the test makes the expert MLP raise at run time). Each run runs both from the same random state
    and checks they give the same outputs (both are the graph as it came in), then returns the second's."""

    def __init__(self):
        self.pass_fails, self.op_raises = _PassesOnly(), _PassesOnly(**QUICK)
        self.rewritten: list[int] = []
        self.pass_warned = False  # a MoEFallbackWarning while the pass failed (the other's come at its first run)

    def moecompile_capture(self, options) -> bool:  # as moe_backend: Dynamo captures for it (tracing/capture.py)
        return self.op_raises.moecompile_capture(options)

    def __call__(self, gm, example_inputs, **_):
        with warnings.catch_warnings(record=True) as caught, _pipeline_passes(_failing_passes(self.rewritten)):
            warnings.simplefilter("always")
            passes_failed = self.pass_fails(copy.deepcopy(gm), example_inputs)
        self.pass_warned |= any(issubclass(w.category, pipeline.MoEFallbackWarning) for w in caught)
        op_raises = self.op_raises(gm, example_inputs)

        def run(*args):
            state = torch.random.get_rng_state()
            want = passes_failed(*args)
            torch.random.set_rng_state(state)
            got = op_raises(*args)
            leaves = zip(torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(want), strict=True)
            assert all(torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b for a, b in leaves)
            return got
        return run


def _walk_as_eager():
    """Every family of the walk that builds, compiled with ``_TwoFailures()`` and run once: the backend must not
    raise and the logits must be eager's. Yields (family, model, the backend, whether a ``MoEFallbackWarning`` was
    raised while the graphs ran)."""
    families = sorted(set(hf.moe_families_in_transformers()) | set(hf.FAMILIES))
    ran = 0
    for family in families:
        model = _build(family)
        if isinstance(model, Exception):
            continue
        eager, ids = copy.deepcopy(model), _ids(model)
        backend = _TwoFailures()
        torch._dynamo.reset()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = torch.compile(model, backend=backend)(ids)
        errors = backend.pass_fails.errors + backend.op_raises.errors
        assert not errors, f"{family}: backend raised {errors[0]!r}"
        assert normwise(got.logits, eager(ids).logits) <= 1e-5, f"{family}: outputs changed"
        yield family, model, backend, any(issubclass(w.category, pipeline.MoEFallbackWarning) for w in caught)
        ran += 1
    assert ran >= len(hf.FAMILIES)


class _PassesOnly(RecordingBackend):
    """The MoE passes, then the graph runs as they return it (no inner compiler), watched at its first run."""

    def __call__(self, gm, example_inputs, **_):
        try:
            return compile_graph(gm, example_inputs, self.config, self.report, inner=run_uncompiled)
        except torch._dynamo.exc.RestartAnalysis:
            raise
        except BaseException as exc:
            self.errors.append(exc)
            raise
