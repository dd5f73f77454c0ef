"""Frozen weights (``requires_grad_(False)``: fine-tuning the rest of a model, LoRA adapters beside the experts): the
expert MLP's backward ops compute only the gradients autograd asks for (``ctx.needs_input_grad``), so a frozen
weight's gradient GEMM is not run, in every form (torch references, grouped GEMMs, the Triton kernels) and through
a compiled graph; ``lowering="auto"`` times the layer as it trains (frozen weights probed without gradients, its own
cache entry); ``explain()`` traces in the caller's grad mode."""

import copy

import pytest
import torch

import moecompile
from moecompile.models import hf
from moecompile.passes import forms
from moecompile.passes.forms import FormCache
from moecompile.runtime import ops  # noqa: F401  (registers the moe:: ops)
from moecompile.tracing.capture import install

from conftest import RecordingBackend, normwise

T, H, I, E, K = 12, 16, 32, 4, 2
NAMES = ("x", "w_gate", "w_up", "w_down")
# the GEMMs a backward of the gated expert MLP runs for each input's gradient: dx two (through gate and up), each
# weight one; the rest (dh = dy @ W_down, and the torch form's forward again) run whatever is frozen
SKIPPED = {"x": 2, "w_gate": 1, "w_up": 1, "w_down": 1}
FROZEN = [(), ("w_gate", "w_up", "w_down"), ("x",), ("w_down",), ("w_gate", "w_up")]


def _case():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, E, (T * K,), generator=g)
    order = ids.argsort(stable=True)
    tok = torch.arange(T).repeat_interleave(K)[order]
    counts = torch.bincount(ids, minlength=E)
    tensors = {"x": torch.randn(T, H, generator=g), "w_gate": torch.randn(E, I, H, generator=g) / 4,
               "w_up": torch.randn(E, I, H, generator=g) / 4, "w_down": torch.randn(E, H, I, generator=g) / 6}
    return tok, counts, tensors, torch.rand(T * K, generator=g)


def _leaves(tensors, frozen=()):
    return {k: t.clone().requires_grad_(k not in frozen) for k, t in tensors.items()}


def _grouped_mms(fn) -> int:
    """How many ``aten::_grouped_mm`` ``fn()`` runs (the profiler sees inside the opaque moe ops)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return sum(1 for e in prof.events() if e.name == "aten::_grouped_mm")


@pytest.mark.parametrize("op", ["expert_mlp", "expert_mlp_keep"])
def test_frozen_inputs_get_no_gradient_and_their_gemms_do_not_run(op):
    """torch form (``moe::expert_mlp``, its backward a vjp of the reference) and grouped form
    (``moe::expert_mlp_keep``, its backward from the kept projections): the gradients of what is not frozen equal
    those of the run with every input trained, bit for bit; a frozen input's is None and its GEMMs are not run."""
    tok, counts, tensors, _ = _case()
    attrs = ("silu", 1.702, 7.0)
    runs = {}
    for frozen in FROZEN:
        t = _leaves(tensors, frozen)
        out = getattr(torch.ops.moe, op)(t["x"], tok, counts, t["w_gate"], t["w_up"], t["w_down"], None, None, None,
                                         None, *attrs)
        y = out[0] if isinstance(out, (tuple, list)) else out
        grad = torch.randn(y.shape, generator=torch.Generator().manual_seed(1))
        runs[frozen] = _grouped_mms(lambda: y.backward(grad)), {k: v.grad for k, v in t.items()}
    everything, want = runs[()]
    for frozen, (gemms, grads) in runs.items():
        assert gemms == everything - sum(SKIPPED[k] for k in frozen), (frozen, gemms, everything)
        for k in NAMES:
            assert (grads[k] is None) if k in frozen else torch.equal(grads[k], want[k]), (frozen, k)


def test_the_backward_ops_refuse_flags_that_do_not_match_their_inputs():
    tok, counts, t, _ = _case()
    with pytest.raises(ValueError, match="needs has 3 flags for 8 inputs"):
        torch.ops.moe.expert_mlp_backward(torch.ones(T * K, H), t["x"], tok, counts, t["w_gate"], t["w_up"],
                                          t["w_down"], None, None, None, None, "silu", 1.702, 7.0, [True] * 3)


