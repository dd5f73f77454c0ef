"""Pass units on small captured graphs: what each pass leaves behind (the invariants of passes/README.md)."""

import dataclasses

import pytest
import torch

from moecompile.config import MoEOptions
from moecompile.models import handwritten
from moecompile.passes.canonicalize import canonicalize_moe_pass
from moecompile.passes.detect import detect_moe_pass
from moecompile.passes.graph_utils import moe_op_name, op_name
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
    report = verify_edited(gm, ex, experts=dict(activation="gelu"))
    assert not annotated(gm) and report.counters["verify.rejected"] == 1
    assert "no candidate spec reproduced the block" in report.skipped[0].reason


class ClampedExperts(torch.nn.Module):
    """DeepSeek-V4's clamped SwiGLU, silu(min(g, 7)) * clamp(u, -7, 7), in gathered experts whose projections
    stay far below 7 on unit tokens."""

    def __init__(self, E=8, H=32, I=16):
        super().__init__()
        self.gate = torch.nn.Linear(H, E, bias=False)
        self.w1, self.w3 = (torch.nn.Parameter(torch.randn(E, I, H) * 0.1) for _ in range(2))
        self.w2 = torch.nn.Parameter(torch.randn(E, H, I) * 0.1)

    def forward(self, x):
        h = x.reshape(-1, x.shape[-1])
        w, ids = self.gate(h).softmax(-1).topk(2, dim=-1)
        g = torch.einsum("th,tkih->tki", h, self.w1[ids]).clamp(max=7.0)
        u = torch.einsum("th,tkih->tki", h, self.w3[ids]).clamp(-7.0, 7.0)
        y = torch.einsum("tki,tkhi->tkh", torch.nn.functional.silu(g) * u, self.w2[ids])
        return (y * w[..., None]).sum(1).view_as(x)


def test_verify_probes_past_a_clamp_so_a_wrong_bound_is_refused():
    """Unit tokens never reach the clamp, where a plain SwiGLU or another limit equals the right one; the proof's
    extra round of tokens scaled past the largest bound refuses both, whatever order they come in."""
    torch.manual_seed(0)
    gm, ex = capture(ClampedExperts(), torch.randn(2, 5, 32))
    report = PassReport()
    detect_moe_pass(gm, ex, config=CONFIG, report=report)
    cand = annotated(gm)[0].meta["moe"]
    right = next(s for s in cand.specs if s.experts.activation == "silu_clamp")
    assert right.experts.limit == 7.0
    cand.specs = [right.replace(experts=dataclasses.replace(right.experts, **wrong))
                  for wrong in (dict(activation="silu"), dict(limit=6.0))] + [right]
    cand.bindings = [cand.bindings[cand.specs.index(right)]] * 3
    verify_moe_pass(gm, ex, config=CONFIG, report=report)
    (layer,) = report.layers
    assert layer.spec == right and layer.candidates_tried == 3


