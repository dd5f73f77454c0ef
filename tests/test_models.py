"""Tests of the tiny model zoo (moecompile.models): HF families and hand-written MoE blocks."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

from moecompile.tracing import loops
from moecompile.tracing.capture import install
from moecompile.models import (
    FAMILIES,
    HANDWRITTEN,
    GatherMoE,
    GShardMoE,
    ModuleListMoE,
    TinyMoELM,
    load_config,
    moe_families_in_transformers,
    shrink_config,
    tiny_config,
    tiny_model,
)

IDS = torch.randint(0, 128, (2, 5), generator=torch.Generator().manual_seed(0))


def _compiled_matches_eager(model, *args):
    torch._dynamo.reset()
    with torch.no_grad():
        ref = model(*args).logits
        out = torch.compile(model, backend="aot_eager", fullgraph=True)(*args).logits
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------------ HF families

@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_builds_and_runs(family):
    model = tiny_model(family)
    assert not model.training
    with torch.no_grad():
        logits = model(IDS).logits
    assert logits.shape == (2, 5, 128) and torch.isfinite(logits).all()
    assert [n for n, p in model.named_parameters() if not p.any()] == []  # routers, experts, biases all drawn
    assert [n for n, b in model.named_buffers() if "correction_bias" in n and not b.any()] == []
    experts = [m for m in model.modules() if type(m).__name__.endswith("Experts")]
    assert len(experts) == model.config.num_hidden_layers  # every layer is MoE
    assert all(p.abs().max() > 0.05 for e in experts for p in e.parameters())


def test_family_configs_exercise_routing_variants():
    assert tiny_config("qwen2_moe").norm_topk_prob is False and tiny_config("qwen3_moe").norm_topk_prob is True
    for family in ("deepseek_v3", "glm4_moe"):
        cfg = tiny_config(family)
        assert (cfg.n_group, cfg.topk_group, cfg.routed_scaling_factor) == (2, 1, 2.5)
    assert tiny_config("deepseek_v2").topk_method == "group_limited_greedy"
    assert set(tiny_config("qwen3_next").layer_types) == {"linear_attention", "full_attention"}
    assert tiny_config("mixtral", num_hidden_layers=1).num_hidden_layers == 1


def test_seed_and_dtype():
    a, b = tiny_model("mixtral", seed=1), tiny_model("mixtral", seed=1)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert not torch.equal(a.lm_head.weight, tiny_model("mixtral", seed=2).lm_head.weight)
    assert tiny_model("mixtral", dtype=torch.bfloat16).lm_head.weight.dtype == torch.bfloat16


def test_experts_implementations_agree():
    with torch.no_grad():
        ref = tiny_model("mixtral", experts_implementation="grouped_mm")(IDS).logits
        for impl in ("batched_mm", "eager"):
            model = tiny_model("mixtral", experts_implementation=impl)
            assert model.config._experts_implementation == impl
            torch.testing.assert_close(model(IDS).logits, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ["mixtral", "deepseek_v3", "gpt_oss"])
def test_family_compiles_fullgraph(family):
    _compiled_matches_eager(tiny_model(family), IDS)


def test_load_config(tmp_path):
    tiny_config("deepseek_v3").save_pretrained(tmp_path)
    for path in (tmp_path, tmp_path / "config.json", str(tmp_path / "config.json")):
        cfg = load_config(path)
        assert (cfg.model_type, cfg.hidden_size, cfg.routed_scaling_factor) == ("deepseek_v3", 32, 2.5)
    with pytest.raises(FileNotFoundError):
        load_config(tmp_path / "missing.json")


def test_moe_families_in_transformers():
    families = moe_families_in_transformers()
    assert families == sorted(families) and set(FAMILIES) <= set(families)
    assert "llama" not in families and "gpt2" not in families
    cfg = shrink_config("mixtral")
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_local_experts, cfg.vocab_size) == (32, 2, 8, 128)
    hybrid = shrink_config("qwen3_next")  # keeps one layer of each kind
    assert set(hybrid.layer_types) == {"linear_attention", "full_attention"}
    assert shrink_config("no_such_family") is None


# ------------------------------------------------------------------------------------ hand-written MoE

@pytest.mark.parametrize("kind", HANDWRITTEN)
def test_handwritten_lm(kind):
    torch.manual_seed(0)
    model = TinyMoELM(kind).eval()
    ids = torch.randint(0, 128, (2, 6))
    out = model(ids, labels=ids)
    assert out.logits.shape == (2, 6, 128) and torch.isfinite(out.logits).all()
    expected = F.cross_entropy(out.logits[:, :-1].reshape(-1, 128), ids[:, 1:].reshape(-1))
    torch.testing.assert_close(out.loss, expected)
    assert model(ids).loss is None
    block_out = model.blocks[0](torch.randn(2, 6, 32))
    assert block_out.shape == (2, 6, 32) and 1e-3 < block_out.std() < 10


@pytest.mark.parametrize("kind", HANDWRITTEN)
def test_handwritten_compiles_fullgraph(kind):
    torch.manual_seed(0)
    model, ids = TinyMoELM(kind).eval(), torch.randint(0, 128, (2, 6))
    if kind not in ("hit_loop", "counted_loop", "mask_loop"):
        _compiled_matches_eager(model, ids)
        return
    # a loop over the experts that got tokens, or one that skips those without: as written no plain backend can
    # hold it in one graph (Dynamo cannot branch on the data); the moe backend can. Once a moe compile in this
    # process gave the class its new code (it stays: tracing/loops.py), every compiler traces the rewritten loop,
    # which a plain backend then holds in one graph too, computing what eager does
    if loops.COMPILING in type(model.blocks[0]).forward.__code__.co_names:
        _compiled_matches_eager(model, ids)
    else:
        refusals = (torch._dynamo.exc.UserError, torch._dynamo.exc.Unsupported, GuardOnDataDependentSymNode)
        with pytest.raises(refusals, match="[Dd]ata.dependent"):
            _compiled_matches_eager(model, ids)
    torch._dynamo.reset()
    install()
    with torch.no_grad():
        out = torch.compile(model, backend="moe", fullgraph=True, options={"inner": "aot_eager"})(ids).logits
        torch.testing.assert_close(out, model(ids).logits, rtol=1e-5, atol=1e-5)


def test_modulelist_and_gather_compute_the_same_moe():
    torch.manual_seed(0)
    dense, gather = ModuleListMoE(32, 16, 8, 2), GatherMoE(32, 16, 8, 2)
    with torch.no_grad():
        gather.gate.weight.copy_(dense.router.weight)
        for e, expert in enumerate(dense.experts):
            gather.cond_ffn.w1[e] = expert.w1.weight
            gather.cond_ffn.w3[e] = expert.w3.weight
            gather.cond_ffn.w2[e] = expert.w2.weight
        x = torch.randn(3, 7, 32)
        torch.testing.assert_close(gather(x), dense(x), rtol=1e-5, atol=1e-6)


def _gshard_reference(block, x):
    """Token-by-token GShard: slot-major queues per expert, assignments past capacity dropped."""
    h = x.reshape(-1, x.shape[-1])
    T, E, K = h.shape[0], block.num_experts, block.top_k
    capacity = math.ceil(T * K / E * block.capacity_factor)
    weights, ids = block.gate(h).softmax(-1).topk(K, dim=-1)
    weights = weights / weights.sum(-1, keepdim=True)
    out, filled, dropped = torch.zeros_like(h), [0] * E, 0
    for k in range(K):
        for t in range(T):
            e = int(ids[t, k])
            if filled[e] < capacity:
                out[t] += weights[t, k] * (F.gelu(h[t] @ block.wi[e]) @ block.wo[e])
            else:
                dropped += 1
            filled[e] += 1
    return out.view_as(x), dropped, capacity


def test_gshard_drops_tokens_beyond_capacity():
    torch.manual_seed(0)
    x = torch.randn(2, 8, 32)
    with torch.no_grad():
        small = GShardMoE(32, 16, 8, top_k=2, capacity_factor=0.25)
        assert small.capacity_factor == 0.25
        expected, dropped, capacity = _gshard_reference(small, x)
        out = small(x)
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
        assert capacity == 1 and dropped >= 16 * 2 - 8 * capacity
        silent_tokens = int((out.reshape(16, 32) == 0).all(-1).sum())
        assert silent_tokens >= 16 - 8 * capacity  # at most E*C assignments survive

        roomy = GShardMoE(32, 16, 8, top_k=2, capacity_factor=8.0)
        roomy.load_state_dict(small.state_dict())
        expected, dropped, _ = _gshard_reference(roomy, x)
        assert dropped == 0
        torch.testing.assert_close(roomy(x), expected, rtol=1e-5, atol=1e-6)
        assert not torch.allclose(roomy(x), out)


# ----------------------------------------------------------------------------------------- bad names

def test_unknown_names_raise():
    with pytest.raises(ValueError, match="mixtral"):
        tiny_config("not_a_family")
    with pytest.raises(ValueError, match="deepseek_v3"):
        tiny_model("not_a_family")
    with pytest.raises(ValueError, match="gshard"):
        TinyMoELM("not_a_kind")
