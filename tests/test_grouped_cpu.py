"""The expert MLP as grouped GEMMs on CPU (runtime/grouped_cpu.py) gives the reference loop's rows and gradients:
gated or not, biases, weights on the input, experts with no rows, rows dropped by a capacity, no rows at all,
bf16; and ``usable`` says no where ``torch._grouped_mm`` cannot take the operands (float64, unaligned rows)."""

import pytest
import torch

from moecompile.runtime import reference as ref
from moecompile.runtime.grouped_cpu import expert_mlp_grouped, usable

T, H, I, E, K = 12, 16, 8, 4, 2


def _case(dtype, *, gated=True, biases=False, scale=False, capacity=-1, empty=(), seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, E, (T, K), generator=g)
    for e in empty:
        ids[ids == e] = (e + 1) % E
    tok, _, counts, _, _ = ref.build_pft_ref(ids, torch.rand(T, K, generator=g), E, capacity, "slot_major")
    x = torch.randn(T, H, generator=g, dtype=dtype)
    params = [torch.randn(E, I, H, generator=g, dtype=dtype) / 4 if gated else None,
              torch.randn(E, I, H, generator=g, dtype=dtype) / 4, torch.randn(E, H, I, generator=g, dtype=dtype) / 3,
              *([torch.randn(E, I, generator=g, dtype=dtype) if gated else None, torch.randn(E, I, generator=g,
                 dtype=dtype), torch.randn(E, H, generator=g, dtype=dtype)] if biases else [None] * 3),
              torch.rand(tok.shape[0], generator=g, dtype=dtype) if scale else None]
    return x, tok, counts, params


def _run(fn, x, tok, counts, params, activation):
    x = x.clone().requires_grad_()
    params = [p.clone().requires_grad_() if p is not None else None for p in params]
    y = fn(x, tok, counts, *params, activation=activation)
    grad = torch.randn(y.shape, generator=torch.Generator().manual_seed(1), dtype=y.dtype)
    y.backward(grad)
    return [y, x.grad, *[p.grad for p in params if p is not None]]


@pytest.mark.parametrize("kw", [dict(), dict(gated=False, biases=True), dict(biases=True, scale=True),
                                dict(capacity=2), dict(empty=(1, 3)), dict(capacity=1)],
                         ids=["gated", "ungated-biases", "biases-scale", "capacity", "empty-experts", "most-dropped"])
def test_grouped_rows_and_gradients_equal_the_loop(kw):
    x, tok, counts, params = _case(torch.float32, **kw)
    assert usable(x, params[1], params[2])
    activation = "silu" if kw.get("gated", True) else "gelu"
    got = _run(expert_mlp_grouped, x, tok, counts, params, activation)
    want = _run(ref.expert_mlp_ref, x, tok, counts, params, activation)
    for a, b in zip(got, want):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)


def test_bf16_as_close_as_the_loop_to_fp32():
    x, tok, counts, params = _case(torch.bfloat16)
    exact = _run(ref.expert_mlp_ref, x.float(), tok, counts, [p.float() for p in params if p is not None] + [None] * 4,
                 "silu")[0]
    got = _run(expert_mlp_grouped, x, tok, counts, params, "silu")[0].float()
    loop = _run(ref.expert_mlp_ref, x, tok, counts, params, "silu")[0].float()
    assert (got - exact).norm() <= 2 * (loop - exact).norm() + 1e-3


def test_usable_refuses_what_grouped_mm_cannot_take():
    x, _, _, params = _case(torch.float32)
    assert not usable(x.double(), params[1].double(), params[2].double())  # no float64
    assert not usable(x, torch.randn(E, 6, H), torch.randn(E, H, 6))  # 24-byte rows: its backward refuses


def test_no_rows_at_all_gives_zero_rows():
    x, tok, counts, params = _case(torch.float32, capacity=0)  # every assignment dropped: nothing computed
    want = ref.expert_mlp_ref(x, tok, counts, *params, activation="silu")
    got = expert_mlp_grouped(x, tok, counts, *params, activation="silu")
    assert got.shape == want.shape == (T * K, H) and not got.any() and not want.any()


def test_interleaved_gate_up_views_as_the_lowering_passes_them():
    """GPT-OSS's fused [E, 2I, H] gate/up read as strided views (rows 0::2 and 1::2) are taken, gradients and all."""
    x, tok, counts, params = _case(torch.float32)
    fused = torch.randn(E, 2 * I, H, generator=torch.Generator().manual_seed(2)) / 4

    def run(fn):
        w = fused.clone().requires_grad_()
        y = fn(x, tok, counts, w[:, 0::2], w[:, 1::2], params[2], activation="silu")
        y.backward(torch.ones_like(y))
        return y, w.grad

    for a, b in zip(run(expert_mlp_grouped), run(ref.expert_mlp_ref)):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)