def verify_edited(gm, ex, **edits) -> PassReport:
    """detect, then every candidate spec of the first block with fields changed (``experts=dict(activation=
    "gelu")``: a spec that misreads the block), then verify: its report."""
    report = PassReport()
    detect_moe_pass(gm, ex, config=CONFIG, report=report)
    cand = annotated(gm)[0].meta["moe"]
    cand.specs = [s.replace(**{part: dataclasses.replace(getattr(s, part), **fields) for part, fields in edits.items()})
                  for s in cand.specs]
    verify_moe_pass(gm, ex, config=CONFIG, report=report)
    return report


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
    # lowering="grouped" (the tests' default, conftest.py): the expert MLP as grouped GEMMs keeping its projections
    assert {moe_op_name(n) for n in moe_nodes} >= {"route", "build_pft", "expert_mlp_keep", "combine"}
    assert all(n.meta["moe_lowering"] == "grouped" for n in moe_nodes)
    assert not annotated(gm) and report.layers[0].lowering == "grouped"
    assert any("grouped GEMMs" in note for note in report.layers[0].lowering_notes)
    torch.testing.assert_close(gm(*ex), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("lowering,grouped_mm_takes_it,keep", [("torch", True, False), ("grouped", False, False),
                                                                ("grouped", True, True)])
def test_cpu_expert_mlp_form_and_its_gradients(lowering, grouped_mm_takes_it, keep, monkeypatch):
    """lowering="torch" keeps moe::expert_mlp (it runs its forward again in backward); so does a layer whose dtype
    or sizes grouped_mm does not take, saying why; the kept-projection form trains like the block itself."""
    from moecompile.runtime import grouped_cpu

    if not grouped_mm_takes_it:
        monkeypatch.setattr(grouped_cpu, "usable_sizes", lambda *a: False)
    torch.manual_seed(0)
    block = handwritten.TinyMoELM("modulelist").blocks[0]
    x = torch.randn(2, 5, 32, requires_grad=True)
    gm, ex = capture(block, x)
    report = PassReport()
    config = dataclasses.replace(CONFIG, lowering=lowering)
    for p in (detect_moe_pass, verify_moe_pass, canonicalize_moe_pass, lower_moe_pass):
        gm = p(gm, ex, config=config, report=report)
    gm.recompile()
    targets = {moe_op_name(n) for n in gm.graph.nodes}
    assert ("expert_mlp_keep" in targets) == keep and ("expert_mlp" in targets) != keep, targets
    notes = " ".join(report.layers[0].lowering_notes)
    assert ("torch loop over experts (grouped_mm takes neither" in notes) == (not grouped_mm_takes_it)
    (out,) = gm(*ex)
    want = block(x)
    torch.testing.assert_close(out, want)
    grads = torch.autograd.grad(out.square().sum(), [x, *block.parameters()])
    for got, exp in zip(grads, torch.autograd.grad(want.square().sum(), [x, *block.parameters()])):
        torch.testing.assert_close(got, exp)


def test_strict_pass_failure_names_the_pass_and_those_before(monkeypatch):
    """strict=True: a pass that raises stops compilation (without it the graph runs as it came in: test_fallback)."""
    from moecompile import pipeline

    def broken(gm, example_inputs, *, config, report):
        raise RuntimeError("boom")

    monkeypatch.setattr(pipeline, "PASSES", tuple((n, broken if n == "verify" else f) for n, f in pipeline.PASSES))
    gm, ex = block_graph()
    with pytest.raises(MoECompileError, match=r"pass 'verify' failed \(after \['expose_sharded', 'detect'\]\): boom"):
        pipeline.run_passes(gm, ex, dataclasses.replace(CONFIG, strict=True), PassReport())


def test_a_graph_without_moe_is_left_alone():
    mlp = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.SiLU(), torch.nn.Linear(16, 8))
    gm, ex = capture(mlp, torch.randn(3, 8))
    before = gm.code
    report = PassReport()
    for p in (detect_moe_pass, verify_moe_pass, canonicalize_moe_pass, lower_moe_pass):
        gm = p(gm, ex, config=CONFIG, report=report)
    assert gm.code == before and not report.layers and not report.skipped


class _SampledRouterMoE(handwritten.ModuleListMoE):
    """ModuleList experts behind a router that, in train(), samples its top-2 with Gumbel noise (as PhiMoE's
    sparsemixer does) and, with ``expert_noise``, experts that draw random numbers too."""

    def __init__(self, expert_noise=False):
        super().__init__(32, 16, 8, 2)
        self.expert_noise = expert_noise

    def forward(self, x):
        h = x.reshape(-1, x.shape[-1])
        logits = self.router(h)
        noisy = logits - torch.empty_like(logits).exponential_().log() if self.training else logits
        ids = noisy.topk(2, dim=-1).indices
        weights = logits.softmax(-1).gather(-1, ids)
        out = torch.zeros_like(h)
        for e, expert in enumerate(self.experts):
            y = expert(h) * (torch.rand_like(h) > 0.1) if self.expert_noise else expert(h)
            out = out + torch.where(ids == e, weights, torch.zeros_like(weights)).sum(-1)[:, None] * y
        return out.view_as(x)


def _sampled_block_graph(**kw):
    torch.manual_seed(0)
    block = _SampledRouterMoE(**kw).train()
    x = torch.randn(2, 5, 32, requires_grad=True)
    gm, ex = capture(block, x)
    return block, x, gm, ex


