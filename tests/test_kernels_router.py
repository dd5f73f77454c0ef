"""The fused Triton router (forward and backward) against the plain-torch reference: under the interpreter on CPU,
compiled on CUDA with TRITON_INTERPRET=0 on a GPU machine (the kernels on DEV, the references on the CPU)."""

import pytest
import torch
from kernel_device import on_device

from moecompile.runtime import reference
from moecompile.runtime.kernels import router

# name -> (E, route kwargs, has correction bias)
CASES = {
    "mixtral": (8, dict(top_k=2, score_fn="softmax", renormalize=True), False),
    "qwen2": (16, dict(top_k=4, score_fn="softmax"), False),
    "topk_softmax": (8, dict(top_k=2, score_fn="topk_softmax"), False),
    "topk_sigmoid_bias": (16, dict(top_k=1, score_fn="topk_sigmoid"), True),
    "sigmoid_renorm": (8, dict(top_k=3, score_fn="sigmoid", renormalize=True, renorm_eps=1e-20), False),
    "top_k_eq_E": (8, dict(top_k=8, score_fn="softmax", scaling=1.5), False),
    "deepseek_v3": (32, dict(top_k=4, score_fn="sigmoid", renormalize=True, renorm_eps=1e-20, scaling=2.5,
                             n_group=4, topk_group=2, group_score="top2_sum"), True),
    "grouped_max": (32, dict(top_k=3, score_fn="softmax", n_group=4, topk_group=2, group_score="max"), False),
}
TOL = {torch.float32: dict(atol=1e-6, rtol=1e-6), torch.float16: dict(atol=1e-6, rtol=1e-6)}
GRAD_TOL = {torch.float32: dict(atol=1e-6, rtol=1e-5), torch.float16: dict(atol=1e-6, rtol=1e-3)}  # 1 fp16 ulp


def _logits(T, E, dtype, seed):
    """Distinct logits per row (spaced well above fp16 resolution), so the top-k order has no ties."""
    g = torch.Generator().manual_seed(seed)
    ranks = torch.argsort(torch.rand(T, E, generator=g), dim=1).float()
    x = (ranks - E / 2) * (4.0 / E) + 0.3 * torch.rand(T, E, generator=g) * (4.0 / E)
    return x.to(dtype)


def _bias(E, seed):
    return 0.1 * torch.rand(E, generator=torch.Generator().manual_seed(seed + 1))  # >= 0: choice scores stay > 0


CASE_GRID = [(name, T, dtype) for name in CASES for T in (6, 42, 123) for dtype in (torch.float32, torch.float16)]


@pytest.mark.parametrize("name,T,dtype", CASE_GRID, ids=[f"{n}-T{t}-{str(d)[6:]}" for n, t, d in CASE_GRID])
def test_route_forward_backward(name, T, dtype):
    E, kw, has_bias = CASES[name]
    logits = _logits(T, E, dtype, seed=T * E)
    bias = _bias(E, T) if has_bias else None

    w, ids = on_device(router.route, logits, bias, **kw)
    w_ref, ids_ref = reference.route_ref(logits, bias, **kw)
    assert w.dtype == torch.float32 and ids.dtype == torch.int64 and w.is_contiguous() and ids.is_contiguous()
    assert torch.equal(ids, ids_ref)
    torch.testing.assert_close(w, w_ref, **TOL[dtype])

    grad_w = torch.randn(T, kw["top_k"], generator=torch.Generator().manual_seed(7))
    x = logits.clone().requires_grad_(True)
    (reference.route_ref(x, bias, **kw)[0] * grad_w).sum().backward()
    grad = on_device(router.route_backward, grad_w, logits, ids, bias, **kw)
    assert grad.dtype == dtype and grad.shape == logits.shape and grad.is_contiguous()
    torch.testing.assert_close(grad, x.grad, **GRAD_TOL[dtype])
    torch.testing.assert_close(router.route_backward_ref(grad_w, logits, ids, bias, **kw), x.grad, **GRAD_TOL[dtype])


def test_group_limit_changes_choice():
    """The group limit must matter in the grouped case (else the grouped test proves nothing)."""
    E, kw, _ = CASES["grouped_max"]
    logits = _logits(42, E, torch.float32, seed=3)
    ungrouped = {k: v for k, v in kw.items() if k not in ("n_group", "topk_group", "group_score")}
    ids_g = on_device(router.route, logits, **kw)[1]
    assert not torch.equal(ids_g, reference.route_ref(logits, **ungrouped)[1])
    assert torch.equal(ids_g, reference.route_ref(logits, **kw)[1])


def test_bf16_and_noncontiguous_logits():
    logits = _logits(8, 32, torch.float32, seed=5).t().contiguous().t()  # [8, 32] with transposed strides
    kw = dict(top_k=2, score_fn="softmax", renormalize=True)
    w, ids = on_device(router.route, logits, **kw)
    w_ref, ids_ref = reference.route_ref(logits, **kw)
    assert torch.equal(ids, ids_ref)
    torch.testing.assert_close(w, w_ref, atol=1e-6, rtol=1e-6)
    lb = _logits(8, 16, torch.bfloat16, seed=6)
    w, ids = on_device(router.route, lb, top_k=2, score_fn="sigmoid")
    w_ref, ids_ref = reference.route_ref(lb, top_k=2, score_fn="sigmoid")
    assert torch.equal(ids, ids_ref)
    torch.testing.assert_close(w, w_ref, atol=1e-6, rtol=1e-6)


def test_empty_tokens():
    w, ids = on_device(router.route, torch.zeros(0, 8), top_k=2)
    assert w.shape == ids.shape == (0, 2)


def test_bad_inputs():
    logits = torch.randn(4, 8)
    with pytest.raises(ValueError, match="correction_bias_E"):
        on_device(router.route, logits, torch.zeros(7), top_k=2)
    with pytest.raises(ValueError, match="top_k"):
        on_device(router.route, logits, top_k=9)
    with pytest.raises(ValueError, match="2-D"):
        on_device(router.route, torch.randn(8), top_k=2)
    with pytest.raises(ValueError, match="n_group"):
        on_device(router.route, logits, top_k=2, score_fn="sigmoid", n_group=3, topk_group=1)
    with pytest.raises(ValueError, match="dtype"):
        on_device(router.route, logits.double(), top_k=2)
    with pytest.raises(ValueError, match="score_fn"):
        on_device(router.route, logits, top_k=2, score_fn="relu")
    with pytest.raises(NotImplementedError, match="reference"):
        on_device(router.route, logits, top_k=2, score_fn="sparsemixer")
    with pytest.raises(ValueError, match="ids_TK"):
        on_device(router.route_backward, torch.ones(4, 2), logits, torch.zeros(4, 3, dtype=torch.long), top_k=2)


def test_compile_targets_cover_launcher_choices():
    targets = router.compile_targets()
    assert len(targets) < 60
    fwd = [c for fn, _, c in targets if fn is router._route_kernel]
    for key, values in dict(SCORE_FN=range(4), HAS_BIAS=(0, 1), RENORM=(0, 1), GROUPED=(0, 1)).items():
        assert {int(c[key]) for c in fwd} == set(values), key
    assert {c["GROUP_SCORE"] for c in fwd if c["GROUPED"]} == {0, 1}
    for fn, sig, consts in targets:
        assert list(sig) == fn.arg_names and all(sig[k] == "constexpr" for k in consts)
        assert consts["BLOCK_T"] == router._block_t(consts["BLOCK_E"])
