"""The lower pass end to end: lowering="triton" on tiny HF and hand-written models (kernels in Triton's
interpreter on CPU) matches eager forward and backward; "auto" keeps the torch references on CPU; explain()
shows the choice per layer and what stayed on torch."""

import os
import subprocess
import sys

import pytest
import torch
from conftest import RecordingBackend, normwise
from test_families import IDS, _check_against_eager

import moecompile
from moecompile.models import handwritten, hf
from moecompile.passes import forms
from moecompile.runtime.kernels.common import interpreting

# these compile CPU models with lowering="triton": the kernels run in the interpreter (conftest switches it on)
pytestmark = pytest.mark.skipif(not interpreting(), reason="needs TRITON_INTERPRET=1 (CPU tensors)")

LOWERED_OPS = ("moe.route_triton", "moe.build_pft_triton", "moe.fused_experts")


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "deepseek_v3", "gpt_oss", "llama4_text", "granitemoe"])
def test_triton_lowering_matches_eager(family):
    report = _check_against_eager(hf.tiny_model(family), lowering="triton")
    assert report.layers and all(r.lowering == "triton" and not r.lowering_notes for r in report.layers)
    n = len(report.layers)
    assert report.counters["lower.triton"] == n
    # it trains: the fused expert op keeps its projections for backward
    ops = ("route_triton", "build_pft_triton", "fused_experts_keep")
    assert all(report.counters[f"lower.ops.{op}"] == n for op in ops) and not report.counters["lower.ops.fused_experts"]
    # the kernels were proved on probe inputs beside the references before they were used
    assert report.counters["lower.proved"] == n and all(r.lowering_error <= 1e-5 for r in report.layers)


def test_kernels_that_disagree_with_the_references_are_not_used(monkeypatch):
    """A kernel that computes something else (here: a grouped MLP off by 1%, then one that raises) fails the
    probe check: the layer keeps the torch references, says so, and the model still matches eager."""
    from moecompile.runtime import kernels

    grouped = kernels.load()["grouped_mlp"]
    right = grouped.fused_experts
    def off(*a, **k):  # (with keep=True, as training runs it: the output and the kept projections)
        r = right(*a, **k)
        return (r[0] * 1.01, r[1]) if isinstance(r, tuple) else r * 1.01

    monkeypatch.setattr(grouped, "fused_experts", off)
    report = _check_against_eager(hf.tiny_model("mixtral"), lowering="triton")
    assert report.counters["lower.fallback"] == len(report.layers) == 2 and not report.counters["lower.triton"]
    assert all(r.lowering == "torch" and "forward normwise error" in r.lowering_notes[0] for r in report.layers)

    def broken(*a, **k):
        raise RuntimeError("no kernel for this")

    monkeypatch.setattr(grouped, "fused_experts", broken)
    report = _check_against_eager(hf.tiny_model("mixtral"), lowering="triton")
    assert all(r.lowering == "torch" and "raised RuntimeError: no kernel for this" in r.lowering_notes[0]
               for r in report.layers)
    # a backward kernel that is wrong is caught by the gradient check
    monkeypatch.setattr(grouped, "fused_experts", right)
    bwd = kernels.load()["grouped_mlp_bwd"]
    right_bwd = bwd.fused_experts_backward
    monkeypatch.setattr(bwd, "fused_experts_backward",
                        lambda *a, **k: tuple(None if g is None else g * 1.01 for g in right_bwd(*a, **k)))
    report = _check_against_eager(hf.tiny_model("mixtral"), lowering="triton")
    assert all(r.lowering == "torch" and "gradient of" in r.lowering_notes[0] for r in report.layers)
    monkeypatch.setattr(bwd, "fused_experts_backward", right_bwd)
    report = _check_against_eager(hf.tiny_model("mixtral"), lowering="triton", verify_lowering=False)
    assert not report.counters["lower.proved"] and report.counters["lower.triton"] == 2  # unchecked: trusted


def test_triton_router_takes_a_1_by_E_correction_bias():
    """ERNIE 4.5 keeps its correction bias as [1, E]: the canonical form hands the router kernel [E]."""
    model = hf.build_model(hf.shrink_config("ernie4_5_moe"))
    biases = [p for n, p in model.named_parameters() if "correction_bias" in n]
    assert biases and all(tuple(p.shape) == (1, 8) for p in biases)
    for p in biases:
        p.requires_grad_(False)  # it only chooses experts: no gradient in eager either
    report = _check_against_eager(model, lowering="triton")
    assert report.layers and all(r.lowering == "triton" and r.spec.routing.correction_bias for r in report.layers)
    assert report.counters["lower.ops.route_triton"] == len(report.layers)


def test_ops_without_kernels_stay_on_torch_and_say_why():
    report = _check_against_eager(hf.tiny_model("phimoe"), lowering="triton")  # sparsemixer routing
    assert all(r.lowering == "triton" for r in report.layers)
    assert all(r.lowering_notes == ["route: torch (sparsemixer routing has no Triton kernel)"] for r in report.layers)
    report = _check_against_eager(handwritten.TinyMoELM("gshard", capacity_factor=0.5), lowering="triton")
    assert report.layers and all("build_pft: torch" in " ".join(r.lowering_notes) for r in report.layers)


