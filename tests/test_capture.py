"""Expert loops over data-dependent selections (issue 8, item 1): captured in one graph under
``moecompile.capture()``, rewritten and equal to eager; reported with the fix when they cannot be captured."""

import contextlib
import copy

import torch
from conftest import RecordingBackend, normwise

import moecompile
from moecompile.capture import FLAGS, LOOP_REASON
from moecompile.models import handwritten, hf

IDS = torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(0))


def _flags():
    return {f: getattr(torch._dynamo.config, f) for f in FLAGS}


def _compile_and_compare(model, *, capture: bool, grads: bool = True):
    """(report, graphs) of compiling ``model`` with the moe backend, checked against eager (logits, gradients)."""
    eager = copy.deepcopy(model)
    backend = RecordingBackend(inner="aot_eager")
    with moecompile.capture() if capture else contextlib.nullcontext():
        got = torch.compile(model, backend=backend)(IDS, labels=IDS)
    want = eager(IDS, labels=IDS)
    assert not backend.errors, backend.errors
    assert normwise(got.logits, want.logits) <= 1e-5
    if grads:
        got.loss.backward()
        want.loss.backward()
        for (name, p), q in zip(model.named_parameters(), eager.parameters()):
            if q.grad is not None:
                assert normwise(p.grad, q.grad) <= 1e-5, name
    return backend.report


def test_capture_restores_the_settings():
    before = _flags()
    with moecompile.capture():
        assert all(_flags().values())
    assert _flags() == before
    assert moecompile.moe_backend.backend_ctx_ctor is moecompile.capture  # Dynamo's hook for a backend's context


def test_modulelist_loop_with_where_and_index_add_captured_and_rewritten():
    torch.manual_seed(0)
    model = handwritten.TinyMoELM("loop")
    report = _compile_and_compare(model, capture=True)
    assert report.graphs_seen == 1 and len(report.layers) == 2, report.skipped
    assert report.layers[0].spec.experts.storage == "modulelist"


def test_uncaptured_loop_is_reported_by_explain_with_the_fix():
    torch.manual_seed(0)
    model = handwritten.TinyMoELM("loop")
    report = moecompile.explain(model, IDS)
    assert not report.layers and report.num_graphs > 1
    assert any(s.region == "<graph breaks>" and "moecompile.capture()" in s.reason for s in report.skipped)
    with moecompile.capture():
        report = moecompile.explain(model, IDS)
    assert len(report.layers) == 2 and report.num_graphs == 1
    assert not report.skipped


def test_backend_ctx_ctor_captures_under_dynamo_optimize():
    """torch._dynamo.optimize honours the backend's context (torch.compile in torch 2.13 drops it)."""
    torch.manual_seed(0)
    model = handwritten.TinyMoELM("loop")
    backend = RecordingBackend(inner="aot_eager")

    def moe(gm, example_inputs, **kw):
        return backend(gm, example_inputs, **kw)

    moe.backend_ctx_ctor = moecompile.moe_backend.backend_ctx_ctor
    got = torch._dynamo.optimize(moe)(model)(IDS)
    assert backend.report.graphs_seen == 1 and len(backend.report.layers) == 2
    assert normwise(got.logits, model(IDS).logits) <= 1e-5
    assert not any(_flags().values())


def test_jetmoe_split_loop_captured_and_rewritten():
    """jetmoe: expert sizes by .tolist(), inputs split per expert and a loop over range(E) of linears."""
    model = hf.build_model(hf.shrink_config("jetmoe"))
    report = _compile_and_compare(model, capture=True)
    assert report.graphs_seen == 1
    assert len(report.layers) == model.config.num_hidden_layers, report.skipped


def test_nonzero_trip_count_loop_reported_with_why_and_fix():
    """experts_implementation='eager' loops over the hit experts: a trip count Dynamo cannot unroll."""
    model = hf.tiny_model("mixtral", experts_implementation="eager")
    with moecompile.capture():
        report = moecompile.explain(model, IDS)
    assert not report.layers
    assert any(s.reason.endswith(LOOP_REASON) for s in report.skipped), report.skipped
    got = torch.compile(model, backend=RecordingBackend(inner="aot_eager"))
    with moecompile.capture():
        assert normwise(got(IDS).logits, model(IDS).logits) <= 1e-5
