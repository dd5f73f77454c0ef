"""Layers with an expert capacity. transformers' Switch Transformers (an encoder-decoder, outside the family walk)
is rewritten: its experts loop over the experts that received tokens of a mask passed in, indexing a ModuleDict by
f"expert_{e}", and its capacity holds in each sequence (a cumsum over S of [B, S, E]). And a capacity that the
proof cannot pin down for the token counts a dynamic graph serves is left as it was, with the reason: it was
rewritten at the traced count and silently dropped other tokens than the model at others."""

import pytest
import torch
from conftest import RecordingBackend, compile_and_compare, normwise

import moecompile
from moecompile.models.handwritten import TinyMoELM
from moecompile.runtime.stats import DROPS


def _switch(capacity: int, **kw):
    from transformers import SwitchTransformersConfig, SwitchTransformersForConditionalGeneration

    torch.manual_seed(0)
    config = SwitchTransformersConfig(
        vocab_size=64, d_model=32, d_kv=8, d_ff=48, num_heads=2, num_experts=4, expert_capacity=capacity,
        encoder_sparse_step=1, decoder_sparse_step=1, router_jitter_noise=0.0, decoder_start_token_id=0,
        pad_token_id=0, **{"num_layers": 2, "num_decoder_layers": 2, "dropout_rate": 0.0, **kw})
    return SwitchTransformersForConditionalGeneration(config)


def test_switch_transformers_rewritten_with_its_capacity_per_sequence():
    """Two sequences of 6 tokens, a capacity of 2 per expert and sequence: tokens are dropped (which ones, per
    sequence or over all 12 tokens, tests/test_ops.py checks). Every sparse layer (2 encoder, 2 decoder) is
    rewritten; logits and every gradient as eager. The source's buffers hold 2 x 4 x 2 rows a layer, ours 12."""
    model = _switch(capacity=2).train()
    ids = torch.randint(1, 64, (2, 6), generator=torch.Generator().manual_seed(1))
    DROPS.reset()  # the counts below are this run's
    report = compile_and_compare(model, ids)
    assert len(report.layers) == 4 and not report.skipped, report.skipped
    for layer in report.layers:
        r = layer.spec.routing
        assert (r.top_k, r.capacity, r.capacity_per_sequence, layer.spec.experts.activation) == (1, 2, True, "relu")
        assert "capacity 2 per sequence" in layer.spec.summary()
    drops = moecompile.token_drops()
    assert sum(d["dropped"] for d in drops.values()) > 0, drops  # the capacity is exercised
    counts = report.counters
    assert (counts["canonicalize.padding_rows_removed"], counts["canonicalize.dropped_rows_kept"]) == (4 * 4, 0)
    assert set(report.loops) == {"transformers.models.switch_transformers.modeling_switch_transformers."
                                 "SwitchTransformersExperts.forward"}


def test_switch_transformers_with_dropout_in_its_experts_is_left_as_it_was_in_training():
    """The default dropout_rate (0.1) runs inside each expert: a random draw no probe can prove. In training the
    layers run as written and say so; in eval() they are rewritten."""
    model = _switch(capacity=2, dropout_rate=0.1, num_layers=1, num_decoder_layers=1)
    ids = torch.randint(1, 64, (2, 6), generator=torch.Generator().manual_seed(1))
    backend = RecordingBackend(inner="aot_eager")
    torch.compile(model.train(), backend=backend)(ids, labels=ids)
    skipped = backend.report.skipped
    assert not backend.report.layers and skipped and all("random numbers" in s.reason for s in skipped), skipped
    torch._dynamo.reset()
    with torch.no_grad():
        report = compile_and_compare(model.eval(), ids, grads=False)
    assert len(report.layers) == 2


def _logits(model, ids):
    return model(input_ids=ids, decoder_input_ids=ids).logits


@pytest.mark.parametrize("first, then, rewritten", [
    (3, (12, 16), False),  # the capacity (4) is not reached by 3 tokens: which it drops is unproved: as written
    (12, (3, 16), True),   # proved at 12 tokens, drops per sequence at every length of the one dynamic graph
])
def test_a_capacity_the_traced_tokens_do_not_reach_is_not_rewritten_for_other_lengths(first, then, rewritten):
    model = _switch(capacity=4, num_layers=1, num_decoder_layers=1).eval()
    backend = RecordingBackend(inner="aot_eager")
    compiled = torch.compile(model, backend=backend, dynamic=True)
    with torch.no_grad():
        for length in (first, *then):
            ids = torch.randint(1, 64, (1, length), generator=torch.Generator().manual_seed(length))
            assert normwise(_logits(compiled, ids), _logits(model, ids)) <= 1e-5, length
    assert bool(backend.report.layers) == rewritten
    reasons = [s.reason for s in backend.report.skipped if "not exceeded by the traced 3 tokens" in s.reason]
    assert len(reasons) == len(backend.report.skipped) and bool(reasons) != rewritten, backend.report.skipped
    # (with dynamic=True Dynamo makes the experts' dropout p a graph input: a 0-d float, not a second token input)


def test_a_capacity_that_grows_with_the_tokens_is_not_rewritten_in_a_dynamic_graph():
    """The hand-written bmm block computes C = ceil(T * k / E * factor): in a dynamic graph C is a size of the
    graph, which moe.build_pft (a constant capacity) cannot follow; it was rewritten with the traced C and dropped
    the wrong tokens at other lengths (normwise error 0.2)."""
    model = TinyMoELM("bmm").eval()
    backend = RecordingBackend(inner="aot_eager")
    compiled = torch.compile(model, backend=backend, dynamic=True)
    with torch.no_grad():
        for length in (5, 24, 40):
            ids = torch.randint(0, 128, (2, length), generator=torch.Generator().manual_seed(length))
            assert normwise(compiled(ids).logits, model(ids).logits) <= 1e-5, length
    assert not backend.report.layers
    assert any("changes with the token count" in s.reason for s in backend.report.skipped), backend.report.skipped
