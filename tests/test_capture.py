"""Expert loops over data-dependent selections (issue 8, item 1): with nothing changed in the user's program, the
moe backend's own compiles capture them in one graph, rewritten and equal to eager; Dynamo's settings are back to
their defaults after each compile; loops that cannot be captured are reported with why and the fix."""


import torch
from conftest import RecordingBackend, capture_flags, compile_and_compare, normwise

import moecompile
from moecompile.tracing.capture import _compiler_being_traced_for, wants_capture
from moecompile.tracing.capture import FLAGS
from moecompile.models import handwritten, hf

IDS = torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(0))


DYNAMO_DEFAULTS = {f: False for f in FLAGS}


def test_capture_context_restores_the_settings():
    assert capture_flags() == DYNAMO_DEFAULTS
    with moecompile.capture():
        assert all(capture_flags().values())
    assert capture_flags() == DYNAMO_DEFAULTS


def test_modulelist_loop_with_where_and_index_add_captured_and_rewritten():
    """The user changes nothing: the moe backend's own compile captures the loop; one graph, both layers."""
    torch.manual_seed(0)
    model = handwritten.TinyMoELM("loop")
    report = compile_and_compare(model, IDS)
    assert report.graphs_seen == 1 and len(report.layers) == 2, report.skipped
    assert report.layers[0].spec.experts.storage == "modulelist"


def test_registered_moe_backend_captures_by_name():
    """``backend="moe"`` as a user writes it: one graph per forward (Dynamo's counter), eager's output, settings
    back to Dynamo's defaults afterwards."""
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    model = handwritten.TinyMoELM("loop")
    counters.clear()
    got = torch.compile(model, backend="moe", options={"inner": "aot_eager"})(IDS)
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    assert normwise(got.logits, model(IDS).logits) <= 1e-5
    assert capture_flags() == DYNAMO_DEFAULTS


def test_capture_false_keeps_dynamos_defaults_and_says_so():
    """Option capture=False: the loop breaks the graph, nothing is rewritten, the output is eager's, and explain()
    says why and names the fix."""
    torch.manual_seed(0)
    model = handwritten.TinyMoELM("loop")
    report = compile_and_compare(model, IDS, capture=False, grads=False)
    assert not report.layers and report.graphs_seen > 1
    report = moecompile.explain(model, IDS, capture=False)
    assert not report.layers and report.num_graphs > 1
    assert any(s.region == "<graph breaks>" and "capture at True" in s.reason for s in report.skipped)
    report = moecompile.explain(model, IDS)
    assert len(report.layers) == 2 and report.num_graphs == 1
    assert not report.skipped


def test_other_backends_trace_with_dynamos_defaults():
    """The settings are scoped to the moe backend's compiles: a compile for another backend in the same process
    sees Dynamo's defaults, even right after a moe compile."""
    seen = []

    def other(gm, example_inputs):
        seen.append(capture_flags())
        return gm.forward

    torch.compile(handwritten.TinyMoELM("loop"), backend=RecordingBackend(inner="aot_eager"))(IDS)
    torch._dynamo.reset()
    torch.compile(handwritten.TinyMoELM("loop"), backend=other)(IDS)
    assert seen and all(s == DYNAMO_DEFAULTS for s in seen)


def test_the_compile_scope_finds_the_backend_dynamo_traces_for():
    """The mechanism itself: Dynamo's compile-start callback finds the compiler on the stack (a torch upgrade
    that moves it fails here first), through Dynamo's wrappers and torch.compile's options."""
    found = []

    def probe(args):
        found.append(_compiler_being_traced_for())

    torch._dynamo.callback_handler.register_start_callback(probe)
    try:
        backend = RecordingBackend(inner="aot_eager", capture=False)
        torch.compile(torch.nn.Linear(4, 4), backend=backend)(torch.randn(2, 4))
    finally:
        torch._dynamo.callback_handler.remove_start_callback(probe)
    assert found and found[0] is not None
    assert wants_capture(found[0]) is False  # RecordingBackend(capture=False), through Dynamo's wrappers
    wrapper = torch._TorchCompileWrapper(moecompile.moe_backend, None, {"capture": False}, None)
    assert wants_capture(wrapper) is False
    assert wants_capture(torch._TorchCompileWrapper("moe", None, None, None)) is True
    assert wants_capture(torch._TorchCompileWrapper("aot_eager", None, None, None)) is False


def test_capture_under_dynamo_optimize():
    """torch._dynamo.optimize("moe") gets the same scoped capture."""
    torch.manual_seed(0)
    model = handwritten.TinyMoELM("loop")
    backend = RecordingBackend(inner="aot_eager")
    got = torch._dynamo.optimize(backend)(model)(IDS)
    assert backend.report.graphs_seen == 1 and len(backend.report.layers) == 2
    assert normwise(got.logits, model(IDS).logits) <= 1e-5
    assert capture_flags() == DYNAMO_DEFAULTS


def test_jetmoe_split_loop_captured_and_rewritten():
    """jetmoe: expert sizes by .tolist(), inputs split per expert and a loop over range(E) of linears."""
    model = hf.build_model(hf.shrink_config("jetmoe"))
    report = compile_and_compare(model, IDS)
    assert report.graphs_seen == 1
    assert len(report.layers) == model.config.num_hidden_layers, report.skipped


def test_after_dynamo_reset_the_first_compile_captures():
    """torch._dynamo.reset() clears every compile callback, ours too: moecompile registers its scope again as they
    are cleared, so the first frame compiled right after it captures (one graph, every layer rewritten), and so
    does the next; a callback of someone else's is cleared as torch clears it."""
    from moecompile.tracing import capture as capture_mod

    torch._dynamo.callback_handler.register_start_callback(print)
    for _ in range(2):
        torch._dynamo.reset()  # no install() after it, as in a user's program
        handler = torch._dynamo.callback_handler
        assert handler.start_callbacks == [capture_mod.compile_scope_start], handler.start_callbacks
        model = hf.build_model(hf.shrink_config("jetmoe"))
        report = compile_and_compare(model, IDS, grads=False)
        assert report.graphs_seen == 1 and len(report.layers) == model.config.num_hidden_layers, report.skipped