def test_auto_on_cpu_times_the_torch_forms_and_explain_shows_the_choice(tmp_path, monkeypatch):
    """lowering="auto" on CPU: the Triton kernels (the interpreter, for tests) are no candidate; the forms that
    ran are listed with their times (tests/test_forms.py tests the choice itself)."""
    monkeypatch.setenv("MOECOMPILE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(forms, "cache", lambda: forms.FormCache())
    model = hf.tiny_model("mixtral")
    auto = moecompile.explain(model, IDS, lowering="auto")
    assert all(set(r.forms) == {"original", "torch", "grouped"} and r.lowering in r.forms for r in auto.layers)
    assert str(auto).count("  <- runs") == len(auto.layers) == 2
    assert not any(op in auto.graph("lower") for op in LOWERED_OPS)
    lowered = moecompile.explain(model, IDS, lowering="triton")
    assert all(r.lowering == "triton" for r in lowered.layers) and "lowering=triton" in str(lowered)
    # which tiles each kernel uses, and from where (the interpreter's fixed ones here); the probe check's error
    assert "kernel tiles: at 14 tokens: up_act_kept 16x16x16 w4 s1 (interpreter)" in str(lowered)  # (training)
    assert "wgrad_down 16x16x16 w4 s1 (interpreter)" in str(lowered)
    assert "kernels checked against the references on probes" in str(lowered)
    code = lowered.graph("lower")
    assert all(op in code for op in LOWERED_OPS)
    assert "moe.expert_mlp" not in code and "moe.combine" not in code  # fused into one op per layer
    # training keeps the projections for backward (dh reads them); inference keeps nothing, and runs as eager
    assert "moe.fused_experts_keep" in code and "dh_kept 16x16x16" in str(lowered)
    with torch.no_grad():
        inference = moecompile.explain(model, IDS, lowering="triton")
        compiled = torch.compile(model, backend="moe", options={"inner": "aot_eager", "lowering": "triton"})
        torch.testing.assert_close(compiled(IDS).logits, model(IDS).logits, rtol=1e-5, atol=1e-5)
    code = inference.graph("lower")
    assert "moe.fused_experts.default(" in code and "fused_experts_keep" not in code
    assert "up_act 16x16x16" in str(inference) and "dh 16x16x16" in str(inference)


def test_triton_lowering_under_inductor_with_changing_shapes():
    model = hf.tiny_model("qwen3_moe")
    backend = RecordingBackend(lowering="triton")  # inner: Inductor
    compiled = torch.compile(model, backend=backend, dynamic=True)
    for shape in [(2, 7), (1, 1), (3, 5)]:
        ids = torch.randint(0, 128, shape, generator=torch.Generator().manual_seed(sum(shape)))
        got, want = compiled(ids, labels=ids), model(ids, labels=ids)
        assert normwise(got.logits, want.logits) <= 1e-5
        g_got = torch.autograd.grad(got.loss, list(model.parameters()))
        g_want = torch.autograd.grad(want.loss, list(model.parameters()))
        assert max(normwise(a, b) for a, b in zip(g_got, g_want)) <= 1e-5
    assert not backend.errors and backend.report.counters["lower.triton"] >= 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA present the error is the CPU-tensor one")
def test_triton_on_cpu_without_the_interpreter_says_how():
    """Building a transformers model imports Triton, too late to switch its interpreter on: a clear error."""
    code = (
        "import torch\nfrom moecompile.models import hf\nm = hf.tiny_model('mixtral')\n"
        "c = torch.compile(m, backend='moe', options={'lowering': 'triton', 'inner': 'aot_eager'})\n"
        "c(torch.randint(0, 128, (2, 5)))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode != 0
    assert "run Python with TRITON_INTERPRET=1 in the environment" in run.stderr


def test_more_experts_than_the_pft_kernel_takes_keep_torch_pft():
    """520 experts: build_pft stays on torch, the rest is lowered to the kernels. The passes alone, nothing run: in
    Triton's interpreter each run of 520-expert kernels takes minutes (torch's build_pft feeding the Triton experts
    runs in the capacity test above, against eager)."""
    from moecompile.config import parse_options
    from moecompile.passes.graph_utils import moe_op_name
    from moecompile.passes.report import PassReport
    from moecompile.pipeline import run_passes

    graphs = []
    model = hf.tiny_model("qwen3_moe", num_experts=520, num_hidden_layers=1)
    torch.compile(model, backend=lambda gm, ex, **_: graphs.append((gm, ex)) or gm.forward, fullgraph=True)(IDS)
    report = PassReport()
    config = parse_options({"inner": "aot_eager", "lowering": "triton", "verify_lowering": False})
    gm = run_passes(*graphs[0], config, report)
    assert all(r.lowering_notes == ["build_pft: torch (the Triton kernel takes at most 512 experts)"]
               for r in report.layers)
    assert report.counters["lower.ops.fused_experts_keep"] == len(report.layers) == 1  # (parameters want grads)
    ops = {moe_op_name(n) for n in gm.graph.nodes}
    assert {"build_pft", "fused_experts_keep", "route_triton"} <= ops and "build_pft_triton" not in ops


@pytest.mark.parametrize("family", ["mixtral", "gpt_oss"])
def test_triton_lowering_fp16_as_accurate_as_eager(family):
    """fp16 through the kernels: the error to the fp32 model is no larger than eager fp16's own, up to 2x."""
    ref = hf.tiny_model(family)
    low = hf.tiny_model(family, dtype=torch.float16)
    want = ref(IDS).logits
    eager_err = normwise(low(IDS).logits, want)
    backend = RecordingBackend(inner="aot_eager", lowering="triton")
    got = torch.compile(low, backend=backend)(IDS).logits
    assert not backend.errors and backend.report.counters["lower.ops.fused_experts_keep"] == 2
    assert normwise(got, want) <= 2 * eager_err + 1e-3


@pytest.mark.parametrize("layout", ["chunk", "interleave_transposed"])
def test_fused_gate_up_gradient_written_once_in_the_parameters_layout(layout):
    """moe::fused_experts given the fused gate/up parameter itself (as the lower pass passes it) returns its
    gradient whole, with the parameter's strides: autograd stores it as the parameter's .grad without a copy
    (no second [E, 2I, H] tensor, no slice_backward); the transposed down weight likewise. The gradients equal
    the reference's through the views."""
    from moecompile.runtime import reference as ref
    from moecompile.runtime import triton_ops  # noqa: F401  (registers the ops)
    from moecompile.runtime.layouts import split_gate_up

    E, H, I, T, K = 4, 32, 16, 6, 2
    gen = torch.Generator().manual_seed(0)
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)])
    tok, _, counts, cw, src = ref.build_pft_ref(ids, torch.rand(T, K, generator=gen), E)
    transposed = layout != "chunk"
    how = "interleave" if transposed else "chunk"
    gate_up = torch.randn((E, H, 2 * I) if transposed else (E, 2 * I, H), generator=gen).requires_grad_()
    down = torch.randn((E, I, H) if transposed else (E, H, I), generator=gen).requires_grad_()
    x = torch.randn(T, H, generator=gen, requires_grad=True)
    view = lambda t: t.transpose(1, 2) if transposed else t  # noqa: E731
    seen = {}
    for name, p in (("gate_up", gate_up), ("down", down)):
        p.register_hook(lambda g, name=name: seen.update({name: (g.data_ptr(), g.stride())}))
    out = torch.ops.moe.fused_experts(x, tok, counts, cw, None, None, view(down), None, None, None, None, "silu",
                                      1.702, 7.0, T, src, view(gate_up), how)
    grad_out = torch.randn(T, H, generator=gen)
    with _CountOutputs(gate_up.numel()) as full_size:
        out.backward(grad_out)
    assert full_size.count == 1  # the one gradient buffer, nothing made beside it and copied
    for name, p in (("gate_up", gate_up), ("down", down)):
        assert seen[name] == (p.grad.data_ptr(), p.stride()), f"{name}: its gradient was copied into place"
    leaves = [t.detach().clone().requires_grad_() for t in (x, gate_up, down)]
    g, u = split_gate_up(view(leaves[1]), how, I)
    want = ref.combine_ref(ref.expert_mlp_ref(leaves[0], tok, counts, g, u, view(leaves[2])), tok, cw, T)
    want.backward(grad_out)
    assert normwise(out, want) <= 1e-5
    for got, truth in zip((x, gate_up, down), leaves):
        assert normwise(got.grad, truth.grad) <= 1e-5


