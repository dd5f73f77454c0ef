"""Pass units on small captured graphs: what each pass leaves behind (the invariants of passes/README.md)."""

import dataclasses

import pytest
import torch

from moecompile.config import MoEOptions
from moecompile.models import handwritten
from moecompile.passes.canonicalize import canonicalize_moe_pass
from moecompile.passes.detect import detect_moe_pass
from moecompile.passes.graph_utils import op_name
from moecompile.passes.lower import lower_moe_pass
from moecompile.passes.report import PassReport
from moecompile.passes.verify import verify_moe_pass
from moecompile.pipeline import MoECompileError

CONFIG = MoEOptions(inner="aot_eager")


def capture(module, *args):
    """The Dynamo graph of ``module(*args)`` and its example inputs."""
    graphs = []

    def backend(gm, example_inputs, **_):
        graphs.append((gm, example_inputs))
        return gm.forward

    torch.compile(module, backend=backend, fullgraph=True)(*args)
    return graphs[0]


def block_graph(kind="gather"):
    torch.manual_seed(0)
    block = handwritten.TinyMoELM(kind).blocks[0]
    return capture(block, torch.randn(2, 5, 32))


def annotated(gm):
    return [n for n in gm.graph.nodes if "moe" in n.meta]


def test_detect_only_annotates():
    gm, ex = block_graph()
    before = gm.code
    report = PassReport()
    detect_moe_pass(gm, ex, config=CONFIG, report=report)
    assert gm.code == before
    (node,) = annotated(gm)
    cand = node.meta["moe"]
    assert cand.path == "<root>" and len(cand.specs) == len(cand.bindings) >= 1
    spec = cand.specs[0]
    assert (spec.experts.num_experts, spec.routing.top_k, spec.experts.hidden, spec.experts.intermediate) == (8, 2, 32, 16)
    assert report.counters["detect.blocks"] == 1


def test_verify_keeps_one_proved_spec_and_rejects_wrong_ones():
    gm, ex = block_graph()
    report = PassReport()
    detect_moe_pass(gm, ex, config=CONFIG, report=report)
    verify_moe_pass(gm, ex, config=CONFIG, report=report)
    (node,) = annotated(gm)
    assert len(node.meta["moe"].specs) == 1 and report.layers[0].max_error <= 1e-5

    gm, ex = block_graph()
    report = PassReport()
    detect_moe_pass(gm, ex, config=CONFIG, report=report)
    cand = annotated(gm)[0].meta["moe"]
    wrong = [s.replace(experts=dataclasses.replace(s.experts, activation="gelu")) for s in cand.specs]
    cand.specs = wrong
    verify_moe_pass(gm, ex, config=CONFIG, report=report)
    assert not annotated(gm) and report.counters["verify.rejected"] == 1
    assert "no candidate spec reproduced the block" in report.skipped[0].reason


def test_canonicalize_then_lower_leave_only_canonical_ops():
    gm, ex = block_graph("modulelist")
    want = gm(*ex)
    report = PassReport()
    for p in (detect_moe_pass, verify_moe_pass, canonicalize_moe_pass, lower_moe_pass):
        gm = p(gm, ex, config=CONFIG, report=report)
        gm.graph.lint()
        gm.recompile()
    names = [op_name(n) for n in gm.graph.nodes]
    assert "topk" not in names and "silu" not in names  # the old routed computation is gone
    assert names.count("linear") == 1  # only the router logits remain of the original
    moe_nodes = [n for n in gm.graph.nodes if n.meta.get("moe_layer")]
    assert {str(n.target) for n in moe_nodes} >= {"moe.route", "moe.build_pft", "moe.expert_mlp", "moe.combine"}
    assert all(n.meta["moe_lowering"] == "torch" for n in moe_nodes)
    assert not annotated(gm) and report.layers[0].lowering == "torch"
    torch.testing.assert_close(gm(*ex), want, rtol=1e-5, atol=1e-6)


def test_strict_pass_failure_names_the_pass_and_those_before(monkeypatch):
    """strict=True: a pass that raises stops compilation (without it the graph runs as it came in: test_fallback)."""
    from moecompile import pipeline

    def broken(gm, example_inputs, *, config, report):
        raise RuntimeError("boom")

    monkeypatch.setattr(pipeline, "PASSES", (pipeline.PASSES[0], ("verify", broken)) + pipeline.PASSES[2:])
    gm, ex = block_graph()
    with pytest.raises(MoECompileError, match=r"pass 'verify' failed \(after \['detect'\]\): boom"):
        pipeline.run_passes(gm, ex, dataclasses.replace(CONFIG, strict=True), PassReport())


def test_a_graph_without_moe_is_left_alone():
    mlp = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.SiLU(), torch.nn.Linear(16, 8))
    gm, ex = capture(mlp, torch.randn(3, 8))
    before = gm.code
    report = PassReport()
    for p in (detect_moe_pass, verify_moe_pass, canonicalize_moe_pass, lower_moe_pass):
        gm = p(gm, ex, config=CONFIG, report=report)
    assert gm.code == before and not report.layers and not report.skipped
