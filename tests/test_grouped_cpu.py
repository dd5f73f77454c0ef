"""The expert MLP as grouped GEMMs on CPU (runtime/grouped_cpu.py) gives the reference loop's rows and gradients:
gated or not, biases, weights on the input, experts with no rows, rows dropped by a capacity, no rows at all,
bf16; and ``usable`` says no where ``torch._grouped_mm`` cannot take the operands (float64, unaligned rows)."""

import pytest
import torch

from moecompile.runtime import reference as ref
from moecompile.runtime.grouped_cpu import expert_mlp_grouped, expert_mlp_keep, expert_mlp_keep_backward, usable

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
                                dict(capacity=2), dict(empty=(1, 3)), dict(capacity=1), dict(act="swiglu_clamp"),
                                dict(act="relu2", gated=False)],
                         ids=["gated", "ungated-biases", "biases-scale", "capacity", "empty-experts", "most-dropped",
                              "gated-clamp", "ungated-relu2"])
def test_grouped_rows_and_gradients_equal_the_loop(kw):
    kw = dict(kw)
    activation = kw.pop("act", "silu" if kw.get("gated", True) else "gelu")
    x, tok, counts, params = _case(torch.float32, **kw)
    assert usable(x, params[1], params[2])
    got = _run(expert_mlp_grouped, x, tok, counts, params, activation)
    want = _run(ref.expert_mlp_ref, x, tok, counts, params, activation)
    for a, b in zip(got, want):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)
    kept = _run_keep(x, tok, counts, params, activation)  # the saved-projection form: same rows and gradients
    assert len(kept) == len(want)
    for a, b in zip(kept, want):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6 * float(b.detach().abs().max()))


def _run_keep(x, tok, counts, params, activation):
    """``expert_mlp_keep`` then ``expert_mlp_keep_backward`` with ``_run``'s output gradient."""
    y, pre = expert_mlp_keep(x, tok, counts, *params, activation=activation)
    grad = torch.randn(y.shape, generator=torch.Generator().manual_seed(1), dtype=y.dtype)
    return [y, *expert_mlp_keep_backward(grad, pre, x, tok, counts, *params, activation=activation)]


@pytest.mark.parametrize("all_rows", [True, False])
def test_all_rows_reads_no_row_count_back(all_rows):
    """With ``all_rows`` (no row dropped) the forward and backward read nothing back from the device: on meta
    tensors, which have no values, they run; without it the row count is read, which raises there. On real rows
    both give the same tensors."""
    x, tok, counts, params = _case(torch.bfloat16, biases=True, scale=True)  # grouped_mm's meta kernel: bf16 only
    real = [expert_mlp_keep(x, tok, counts, *params, activation="silu", all_rows=a)[0] for a in (True, False)]
    assert torch.equal(*real)
    meta = [t.to("meta") if t is not None else None for t in (x, tok, counts, *params)]
    try:
        y, pre = expert_mlp_keep(*meta, activation="silu", all_rows=all_rows)
        grads = expert_mlp_keep_backward(y, pre, *meta, activation="silu", all_rows=all_rows)
    except (RuntimeError, NotImplementedError) as err:
        assert not all_rows, err
    else:
        assert all_rows and y.shape == (tok.shape[0], H) and len(grads) == 8


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


LAYOUTS = {"interleave": (slice(0, None, 2), slice(1, None, 2)), "chunk": (slice(0, I), slice(I, None)),
           "chunk_up_first": (slice(I, None), slice(0, I))}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_fused_gate_up_weight_in_its_layout(layout):
    """A fused [E, 2I, H] gate/up weight (GPT-OSS's interleaved rows, or halves, either first): the recompute form
    takes it as two views, as the canonical form passes them; expert_mlp_keep takes it whole (one GEMM for both
    projections) and gives its gradient whole, in its layout. Rows and the weight's gradient equal the loop's."""
    x, tok, counts, params = _case(torch.float32)
    fused = torch.randn(E, 2 * I, H, generator=torch.Generator().manual_seed(2)) / 4
    gv, uv = LAYOUTS[layout]

    def run(fn):
        w = fused.clone().requires_grad_()
        y = fn(x, tok, counts, w[:, gv], w[:, uv], params[2], activation="silu")
        y.backward(torch.ones_like(y))
        return y, w.grad

    def keep():
        y, pre = expert_mlp_keep(x, tok, counts, None, None, params[2], activation="silu", w_gate_up=fused,
                                 gate_up_layout=layout)
        assert pre.shape == (T * K, 2 * I)
        grads = expert_mlp_keep_backward(torch.ones_like(y).expand(y.shape), pre, x, tok, counts, None, None,
                                         params[2], activation="silu", w_gate_up=fused, gate_up_layout=layout)
        assert len(grads) == 3 and grads[2].shape == fused.shape  # x, w_down, w_gate_up
        return y, grads[2]

    want = run(ref.expert_mlp_ref)
    for got in (run(expert_mlp_grouped), keep()):
        for a, b in zip(got, want):
            assert torch.allclose(a, b, rtol=1e-5, atol=1e-6 * float(b.detach().abs().max()))
