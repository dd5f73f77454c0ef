"""End to end: backend="moe" on the tiny HF families and hand-written MoE models against eager."""

import copy

import pytest
import torch
from conftest import RecordingBackend, compile_and_compare, normwise

from moecompile.models import handwritten, hf

IDS = torch.randint(0, 128, (2, 7), generator=torch.Generator().manual_seed(0))
FORWARD_ONLY = {"qwen3_next"}  # its linear-attention backward fails under aot_autograd in torch 2.13 (not us)


def _train_step(model, ids, grads: bool):
    out = model(ids, labels=ids)
    if grads:
        out.loss.backward()
    return out.logits


def _check_against_eager(model, *, fullgraph=True, grads=True, **options):
    eager = copy.deepcopy(model)
    backend = RecordingBackend(inner="aot_eager", **options)
    compiled = torch.compile(model, backend=backend, fullgraph=fullgraph)
    got = _train_step(compiled, IDS, grads)
    want = _train_step(eager, IDS, grads)
    assert not backend.errors
    assert normwise(got, want) <= 1e-5
    if grads:
        for (name, p), q in zip(model.named_parameters(), eager.parameters()):
            if not p.requires_grad:
                continue
            if q.grad is None:  # nothing reached it in eager (a choosing bias; an expert the loop skipped, which
                # the rewritten graph gives a zero gradient)
                assert p.grad is None or not p.grad.any(), name
            else:
                assert normwise(p.grad, q.grad) <= 1e-5, name
    return backend.report


@pytest.mark.parametrize("family", sorted(hf.FAMILIES))
def test_family_rewritten_and_matches_eager(family):
    model = hf.tiny_model(family)
    report = _check_against_eager(model, grads=family not in FORWARD_ONLY)
    n_layers = model.config.num_hidden_layers
    assert report.counters["canonicalize.rewritten"] == n_layers, report.skipped
    assert not report.skipped
    assert len(report.layers) == n_layers


@pytest.mark.parametrize("kind", handwritten.HANDWRITTEN)
def test_handwritten_rewritten_and_matches_eager(kind):
    torch.manual_seed(0)
    model = handwritten.TinyMoELM(kind)
    report = _check_against_eager(model)
    assert report.counters["canonicalize.rewritten"] == 2
    spec = report.layers[0].spec
    listed = kind in ("modulelist", "loop", "hit_loop", "counted_loop", "mask_loop")
    assert (spec.experts.storage, spec.experts.num_experts, spec.routing.top_k) == (
        "modulelist" if listed else "stacked", 8, model.blocks[0].top_k)


def test_gshard_keeps_drop_semantics_without_padding():
    torch.manual_seed(0)
    model = handwritten.TinyMoELM("gshard", capacity_factor=0.5)
    report = _check_against_eager(model)
    spec = report.layers[0].spec
    assert spec.routing.capacity == 2 and spec.routing.drop_order == "slot_major"  # ceil(14 * 2 / 8 * 0.5)
    assert report.counters["canonicalize.padding_rows_removed"] == 0  # C * E = 16 < T * K = 28 rows
    assert report.counters["canonicalize.dropped_rows_kept"] == 2 * (28 - 16)  # two layers
    torch._dynamo.reset()
    roomy = _check_against_eager(handwritten.TinyMoELM("gshard", capacity_factor=2.0))
    assert roomy.counters["canonicalize.padding_rows_removed"] == 2 * (8 * 7 - 14 * 2)  # two layers, C = 7
    from moecompile.runtime.stats import DROPS

    DROPS.reset()
    backend = RecordingBackend(inner="aot_eager")
    torch.compile(model, backend=backend)(IDS)  # not fullgraph: a backend error would fall back silently
    assert not backend.errors
    drops = DROPS.snapshot()
    assert set(drops) == {"blocks.0", "blocks.1"}
    assert all(d["routed"] == 28 and d["dropped"] >= 28 - 8 * 2 for d in drops.values())  # at most C per expert


@pytest.mark.parametrize("family", sorted(hf.FAMILIES))
def test_bf16_as_accurate_as_eager(family):
    """bf16: the error to the fp32 model is no larger than eager bf16's own (reordering) error, up to 2x."""
    ref = hf.tiny_model(family)
    low = hf.tiny_model(family, dtype=torch.bfloat16)
    want = ref(IDS).logits
    eager_err = normwise(low(IDS).logits, want)
    backend = RecordingBackend(inner="aot_eager")
    got = torch.compile(low, backend=backend)(IDS).logits
    assert backend.report.counters["canonicalize.rewritten"] == 2 and not backend.errors
    assert normwise(got, want) <= 2 * eager_err + 1e-3