class _CountOutputs(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the distinct storages of the tensors of ``numel`` elements that ATen ops produce (allocations
    and copies; an alias of one of them adds nothing)."""

    def __init__(self, numel):
        super().__init__()
        self.numel, self.storages = numel, set()

    @property
    def count(self):
        return len(self.storages)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for o in out if isinstance(out, (list, tuple)) else [out]:
            if isinstance(o, torch.Tensor) and o.numel() == self.numel:
                self.storages.add(o.untyped_storage().data_ptr())
        return out


def test_grouped_gemms_judged_at_the_sizes_this_rank_runs():
    """A TED layer's experts run at its slice of I (the distribute pass records it): torch._grouped_mm is judged
    usable at that size, not at the model's I (fp32, 16-byte multiples: I = 20 is, its half 10 is not)."""
    from types import SimpleNamespace

    import torch.fx as fx

    from moecompile.passes import grouped_form

    graph = fx.Graph()
    args = [graph.placeholder(f"a{i}") for i in range(5)]
    args[4].meta["example_value"] = torch.empty(2, 20, 32)
    mlp = graph.call_function(torch.ops.moe.expert_mlp.default, tuple(args))
    spec = SimpleNamespace(experts=SimpleNamespace(hidden=32, intermediate=20))
    assert grouped_form.usable([mlp], spec)
    mlp.meta["moe_local_intermediate"] = 10
    assert not grouped_form.usable([mlp], spec)
