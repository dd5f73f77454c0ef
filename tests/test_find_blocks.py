"""parallelize's detection on the MoE blocks traced alone (moecompile/distributed/find_blocks.py) finds what
explain() of the whole model finds: the same layers, paths, specs and expert weights, in the same order; only the
blocks are traced where the module tree shows them, the whole model where it does not; a block of the code,
attributes and input shapes of one traced before takes its report untraced (moecompile/distributed/twins.py)."""

import copy

import pytest
import torch
from torch import nn

from moecompile.distributed.find_blocks import explain_blocks
from moecompile.explain import explain
from moecompile.models import hf
from moecompile.models.handwritten import TinyMoELM


def _build(family):
    if family in ("loop", "modulelist"):
        torch.manual_seed(0)
        return TinyMoELM(family)
    if family in ("dbrx", "lfm2_moe"):
        return hf.build_model(hf.walk_config(family))
    return hf.tiny_model(family)


def _ids(model):
    vocab = model.config.vocab_size if hasattr(model, "config") else model.embed.num_embeddings
    return torch.randint(0, min(vocab, 64), (2, 7), generator=torch.Generator().manual_seed(0))


def _layers(report):
    """What parallelize reads of each layer: its path, spec and the identity of every expert weight; and the layer
    whose proof it shares (one proof for the layers of one code and shapes, in one graph as across the blocks)."""
    out = []
    for rec in report.layers:
        weights = {role: [id(w) for w in ws] if isinstance(ws, list) else id(ws)
                   for role, ws in rec.expert_weights.items()}
        out.append((rec.path, str(rec.spec), weights, rec.proved_as))
    return out


def _traced(report) -> str:
    return "\n".join(code for stage, code in report.graphs if stage == "input")


@pytest.mark.parametrize("family", ["mixtral", "deepseek_v3", "gpt_oss", "qwen3_moe", "llama4_text", "loop",
                                    "modulelist", "lfm2_moe"])  # (lfm2_moe: a short convolution in every layer,
def test_blocks_alone_find_what_the_whole_model_finds(family):  # no expert holder)
    model = _build(family)
    whole = explain(model, _ids(model))
    each = explain_blocks(model, (_ids(model),), twins=False)
    assert whole.layers and _layers(each) == _layers(whole)
    # only the blocks were traced: one graph each, none with the attention or the embeddings in it
    assert each.num_graphs == len(whole.layers), each.num_graphs
    assert "attn" not in _traced(each) and "embed" not in _traced(each), _traced(each)[:2000]
    assert "embed" in _traced(whole)
    # the layers are one block repeated: the first traced, the others take its report as their own (twins.py)
    blocks = explain_blocks(model, (_ids(model),))
    assert _layers(blocks) == _layers(whole) and [r.proved_as for r in whole.layers][1:] == [whole.layers[0].path]
    assert blocks.num_graphs == 1 and blocks.counters["blocks.twins"] == len(whole.layers) - 1, blocks.counters


def test_twins_of_a_model_never_compiled_before_in_train_mode():
    """The first thing run on a fresh model in train() mode (a trace leaves attributes on the block it traced:
    the key is read before)."""
    model = _build("mixtral").train()
    blocks = explain_blocks(model, (_ids(model),))
    assert blocks.num_graphs == 1 and blocks.counters["blocks.twins"] == 1, blocks.counters
    assert _layers(blocks) == _layers(explain_blocks(model, (_ids(model),), twins=False))


def _top_k_1(model):
    model.model.layers[1].mlp.top_k = model.model.layers[1].mlp.gate.top_k = 1


def _hooked(model):
    model.model.layers[1].mlp.register_forward_hook(lambda module, args, out: out)


def _frozen(model):
    model.model.layers[1].mlp.experts.requires_grad_(False)


def _tensor_attribute(model):
    model.model.layers[1].mlp.experts.table = torch.zeros(3)  # (neither a parameter nor a buffer)


@pytest.mark.parametrize("change", [_top_k_1, _hooked, _frozen, _tensor_attribute])
def test_a_block_that_differs_in_what_a_trace_reads_is_traced_itself(change):
    """A block differing from the first in anything its trace may read (an attribute's value, a hook, a
    parameter's requires_grad) or in what the key cannot describe (a plain tensor attribute) is traced itself."""
    model = _build("mixtral")
    change(model)
    whole = explain(model, _ids(model))
    blocks = explain_blocks(model, (_ids(model),))
    assert _layers(blocks) == _layers(whole) and len(whole.layers) == 2
    assert blocks.num_graphs == 2 and "blocks.twins" not in blocks.counters, blocks.counters
    if change is _top_k_1:
        assert [r.spec.routing.top_k for r in blocks.layers] == [2, 1]


def test_twins_traced_once_on_the_meta_device():
    """A model built on meta: the second block takes the first's report without its random weights drawn, and
    its expert weights are its own meta parameters."""
    model = _build("mixtral")
    with torch.device("meta"):
        on_meta = type(model)(model.config)
    each = explain_blocks(on_meta, (_ids(model),), torch.device("cpu"), twins=False)
    blocks = explain_blocks(on_meta, (_ids(model),), torch.device("cpu"))
    assert _layers(blocks) == _layers(each) and len(blocks.layers) == 2 and blocks.num_graphs == 1
    assert all(w.is_meta for rec in blocks.layers for w in rec.expert_weights.values())


def test_experts_stored_flat_are_found_on_the_whole_model():
    """dbrx keeps its experts as [E * I, H] matrices: nothing in the module tree says experts, so the whole model
    is traced, as explain() does."""
    model = _build("dbrx")
    whole = explain(model, _ids(model))
    blocks = explain_blocks(model, (_ids(model),))
    assert whole.layers and _layers(blocks) == _layers(whole)
    assert "embed" in _traced(blocks) or "wte" in _traced(blocks)


def test_a_three_dimensional_weight_outside_the_experts_changes_nothing():
    """A 3-d parameter beside the attention (no expert) is a holder whose parent (the decoder layer) holds a
    layer that does not read it: taken for no expert, and the layers are the whole model's."""
    model = _build("mixtral")
    model.model.layers[0].self_attn.table = nn.Parameter(torch.zeros(2, 3, 4))
    whole = explain(model, _ids(model))
    assert _layers(explain_blocks(model, (_ids(model),))) == _layers(whole) and whole.layers


def test_a_block_the_example_does_not_run_sends_detection_to_the_whole_model():
    """A MoE block the example never calls has no recorded inputs: the whole model is explained, which finds the
    blocks it runs."""
    model = _build("mixtral")
    model.spare = copy.deepcopy(model.model.layers[0].mlp)  # held, never called
    whole = explain(model, _ids(model))
    blocks = explain_blocks(model, (_ids(model),))
    assert [r.path for r in whole.layers] == ["model.layers.0.mlp", "model.layers.1.mlp"]
    assert _layers(blocks) == _layers(whole) and "embed" in _traced(blocks)


def test_a_block_that_raises_when_run_alone_sends_detection_to_the_whole_model():
    """A module that fails when run again alone (state its first run left, say): the whole model is explained."""
    model = _build("mixtral")
    block, calls = model.model.layers[1].mlp, []
    forward = block.forward

    def second_call_raises(hidden_states):
        calls.append(1)
        if len(calls) == 2:  # the example's eager run was the first
            raise RuntimeError("state left by the first run")
        return forward(hidden_states)

    whole = explain(model, _ids(model))
    calls.clear()
    block.forward = second_call_raises
    blocks = explain_blocks(model, (_ids(model),))
    assert len(calls) == 3 and _layers(blocks) == _layers(whole) and "embed" in _traced(blocks)