@pytest.mark.parametrize("family", ["mixtral", "deepseek_v3"])
def test_bare_block_compiled_on_its_own(family):
    block = hf.tiny_model(family).model.layers[0].mlp
    x = torch.randn(2, 7, 32, requires_grad=True)
    backend = RecordingBackend(inner="aot_eager")
    got = torch.compile(block, backend=backend, fullgraph=True)(x)
    want = block(x)
    assert backend.report.counters["canonicalize.rewritten"] == 1 and not backend.errors
    assert normwise(got, want) <= 1e-5
    g = torch.autograd.grad(got.sum(), x)[0]
    assert normwise(g, torch.autograd.grad(want.sum(), x)[0]) <= 1e-5


def test_dynamic_shapes_and_single_token():
    model = hf.tiny_model("mixtral")
    backend = RecordingBackend(inner="aot_eager")
    compiled = torch.compile(model, backend=backend, dynamic=True)
    for shape in [(2, 7), (1, 1), (3, 5), (1, 13)]:
        ids = torch.randint(0, 128, shape)
        assert normwise(compiled(ids).logits, model(ids).logits) <= 1e-5
    assert not backend.errors
    assert backend.report.counters["canonicalize.rewritten"] >= 2


def test_all_tokens_on_one_expert_and_topk_equal_to_experts():
    model = hf.tiny_model("gpt_oss")
    for layer in model.model.layers:
        layer.mlp.router.bias.data[3] = 100.0  # every token's first choice is expert 3
    _check_against_eager(model)
    _check_against_eager(hf.tiny_model("qwen3_moe", num_experts_per_tok=8))


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_training_with_the_router_aux_loss_as_eager(family):
    """``output_router_logits=True``: the load-balancing loss reads every router's logits (transformers records
    them with a hook on the router) beside the routing; every layer still rewritten, loss and gradients as eager.
    Not in one graph: transformers enters a lock to record them, which Dynamo breaks the graph at (as plain
    ``torch.compile`` does; with ``fullgraph=True`` both refuse)."""
    model = hf.tiny_model(family, output_router_logits=True, router_aux_loss_coef=0.5)
    assert copy.deepcopy(model)(IDS, labels=IDS).aux_loss > 0  # the loss has the term
    report = _check_against_eager(model, fullgraph=False)
    assert report.counters["canonicalize.rewritten"] == model.config.num_hidden_layers, report.skipped


def test_generate_gives_same_tokens():
    model = hf.tiny_model("mixtral")
    prompt = torch.randint(0, 128, (1, 5))
    want = model.generate(prompt, max_new_tokens=6, do_sample=False)
    model.forward = torch.compile(model.forward, backend=RecordingBackend(inner="aot_eager"), dynamic=True)
    got = model.generate(prompt, max_new_tokens=6, do_sample=False)
    assert torch.equal(got, want)


@pytest.mark.slow
def test_inductor_with_transposed_experts_and_changing_shapes():
    """Inductor checks the strides our fake functions promise: GShard's experts are transposed views."""
    torch.manual_seed(0)
    model = handwritten.TinyMoELM("gshard")
    eager = copy.deepcopy(model)
    backend = RecordingBackend(inner="inductor")
    compiled = torch.compile(model, backend=backend)
    for shape in [(2, 7), (1, 5), (3, 9)]:
        ids = torch.randint(0, 128, shape)
        assert normwise(_train_step(compiled, ids, True), _train_step(eager, ids, True)) <= 1e-5
        for p, q in zip(model.parameters(), eager.parameters()):
            assert normwise(p.grad, q.grad) <= 1e-5
    assert not backend.errors and backend.report.counters["canonicalize.rewritten"] >= 2


@pytest.mark.slow
def test_inductor_default_trains_like_eager():
    model = hf.tiny_model("qwen2_moe")
    eager = copy.deepcopy(model)
    compiled = torch.compile(model, backend="moe", fullgraph=True)  # the string: entry point, Inductor inner
    assert normwise(_train_step(compiled, IDS, True), _train_step(eager, IDS, True)) <= 1e-5
    for p, q in zip(model.parameters(), eager.parameters()):
        assert normwise(p.grad, q.grad) <= 1e-5


