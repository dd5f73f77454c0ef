"""No model stops the user's program: a pass (or the inner compiler) that raises leaves the graph as it came in
from Dynamo, the report names the pass, the block and the error, a warning says so, and strict=True raises."""

import copy
import dataclasses

import pytest
import torch
from conftest import RecordingBackend, normwise
from test_passes import CONFIG, annotated, block_graph, capture

import moecompile
from moecompile import backend as moe_backend_module
from moecompile import pipeline
from moecompile.models import handwritten
from moecompile.passes import verify
from moecompile.passes.graph_utils import draws_random, extract, op_name
from moecompile.passes.report import PassReport
from moecompile.pipeline import MoECompileError, MoEFallbackWarning

IDS = torch.randint(0, 128, (2, 7), generator=torch.Generator().manual_seed(0))
QUICK = dict(inner="aot_eager", probe_tokens=16, verify_backward=False)  # the proof is not what is tested here


def _break_after(monkeypatch, failing: str, message: str = "boom") -> None:
    """Pass ``failing`` runs for real (the graph is edited) and then raises."""
    real = dict(pipeline.PASSES)[failing]

    def broken(gm, example_inputs, *, config, report):
        real(gm, example_inputs, config=config, report=report)
        raise RuntimeError(message)

    monkeypatch.setattr(pipeline, "PASSES", tuple((n, broken if n == failing else f) for n, f in pipeline.PASSES))


@pytest.mark.parametrize("failing", [name for name, _ in pipeline.PASSES])
def test_a_failing_pass_leaves_the_graph_as_it_came_in(monkeypatch, failing):
    _break_after(monkeypatch, failing)
    gm, ex = block_graph()
    before, want = gm.code, gm(*ex)
    report = PassReport()
    with pytest.warns(MoEFallbackWarning, match=rf"pass '{failing}' failed on graph 0.*RuntimeError: boom"):
        out = pipeline.run_passes(gm, ex, CONFIG, report)
    assert out.code == before and not annotated(out)
    assert torch.equal(out(*ex)[0], want[0])
    assert [(f.stage, f.error) for f in report.failures] == [(failing, "RuntimeError: boom")]
    proved = failing not in ("expose_sharded", "detect")  # verify had proved the block: now a skip, not a layer
    assert not report.layers and dict(report.counters) == {f"pipeline.failed.{failing}": 1,
                                                          **({"skipped": 1} if proved else {})}
    assert report.failures[0].region == ("graph 0 (MoE blocks <root>)" if proved else "graph 0")
    if proved:
        assert report.skipped[0].region == "<root>"
        assert report.skipped[0].reason.startswith(f"proved, but not rewritten: pass '{failing}' failed")
    strict = dataclasses.replace(CONFIG, strict=True)
    with pytest.raises(MoECompileError, match=rf"pass '{failing}' failed \(after .*\): boom"):
        pipeline.run_passes(*block_graph(), strict, PassReport())


def test_a_failure_inside_a_block_names_the_block_and_later_graphs_still_rewrite(monkeypatch):
    calls = []

    def prove_once_failing(cand, values, config, *rest):
        calls.append(cand.path)
        if len(calls) == 1:
            raise IndexError("index 9 is out of bounds")
        return real_prove(cand, values, config, *rest)

    real_prove = verify._prove
    monkeypatch.setattr(verify, "_prove", prove_once_failing)
    report = PassReport()
    with pytest.warns(MoEFallbackWarning, match=r"pass 'verify' failed on <root> \(IndexError: index 9"):
        pipeline.run_passes(*block_graph(), CONFIG, report)
    gm, ex = block_graph()
    want = gm(*ex)
    gm = pipeline.run_passes(gm, ex, CONFIG, report)  # the next graph: rewritten as usual
    assert [(f.stage, f.region) for f in report.failures] == [("verify", "<root>")]
    assert [r.path for r in report.layers] == ["<root>"] and report.counters["canonicalize.rewritten"] == 1
    assert report.counters["pipeline.failed.verify"] == 1 and report.graphs_seen == 2
    torch.testing.assert_close(gm(*ex), want, rtol=1e-5, atol=1e-6)