def test_a_router_that_draws_random_numbers_is_kept_and_its_experts_proved_on_random_routings(monkeypatch):
    block, x, gm, ex = _sampled_block_graph()
    report = PassReport()
    detect_moe_pass(gm, ex, config=CONFIG, report=report)
    cand = annotated(gm)[0].meta["moe"]
    b = cand.bindings[0]
    assert report.counters["detect.router_kept"] == 1 and cand.specs[0].routing.kept == "draws random numbers"
    assert (op_name(b.topk_ids), op_name(b.topk_weights), cand.specs[0].routing.top_k) == ("getitem", "gather", 2)

    from moecompile.passes import verify

    probed = []
    real_probe = verify._probe_inputs
    monkeypatch.setattr(verify, "_probe_inputs", lambda *a: probed.append(real_probe(*a)) or probed[-1])
    verify_moe_pass(gm, ex, config=CONFIG, report=report)
    assert report.counters["verify.proved"] == 1 and report.layers[0].max_error <= 1e-5
    routings = [next(t for t in inputs if isinstance(t, torch.Tensor) and t.dtype == torch.int64) for inputs in probed]
    for ids in routings:  # the probes: random routings, K distinct experts per token
        assert ids.shape == (10, 2) and (ids[:, 0] != ids[:, 1]).all() and 0 <= ids.min() and ids.max() < 8
    assert len({tuple(ids.flatten().tolist()) for ids in routings}) > 1

    canonicalize_moe_pass(gm, ex, config=CONFIG, report=report)
    gm.graph.lint()
    gm.recompile()
    names = [op_name(n) for n in gm.graph.nodes]
    assert names.count("exponential_") == 1 and "topk" in names and "gather" in names  # the router as it was
    moe_ops = {str(n.target) for n in gm.graph.nodes if n.meta.get("moe_layer")}
    assert "silu" not in names and "moe.route" not in moe_ops
    assert {"moe.build_pft", "moe.expert_mlp", "moe.combine"} <= moe_ops
    params = dict(block.named_parameters())
    for seed in (1, 2):  # the same random stream: the same sampled experts, outputs and gradients
        torch.manual_seed(seed)
        want = block(x)
        g_want = torch.autograd.grad(want.square().sum(), [x, *params.values()])
        torch.manual_seed(seed)
        got = gm(*[x if t is ex[0] else t for t in ex])
        got = got[0] if isinstance(got, (tuple, list)) else got
        g_got = torch.autograd.grad(got.square().sum(), [x, *params.values()], allow_unused=True)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        for name, a, w in zip(["x", *params], g_got, g_want):
            torch.testing.assert_close(a, w, rtol=1e-5, atol=1e-6, msg=name)


def test_a_kept_router_still_proves_its_experts_and_random_experts_are_refused():
    _, _, gm, ex = _sampled_block_graph()
    report = verify_edited(gm, ex, experts=dict(activation="gelu"))
    assert not annotated(gm) and "no candidate spec reproduced the block" in report.skipped[0].reason

    _, _, gm, ex = _sampled_block_graph(expert_noise=True)  # random draws in the experts: nothing to keep apart
    report = PassReport()
    detect_moe_pass(gm, ex, config=CONFIG, report=report)
    verify_moe_pass(gm, ex, config=CONFIG, report=report)
    assert not annotated(gm) and not report.counters["detect.router_kept"]
    assert report.skipped[0].reason.startswith("the block draws random numbers (exponential_, rand_like)")


def test_layers_of_one_code_and_shapes_share_one_proof():
    """A layer whose cut-out code, input shapes and candidate specs equal an earlier layer's in the graph is proved
    by that layer's proof (and says so), as the same layer is after training changed its weights; another width or
    another top-k is proved on its own. The compiled stack equals eager, forward and backward."""
    import copy

    from conftest import RecordingBackend, normwise
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    def block(inter, k):
        cfg = MixtralConfig(hidden_size=32, intermediate_size=inter, num_local_experts=4, num_experts_per_tok=k)
        cfg._experts_implementation = "grouped_mm"  # a model's default; a bare block has no model to set it
        return MixtralSparseMoeBlock(cfg)

    torch.manual_seed(0)
    stack = torch.nn.Sequential(block(16, 2), block(16, 2), block(24, 2), block(16, 1))
    with torch.no_grad():
        for p in stack.parameters():  # a bare block's weights are left as allocated
            p.normal_(0, 0.2)
    x = torch.randn(2, 6, 32, requires_grad=True)
    eager = copy.deepcopy(stack)
    backend = RecordingBackend(inner="aot_eager")
    got = torch.compile(stack, backend=backend)(x)
    want = eager(x)
    assert not backend.errors, backend.errors
    layers = backend.report.layers
    names = [r.path for r in layers]
    assert [n.rsplit(".", 1)[-1] for n in names] == ["0", "1", "2", "3"], names
    assert [r.proved_as for r in layers] == ["", names[0], "", ""]
    assert backend.report.counters["verify.proved"] == 4 and backend.report.counters["verify.reused"] == 1
    assert normwise(got, want) <= 1e-5
    g = torch.randn_like(want)
    got.backward(g)
    x_grad, x.grad = x.grad, None
    want.backward(g)
    assert normwise(x_grad, x.grad) <= 1e-5
    for (name, p), q in zip(stack.named_parameters(), eager.parameters()):
        assert normwise(p.grad, q.grad) <= 1e-5, name