@pytest.mark.parametrize("family, block", [
    # the block returns post_mlp_layernorm(routed + shared), an RMSNorm written out: detect walks back through
    # the norm and the shared add to the routed sum; both stay in the graph as written
    ("axk1", "AXK1MoE"),
    # softcapped SwiGLU experts, softcap(gate, 4) * sigmoid(gate) * softcap(up, 25), in a nonzero() loop
    ("inkling2_text", "Inkling2SparseMoeBlock"),
    # routers kept as written, their scores not moe.route's: Inkling's scores the shared experts beside the routed
    # ones and normalises the chosen and the shared together; ZAYA's is an MLP over [B, S, E + 1] scores, the last
    # class a skip (weight 0)
    ("inkling_text", "InklingMoE"),
    ("zaya", "ZayaSparseMoeBlock"),
])
def test_walked_family_rewritten_with_every_gradient(family, block):
    torch.manual_seed(0)
    model = hf.build_model(hf.walk_config(family)).train()
    report = _check_against_eager(model, fullgraph=False)
    n_moe = sum(type(m).__name__ == block for m in model.modules())
    assert n_moe and len(report.layers) == n_moe, report.skipped


def test_identity_experts_pass_the_token_through():
    """LongCat-Flash: the router scores 8 experts with weights and 2 zero-computation ones, which return the token
    times its weight; gate/up keeps rows for them that are never read. The correction bias makes the last identity
    expert every token's first choice and the other never chosen, so each token takes both paths; logits and every
    gradient."""
    torch.manual_seed(0)
    model = hf.build_model(hf.shrink_config("longcat_flash")).train()
    routed = model.config.n_routed_experts
    for layer in model.model.layers:
        layer.mlp.router.e_score_correction_bias[routed:] = torch.tensor([-10.0, 10.0])
    report = _check_against_eager(model, fullgraph=False)
    assert len(report.layers) == len(model.model.layers), report.skipped
    e = report.layers[0].spec.experts
    assert (e.num_experts, e.identity_experts) == (routed, model.config.zero_expert_num)


def test_hash_routing_kept_and_sqrt_softplus_router_rewritten():
    """DeepSeek-V4: its first MoE layer takes the experts from a token-id table (``tid2eid[input_ids]``, hash
    routing) and is kept as written, only the experts rewritten; the next routes by sqrt(softplus(logits)) with a
    correction bias, rewritten whole. Both clamp their SwiGLU (silu(min(gate, L)) * clamp(up, -L, L)), here at a
    limit the tokens reach. Logits and every gradient as eager, in float64: the model's hyper-connection head
    amplifies float32 rounding past 1e-5 in its own gradient (1.3e-5 with two threads), rewrite or not. The
    experts run as batched matmuls (transformers' grouped_mm takes no float64)."""
    torch.manual_seed(0)
    config = hf.shrink_config("deepseek_v4")
    config.swiglu_limit = 0.05
    model = hf.build_model(config, dtype=torch.float64, experts_implementation="batched_mm").train()
    E, K = config.num_local_experts, config.num_experts_per_tok
    table = torch.rand(config.vocab_size, E).argsort(-1)[:, :K]  # K distinct experts per token id
    for layer in model.model.layers:
        if layer.mlp.is_hash:
            layer.mlp.gate.tid2eid.copy_(table)
    report = compile_and_compare(model, IDS)  # (attention's compressor bias gets no gradient at this length)
    specs = {r.path: r.spec for r in report.layers}
    assert len(specs) == len(model.model.layers) == 2, report.skipped
    hashed, learned = specs["model.layers.0.mlp"], specs["model.layers.1.mlp"]
    assert hashed.routing.kept.startswith("takes its expert ids from a table")
    assert learned.routing.score_fn == "sqrtsoftplus" and not learned.routing.kept
    assert {hashed.experts.activation, learned.experts.activation} == {"silu_clamp"}
    assert hashed.experts.limit == 0.05