def test_handwritten_model_runs_explain_says_why_and_strict_raises(monkeypatch):
    _break_after(monkeypatch, "canonicalize", "canonical form rejected")
    torch.manual_seed(0)
    model = handwritten.TinyMoELM("gather")
    eager = copy.deepcopy(model)
    backend = RecordingBackend(**QUICK)
    with pytest.warns(MoEFallbackWarning):
        got = torch.compile(model, backend=backend, fullgraph=True)(IDS)
    assert not backend.errors and normwise(got.logits, eager(IDS).logits) == 0.0
    rep = backend.report
    assert not rep.layers and rep.counters["pipeline.failed.canonicalize"] == 1
    assert {s.region for s in rep.skipped} == {"blocks.0", "blocks.1"}

    report = moecompile.explain(model, IDS, probe_tokens=16, verify_backward=False)
    text = str(report)
    assert "0 MoE layer(s) rewritten, 2 skipped, 1 graph(s), 1 failure(s)" in text
    assert ("failed: pass 'canonicalize' raised on graph 0 (MoE blocks blocks.0, blocks.1): RuntimeError: "
            "canonical form rejected; that graph runs as it came in") in text
    assert "skipped blocks.0: proved, but not rewritten: pass 'canonicalize' failed" in text
    assert report.graph("fallback") == report.graph("input")

    torch._dynamo.reset()
    strict = RecordingBackend(**QUICK, strict=True)
    with pytest.raises(Exception, match="pass 'canonicalize' failed"):
        torch.compile(model, backend=strict, fullgraph=True)(IDS)
    assert isinstance(strict.errors[0], MoECompileError)


def test_inner_compiler_failure_on_the_rewritten_graph_compiles_it_as_it_came_in(monkeypatch):
    real_inner = moe_backend_module.compile_inner

    def inner_rejecting_moe_ops(gm, example_inputs, config):
        if any(str(n.target).startswith("moe.") for n in gm.graph.nodes):
            raise NotImplementedError("no lowering for moe.route")
        return real_inner(gm, example_inputs, config)

    monkeypatch.setattr(moe_backend_module, "compile_inner", inner_rejecting_moe_ops)
    torch.manual_seed(0)
    model = handwritten.TinyMoELM("modulelist")
    eager = copy.deepcopy(model)
    backend = RecordingBackend(**QUICK)
    with pytest.warns(MoEFallbackWarning, match="the inner compiler failed"):
        got = torch.compile(model, backend=backend, fullgraph=True)(IDS)
    assert not backend.errors and normwise(got.logits, eager(IDS).logits) == 0.0
    rep = backend.report
    assert [(f.stage, f.error) for f in rep.failures] == [("inner", "NotImplementedError: no lowering for moe.route")]
    assert not rep.layers and len(rep.skipped) == 2 and rep.counters["pipeline.failed.inner"] == 1
    torch._dynamo.reset()
    strict = RecordingBackend(**QUICK, strict=True)
    with pytest.raises(Exception, match="the inner compiler"):
        torch.compile(model, backend=strict, fullgraph=True)(IDS)
    assert isinstance(strict.errors[0], MoECompileError)


class _StraightThrough(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return (x > 0).to(x.dtype)

    @staticmethod
    def backward(ctx, g):
        return g


def test_extract_carries_higher_order_op_bodies():
    """An autograd.Function in the graph is a higher-order op whose bodies are get_attr submodules."""
    gm, ex = capture(lambda x: _StraightThrough.apply(x * 2.0) + 1.0, torch.randn(3, 4, requires_grad=True))
    assert any(n.op == "get_attr" for n in gm.graph.nodes)
    body = {n for n in gm.graph.nodes if n.op not in ("placeholder", "output")}
    out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    sub, inputs = extract(body, out[0] if isinstance(out, (tuple, list)) else out)
    assert [i.op for i in inputs] == ["placeholder"]
    torch.testing.assert_close(sub(ex[0]), (ex[0] * 2 > 0).float() + 1)  # was: no attribute 'fwd_body_0'


def test_draws_random_reads_op_tags():
    def f(x):
        noise = torch.empty_like(x).exponential_() + torch.rand_like(x)
        kept = torch.nn.functional.dropout(x, 0.1, False) + torch.nn.functional.dropout(x, 0.0, True)
        return x.softmax(-1) + noise + kept + torch.nn.functional.dropout(x, 0.1, True)

    gm, _ = capture(f, torch.randn(3, 3))
    drawn = [op_name(n) for n in gm.graph.nodes if draws_random(n)]
    assert drawn == ["exponential_", "rand_like", "dropout"]  # dropout with p=0 or training=False draws nothing
