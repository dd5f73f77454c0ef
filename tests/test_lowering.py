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
    assert all(report.counters[f"lower.ops.{op}"] == n for op in ("route_triton", "build_pft_triton", "fused_experts"))
    # the kernels were proved on probe inputs beside the references before they were used
    assert report.counters["lower.proved"] == n and all(r.lowering_error <= 1e-5 for r in report.layers)


def test_kernels_that_disagree_with_the_references_are_not_used(monkeypatch):
    """A kernel that computes something else (here: a grouped MLP off by 1%, then one that raises) fails the
    probe check: the layer keeps the torch references, says so, and the model still matches eager."""
    from moecompile.runtime import kernels

    grouped = kernels.load()["grouped_mlp"]
    right = grouped.fused_experts
    monkeypatch.setattr(grouped, "fused_experts", lambda *a, **k: right(*a, **k) * 1.01)
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


def test_auto_keeps_torch_on_cpu_and_explain_shows_the_choice():
    model = hf.tiny_model("mixtral")
    auto = moecompile.explain(model, IDS)
    assert all(r.lowering == "torch" for r in auto.layers)
    assert "auto: tensors on cpu" in str(auto)
    assert not any(op in auto.graph("lower") for op in LOWERED_OPS)
    lowered = moecompile.explain(model, IDS, lowering="triton")
    assert all(r.lowering == "triton" for r in lowered.layers) and "lowering=triton" in str(lowered)
    code = lowered.graph("lower")
    assert all(op in code for op in LOWERED_OPS)
    assert "moe.expert_mlp" not in code and "moe.combine" not in code  # fused into one op per layer


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
    report = _check_against_eager(hf.tiny_model("qwen3_moe", num_experts=520), lowering="triton")
    assert all(r.lowering_notes == ["build_pft: torch (the Triton kernel takes at most 512 experts)"]
               for r in report.layers)
    assert report.counters["lower.ops.fused_experts"] == len(report.layers) > 0


@pytest.mark.parametrize("family", ["mixtral", "gpt_oss"])
def test_triton_lowering_fp16_as_accurate_as_eager(family):
    """fp16 through the kernels: the error to the fp32 model is no larger than eager fp16's own, up to 2x."""
    ref = hf.tiny_model(family)
    low = hf.tiny_model(family, dtype=torch.float16)
    want = ref(IDS).logits
    eager_err = normwise(low(IDS).logits, want)
    backend = RecordingBackend(inner="aot_eager", lowering="triton")
    got = torch.compile(low, backend=backend)(IDS).logits
    assert not backend.errors and backend.report.counters["lower.ops.fused_experts"] == 2
    assert normwise(got, want) <= 2 * eager_err + 1e-3