def test_router_and_experts_beside_attention_in_one_layer():
    """Gemma 4: router and experts are children of the decoder layer itself, next to attention and a dense MLP;
    the experts read the layer input normed apart from the router's, and the router scales its weights per
    expert (per_expert_scale[ids]). The block is cut at the experts' input and their output, and the router is
    kept as written; logits and every gradient as eager."""
    torch.manual_seed(0)
    model = hf.build_model(hf.walk_config("gemma4_text")).train()
    report = _check_against_eager(model, fullgraph=False)
    assert len(report.layers) == model.config.num_hidden_layers, report.skipped
    spec = report.layers[0].spec
    assert spec.routing.kept.startswith("scales its weights per expert") and spec.block_type == "Gemma4TextDecoderLayer"


def test_eager_experts_without_capture_reported_with_fix_and_not_miscompiled():
    """With capture off, the experts' nonzero() loop breaks the graph: reported with the fix, output unchanged (with
    the default, the loop is rewritten: tests/test_loops.py)."""
    import moecompile

    model = hf.tiny_model("mixtral", experts_implementation="eager")
    report = moecompile.explain(model, IDS, capture=False)
    assert not report.layers and report.num_graphs > 1
    assert any("experts_implementation='grouped_mm'" in s.reason for s in report.skipped)
    compiled = torch.compile(model, backend=RecordingBackend(inner="aot_eager", capture=False))
    assert normwise(compiled(IDS).logits, model(IDS).logits) <= 1e-5


def test_mixtral_training_jitter_and_dropout_match_eager():
    """Mixtral in train() with router jitter (``hidden_states *= uniform_(1 - eps, 1 + eps)``, in place on the
    block's input, before the router) and attention dropout: the jitter stays in the graph as written, outside the
    rewritten block, whose token input is the jittered tensor; same seed, same logits and gradients as eager, and
    a different seed really draws differently."""
    model = hf.tiny_model("mixtral", router_jitter_noise=0.3, attention_dropout=0.3).train()
    eager = copy.deepcopy(model)
    backend = RecordingBackend(inner="aot_eager")
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    torch.manual_seed(1)
    got = _train_step(compiled, IDS, True)
    torch.manual_seed(1)
    want = _train_step(eager, IDS, True)
    assert normwise(got, want) <= 1e-5
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        assert normwise(p.grad, q.grad) <= 1e-5, name
    torch.manual_seed(2)
    assert normwise(_train_step(eager, IDS, False), want) > 1e-3  # training really draws
    report = backend.report
    assert not backend.errors and not report.skipped and len(report.layers) == 2
    assert not report.counters["detect.router_kept"]  # the jitter is not the router's: routing is proved as usual


@pytest.mark.parametrize("mode,lowering", [("eval", "torch"), ("train", "torch"), ("train", "triton")])
def test_phimoe_in_train_and_eval_mode_matches_eager(mode, lowering):
    """eval(): the sparsemixer routing is proved and rewritten. train(): it samples its experts (Gumbel noise) and
    draws Heun's multiplier mask, so it is no function of the tokens: the model's own router stays in the graph,
    drawing the same random numbers in the same order as eager (same seed, same outputs and gradients, its custom
    backward included), and only the experts, proved on random routings, are rewritten (and lowered to the
    Triton kernels, in the interpreter here, after their own proof on random routings)."""
    model = getattr(hf.tiny_model("phimoe", router_jitter_noise=0.5), mode)()  # a wide window: sampling picks
    eager = copy.deepcopy(model)
    backend = RecordingBackend(inner="aot_eager", lowering=lowering)
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    for seed in (1, 2):
        torch.manual_seed(seed)
        got = _train_step(compiled, IDS, True)
        torch.manual_seed(seed)
        want = _train_step(eager, IDS, True)
        assert normwise(got, want) <= 1e-5
        for (name, p), q in zip(model.named_parameters(), eager.parameters()):
            assert normwise(p.grad, q.grad) <= 1e-5, name
        if seed == 1:
            first = want.detach()
    assert (normwise(want, first) > 1e-3) == (mode == "train")  # training really samples
    report = backend.report
    assert not backend.errors and not report.failures
    if mode == "eval":
        assert len(report.layers) == 2 and not report.skipped
    else:
        assert len(report.layers) == 2 and not report.skipped and report.counters["detect.router_kept"] == 2
        assert all(rec.spec.routing.kept == "draws random numbers" and rec.spec.routing.top_k == 2
                   for rec in report.layers)
        assert "route: kept: the model's own router (draws random numbers)" in report.layers[0].spec.summary()
    if lowering == "triton":
        assert report.counters["lower.proved"] == 2 and all(r.lowering == "triton" for r in report.layers)
