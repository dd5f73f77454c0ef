"""torchtitan's MoE as a user writes it (the hand-written ``sorted_split``): the (token, pick) pairs sorted by expert,
counted with ``histc``, the tokens gathered in that order and scaled by their routing score before the experts, the
stacked experts run in a loop over ``split`` rows (counts read with ``.tolist()``) or by ``torch._grouped_mm`` over
the counts' offsets, the rows added back with ``scatter_add``. Both are found in one graph and rewritten with the
weights on the experts' input: the loop in float32 equal to eager (logits and every gradient), the grouped form in
bf16 (torch runs ``_grouped_mm`` on CPU in bf16 only) as close to float32 as eager bf16 is. Its expert-parallel
training (world 2) is checked with the skipping loops' in tests/test_loop_skips.py."""

import pytest
import torch
from conftest import RecordingBackend, compile_and_compare, normwise

from moecompile.models.handwritten import TinyMoELM

IDS = torch.randint(0, 128, (2, 7), generator=torch.Generator().manual_seed(0))


def _on_input(report):
    return [(layer.spec.routing.weights_on_input, layer.spec.routing.score_fn) for layer in report.layers]


def test_the_loop_over_split_rows_is_rewritten_with_the_weights_on_the_input():
    torch.manual_seed(0)
    report = compile_and_compare(TinyMoELM("sorted_split"), IDS,
                                 backend=RecordingBackend(inner="aot_eager", lowering="torch"))
    assert report.graphs_seen == 1 and _on_input(report) == [(True, "sigmoid")] * 2, report.skipped
    assert report.counters["lower.torch"] == 2


def test_grouped_mm_experts_rewritten_in_bf16_as_accurate_as_eager():
    """Logits and the expert weights' gradients of the compiled bf16 model are no further from the float32 model's
    than eager bf16's are, up to 2x (and 1e-3 for rounding where eager's happens to be tiny)."""
    torch.manual_seed(0)
    ref = TinyMoELM("sorted_split")
    low, compiled_low = TinyMoELM("sorted_split", grouped=True), TinyMoELM("sorted_split", grouped=True)
    for m in (low, compiled_low):
        m.load_state_dict(ref.state_dict())
        m.to(torch.bfloat16)
    backend = RecordingBackend(inner="aot_eager", lowering="torch")
    outs = [m(IDS, labels=IDS) for m in (ref, low, torch.compile(compiled_low, backend=backend))]
    assert not backend.errors and _on_input(backend.report) == [(True, "sigmoid")] * 2, backend.report.skipped
    want, eager, got = (o.logits.float() for o in outs)
    assert normwise(got, want) <= 2 * normwise(eager, want) + 1e-3
    for o in outs:
        o.loss.backward()
    for name in ("blocks.0.w1", "blocks.0.w2", "blocks.1.w3", "blocks.1.gate.weight"):
        g_ref, g_eager, g_got = (m.get_parameter(name).grad.float() for m in (ref, low, compiled_low))
        assert normwise(g_got, g_ref) <= 2 * normwise(g_eager, g_ref) + 1e-3, name