@pytest.mark.parametrize("fused", [False, True])
def test_the_triton_backward_launches_no_weight_gradient_kernel_for_frozen_weights(fused, monkeypatch):
    """``moe::fused_experts_keep`` under Triton's interpreter: a weight-gradient kernel (gate/up in one launch,
    down in another) runs only where one of its weights trains, the dx kernel only where x takes a gradient (no
    scale here, and no down bias whose share of the combine weights' gradient it computes); the other gradients as
    with every input trained.
    ``fused``: one [E, 2I, H] gate/up weight (a fused parameter's layout), frozen or not as a whole."""
    from moecompile.runtime import kernels

    kernels.load()
    from moecompile.runtime import triton_ops  # noqa: F401  (registers the moe::*_triton ops)
    from moecompile.runtime.kernels import grouped_wgrad

    from moecompile.runtime.kernels import grouped_mlp_bwd

    launched = []
    real, real_role = grouped_wgrad.wgrad, grouped_mlp_bwd.run_role
    monkeypatch.setattr(grouped_wgrad, "wgrad", lambda role, *a, **kw: launched.append(role) or real(role, *a, **kw))
    monkeypatch.setattr(grouped_mlp_bwd, "run_role",
                        lambda role, *a, **kw: launched.append(role) or real_role(role, *a, **kw))
    tok, counts, tensors, cw = _case()
    if fused:
        tensors["w_gate_up"] = torch.cat([tensors.pop("w_gate"), tensors.pop("w_up")], dim=1)
    cases = [(), ("w_gate_up", "w_down") if fused else ("w_gate", "w_up", "w_down"), ("w_down",),
             ("w_gate_up",) if fused else ("w_gate", "w_up"), ("x",)]
    runs = {}
    for frozen in cases:
        t = _leaves({**tensors, "combine_weights": cw}, frozen)  # the router's weights: trained throughout
        gate_up = dict(w_gate_up=t["w_gate_up"], gate_up_layout="chunk") if fused else {}
        out, _ = torch.ops.moe.fused_experts_keep(t["x"], tok, counts, t["combine_weights"], t.get("w_gate"),
                                                  t.get("w_up"), t["w_down"], None, None, None, None, "silu", 1.702,
                                                  7.0, T, **gate_up)
        launched.clear()
        out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(1)))
        runs[frozen] = list(launched), {k: v.grad for k, v in t.items()}
    _, want = runs[()]
    for frozen, (kernels_run, grads) in runs.items():
        up_frozen = {"w_gate_up"} <= set(frozen) or {"w_gate", "w_up"} <= set(frozen)
        assert kernels_run == ["dh_kept"] + ([] if "x" in frozen else ["dx"]) + (
            [] if up_frozen else ["wgrad_up"]) + ([] if "w_down" in frozen else ["wgrad_down"]), (frozen, kernels_run)
        for k, g in grads.items():
            assert (g is None) if k in frozen else torch.allclose(g, want[k], rtol=1e-5, atol=1e-6), (frozen, k)


def _freeze(model, which):
    for name, p in model.named_parameters():
        in_moe = ".mlp." in name
        if (which == "experts" and ".mlp.experts." in name) or (which == "moe" and in_moe) or (
                which == "rest" and not in_moe):
            p.requires_grad_(False)


def _trained(family, which, ids):
    """``family``'s tiny model with ``which`` frozen, compiled with the grouped form and trained one step beside
    an eager copy: loss and every gradient as eager, frozen weights without one. Returns the grouped GEMMs the
    compiled backward ran."""
    model = hf.tiny_model(family)
    _freeze(model, which)
    eager = copy.deepcopy(model)
    backend = RecordingBackend(inner="aot_eager", lowering="grouped")
    compiled = torch.compile(model, backend=backend)
    torch.manual_seed(0)
    loss = compiled(ids, labels=ids).loss
    gemms = _grouped_mms(loss.backward)
    torch.manual_seed(0)
    want = eager(ids, labels=ids).loss
    want.backward()
    assert not backend.errors and len(backend.report.layers) == 2, (which, backend.report.skipped)
    assert normwise(loss, want) <= 1e-6
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        assert (p.grad is None) == (q.grad is None) == (not p.requires_grad), (which, name)
        assert p.grad is None or normwise(p.grad, q.grad) <= 1e-5, (which, name)
    torch._dynamo.reset()
    install()  # reset() dropped Dynamo's compile callbacks
    return gemms


def test_a_model_with_frozen_experts_trains_like_eager_without_their_gradient_gemms():
    """Mixtral with its routed experts frozen, its MoE layers frozen (as LoRA on attention leaves them), or only
    its MoE layers trained: as eager; with the routed experts frozen the compiled backward runs 2 grouped GEMMs
    fewer per layer than with them trained (the fused gate/up weight's and the down weight's: AOTAutograd hands
    the ops the flags). DeepSeek-V3 (shared experts still trained) and gpt-oss (expert biases, interleaved gate/up)
    with their routed experts frozen: as eager."""
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    gemms = {which: _trained("mixtral", which, ids) for which in ("none", "experts", "moe", "rest")}
    assert gemms["experts"] == gemms["none"] - 2 * 2, gemms
    for family in ("deepseek_v3", "gpt_oss"):
        _trained(family, "experts", ids)


def test_auto_times_frozen_experts_without_their_gradients(tmp_path, monkeypatch):
    """``lowering="auto"`` on a layer whose routed experts are frozen: it still times forward+backward (the rest
    trains), with no probe of an expert weight taking a gradient, under a cache key of its own; ``explain()`` in
    the caller's grad mode reports the same timing as the compile (it traced without gradients before, so it
    timed the forward alone), and under ``torch.no_grad()`` the forward alone."""
    fresh = FormCache(tmp_path)
    monkeypatch.setattr(forms, "cache", lambda: fresh)
    leaves = []
    real = forms._call
    monkeypatch.setattr(forms, "_call", lambda gm, args, lv: leaves.append([tuple(t.shape) for t in lv])
                        or real(gm, args, lv))
    model = hf.tiny_model("mixtral")
    block = model.model.layers[0].mlp
    experts = {tuple(p.shape) for p in block.experts.parameters()}
    x = torch.randn(1, 16, model.config.hidden_size, requires_grad=True)
    keys = []
    for frozen in (False, True):
        block.experts.requires_grad_(not frozen)
        leaves.clear()
        note = " ".join(moecompile.explain(block, x, lowering="auto").layers[0].lowering_notes)
        assert "measured (forward+backward at 16 tokens" in note, note
        timed = {s for call in leaves for s in call}
        assert (timed & experts == set()) == frozen, (frozen, timed)
        keys.append(fresh.keys(torch.device("cpu")))
    assert keys[0] == keys[1][:1] and len(keys[1]) == 2, keys
    with torch.no_grad():
        note = " ".join(moecompile.explain(block, x, lowering="auto").layers[0].lowering_notes)
    assert "(forward at 16 tokens" in note, note
