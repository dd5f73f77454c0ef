"""The grouped expert kernels (runtime/kernels/grouped_mlp*.py) against the torch reference, under Triton's
interpreter: odd token counts, hidden and intermediate sizes that are not tile multiples, experts with no rows,
every row on one expert, every activation, biases, input scales, transposed weight layouts; fp32 and fp16;
forward (separate kernels and the persistent fused one) and backward (every gradient).

On a GPU machine, ``TRITON_INTERPRET=0 python -m pytest tests/test_kernels_grouped.py`` runs the same checks on
CUDA with the compiled kernels, bf16 included (the interpreter's bf16 arithmetic is wrong, so CPU skips it)."""

import pytest
import torch
import triton
import triton.language as tl

from moecompile.runtime import reference as ref
from moecompile.runtime.kernels import grouped_mlp as gm
from moecompile.runtime.kernels import grouped_mlp_bwd as gb
from moecompile.runtime.kernels.grouped_common import tile_of
from kernel_device import DEV, on_device

DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEV == "cuda" else [])

E, H, I = 8, 40, 24  # H and I not multiples of the 16-wide tiles: partial tiles are masked, never padded
NAMES = ("x", "cw", "wg", "wu", "wd", "bg", "bu", "bd", "s")
LAYOUTS = {  # activation, gated, biases, input scale (weights on the input, Llama4), transposed weights (GPT-OSS)
    "mixtral": ("silu", True, False, False, False),
    "gpt_oss": ("swiglu_clamp", True, True, False, True),
    "llama4": ("silu", True, False, True, False),
    "gelu_ungated": ("gelu", False, True, False, False),
    "gelu_tanh": ("gelu_tanh", True, False, False, False),
    "relu2_ungated": ("relu2", False, False, True, False),
    "inkling2": ("swiglu_softcap", True, False, False, False),
    "deepseek_v4": ("silu_clamp", True, False, False, False),
}


def _ids(T, K, routing, gen):
    if routing == "one_expert":  # every assignment on expert 5, the others empty
        return torch.full((T, 1), 5, dtype=torch.int64)
    if routing == "skewed":  # experts 1, 4 and 6 get nothing
        pool = torch.tensor([0, 2, 3, 5, 7])
        return torch.stack([pool[torch.randperm(5, generator=gen)[:K]] for _ in range(T)])
    return torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)])


def make_problem(T, layout, dtype, routing="random", K=2, seed=0):
    act, gated, biases, scale, transposed = LAYOUTS[layout]
    gen = torch.Generator().manual_seed(seed)
    rnd = lambda *shape, s=1.0: (torch.randn(*shape, generator=gen) * s).to(dtype)  # noqa: E731
    ids = _ids(T, K, routing, gen)
    w_TK = torch.rand(ids.shape, generator=gen)
    tok, _, counts, cw, src = ref.build_pft_ref(ids, w_TK, E)
    t = dict(x=rnd(T, H), cw=None if scale else cw, s=cw if scale else None, src=src)
    if transposed:  # stored [E, H, I] and seen through a transposed view, as GPT-OSS's experts are
        t["wu"] = rnd(E, H, I, s=H**-0.5).transpose(1, 2)
        t["wg"] = rnd(E, H, I, s=H**-0.5).transpose(1, 2)
        t["wd"] = rnd(E, I, H, s=I**-0.5).transpose(1, 2)
    else:
        t["wu"], t["wd"] = rnd(E, I, H, s=H**-0.5), rnd(E, H, I, s=I**-0.5)
        t["wg"] = rnd(E, I, H, s=H**-0.5) if gated else None
    if not gated:
        t["wg"] = None
    t["bg"] = rnd(E, I) if biases and gated else None
    t["bu"] = rnd(E, I) if biases else None
    if biases and transposed:  # GPT-OSS's gate and up biases are interleaved columns of one [E, 2I] tensor
        both = rnd(E, 2 * I)
        t["bg"], t["bu"] = both[:, ::2], both[:, 1::2]
    t["bd"] = rnd(E, H) if biases else None
    # GPT-OSS's and DeepSeek-V4's clamps and Inkling2's caps at values the activations actually reach, so both
    # regimes are exercised
    kw = dict(activation=act, alpha=1.702, limit=0.5 if act in ("swiglu_clamp", "silu_clamp") else 7.0)
    if act == "swiglu_softcap":
        kw.update(alpha=0.8, limit=0.5)
    return t, tok, counts, kw


def _args(t):
    return [t[n] for n in ("wg", "wu", "wd", "bg", "bu", "bd", "s")]


def _reference(t, tok, counts, kw, dtype=None, grad_out=None):
    """Reference output (and gradients) computed in ``dtype`` (default: the problem's)."""
    tt = {k: None if v is None else v.detach().to(dtype or v.dtype).requires_grad_(v.is_floating_point())
          for k, v in t.items() if k != "src"}
    out = gm.fused_experts_ref(tt["x"], tok, counts, tt["cw"], *_args(tt), num_tokens=tt["x"].shape[0], **kw)
    if grad_out is None:
        return out.detach(), None
    out.backward(grad_out.to(out.dtype))
    return out.detach(), {k: None if v is None else v.grad for k, v in tt.items()}


def relerr(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def check(got, truth, ref_lowp, dtype, what):
    """fp32: to 1e-5 normwise; fp16: no worse than twice the fp16 torch reference's own error (plus a floor)."""
    err = relerr(got, truth)
    bound = 1e-5 if dtype == torch.float32 else 2 * relerr(ref_lowp, truth) + 2e-3
    assert err <= bound, f"{what}: error {err:.2e} > {bound:.2e}"


CASES = [(6, "mixtral", "random"), (42, "gpt_oss", "skewed"), (123, "llama4", "random"),
         (42, "gelu_ungated", "one_expert"), (6, "gelu_tanh", "skewed"), (42, "relu2_ungated", "random"),
         (42, "inkling2", "skewed"), (42, "deepseek_v4", "random")]


@pytest.mark.parametrize("dtype", DTYPES, ids=[str(d)[6:] for d in DTYPES])
@pytest.mark.parametrize("T,layout,routing", CASES)
def test_forward(T, layout, routing, dtype):
    t, tok, counts, kw = make_problem(T, layout, dtype, routing)
    truth, _ = _reference(t, tok, counts, kw, torch.float32)
    lowp, _ = _reference(t, tok, counts, kw)
    fused = on_device(gm.fused_experts, t["x"], tok, counts, t["cw"], *_args(t), num_tokens=T, single_launch=True,
                      **kw)
    assert fused.dtype == lowp.dtype and fused.shape == lowp.shape
    check(fused, truth, lowp, dtype, "fused_experts")
    h = on_device(gm.up_act, t["x"], tok, counts, t["wg"], t["wu"], t["bg"], t["bu"], t["s"], **kw)
    out = on_device(gm.down_combine, h, tok, counts, t["wd"], t["bd"], t["cw"], T)
    check(out, truth, lowp, dtype, "up_act + down_combine")
    y = on_device(gm.down_combine, h, tok, counts, t["wd"], t["bd"], combine=False)
    y_ref = ref.expert_mlp_ref(t["x"].float(), tok, counts, *[None if a is None else a.float() for a in _args(t)], **kw)
    check(y, y_ref, ref.expert_mlp_ref(t["x"], tok, counts, *_args(t), **kw), dtype, "down (y_BH stored)")


@pytest.mark.parametrize("dtype", DTYPES, ids=[str(d)[6:] for d in DTYPES])
@pytest.mark.parametrize("T,layout,routing", CASES)
def test_backward(T, layout, routing, dtype):
    t, tok, counts, kw = make_problem(T, layout, dtype, routing)
    grad_out = torch.randn(T, H, generator=torch.Generator().manual_seed(1))
    _, truth = _reference(t, tok, counts, kw, torch.float32, grad_out)
    _, lowp = _reference(t, tok, counts, kw, None, grad_out)
    out_dtype = lowp["x"].dtype if t["cw"] is None else torch.promote_types(dtype, t["cw"].dtype)
    grads = on_device(gb.fused_experts_backward, grad_out.to(out_dtype), t["x"], tok, counts, t["cw"], *_args(t),
                      **kw)
    for name, g in zip(NAMES, grads):
        if t[name] is None:
            assert g is None, name
            continue
        assert g.shape == t[name].shape and g.dtype == t[name].dtype, name
        if name in ("wg", "wu", "wd"):  # written in the weight's own layout (transposed views: transposed)
            assert g.stride() == t[name].stride(), name
        else:
            assert g.is_contiguous(), name
        check(g, truth[name], lowp[name], dtype, f"grad {name}")


@pytest.mark.parametrize("T,layout,routing", CASES)
def test_kept_projections_give_the_recomputed_gradients_bit_for_bit(T, layout, routing):
    """fused_experts(keep=True) returns the output it returns without keeping, and the projections before the
    activation ([gate | up], up alone ungated: the reference's to its rounding); the backward given them
    (dh_kept: no up GEMM again) returns what it returns recomputing them, bit for bit."""
    t, tok, counts, kw = make_problem(T, layout, torch.float32, routing)
    args = (t["x"], tok, counts, t["cw"], *_args(t))
    plain = on_device(gm.fused_experts, *args, num_tokens=T, single_launch=False, **kw)
    out, pre = on_device(gm.fused_experts, *args, num_tokens=T, keep=True, **kw)
    assert torch.equal(out, plain)
    xs = t["x"][tok] * (t["s"][:, None] if t["s"] is not None else 1)
    expert = torch.repeat_interleave(torch.arange(E), counts)
    halves = [("wg", "bg"), ("wu", "bu")] if t["wg"] is not None else [("wu", "bu")]
    want = torch.cat([torch.einsum("bh,bih->bi", xs, t[w][expert]) + (t[b][expert] if t[b] is not None else 0)
                      for w, b in halves], 1)
    assert pre.shape == want.shape and relerr(pre, want) < 1e-5
    grad_out = torch.randn(T, H, generator=torch.Generator().manual_seed(1))
    again = on_device(gb.fused_experts_backward, grad_out, *args, src_B=t["src"], **kw)
    kept = on_device(gb.fused_experts_backward, grad_out, *args, src_B=t["src"], pre_B=pre, **kw)
    for name, a, b in zip(NAMES, again, kept):
        assert (a is None and b is None) or torch.equal(a, b), name
    moved = on_device(gb.fused_experts_backward, grad_out, *args, src_B=t["src"], pre_B=pre + 0.5, **kw)
    assert not torch.equal(moved[NAMES.index("wd")], kept[NAMES.index("wd")])  # the backward read them


def test_kept_projections_are_checked():
    t, tok, counts, kw = make_problem(6, "mixtral", torch.float32)
    args = (t["x"], tok, counts, t["cw"], *_args(t))
    grad_out = torch.zeros(6, H)
    with pytest.raises(ValueError, match="pre_B has shape"):
        on_device(gb.fused_experts_backward, grad_out, *args, pre_B=torch.zeros(tok.shape[0], I), **kw)
    with pytest.raises(ValueError, match="pre_B must be torch.float32"):
        on_device(gb.fused_experts_backward, grad_out, *args, pre_B=torch.zeros(tok.shape[0], 2 * I).half(), **kw)
    with pytest.raises(ValueError, match="keep=False"):
        on_device(gm.fused_experts, *args, num_tokens=6, single_launch=True, keep=True, **kw)


@triton.jit
def _visits(out_ptr, order_ptr, num_tiles, num_n, GROUP_M: tl.constexpr):
    t, n = tile_of(tl.program_id(0), num_tiles, num_n, GROUP_M)
    tl.atomic_add(out_ptr + t * num_n + n, 1)
    tl.store(order_ptr + tl.program_id(0), t)


@pytest.mark.parametrize("num_tiles,num_n,group", [(13, 3, 8), (8, 5, 8), (1, 7, 8), (20, 1, 4), (5, 4, 1), (6, 3, 0)])
def test_tile_order_visits_every_tile_once_a_group_at_a_time(num_tiles, num_n, group):
    """grouped_common.tile_of: the 1-D grid visits every (row tile, column tile) exactly once, and the first
    group x num_n programs take the first ``group`` row tiles only (they walk the columns together); group 0,
    the 2-D grid's order, takes every row tile for the first column first."""
    visits = torch.zeros(num_tiles * num_n, dtype=torch.int32)
    order = torch.zeros(num_tiles * num_n, dtype=torch.int32)
    visits, order = on_device(lambda v, o: (_visits[(num_tiles * num_n,)](v, o, num_tiles, num_n, GROUP_M=group),
                                            (v, o))[1], visits, order)
    assert torch.equal(visits, torch.ones_like(visits))
    rows = min(group, num_tiles) if group else num_tiles
    first = order[:rows * num_n] if group else order[:num_tiles]
    assert set(first.tolist()) == set(range(rows)) and first.numel() == (rows * num_n if group else rows)


def test_program_order_changes_no_bit():
    """The kernels in the order before (GROUP_M = 0: the GEMMs row tile by row tile for each column, the weight
    gradient every expert for each tile) give the same output and gradients, bit for bit: each output element
    is still computed by one program, in the same way."""
    from moecompile.runtime.kernels import tuning

    T = 123
    t, tok, counts, kw = make_problem(T, "gpt_oss", torch.float32, "skewed")
    args = (t["x"], tok, counts, t["cw"], *_args(t))
    grad_out = torch.randn(T, H, generator=torch.Generator().manual_seed(3))
    runs = []
    for order in ({}, {"GROUP_M": 0}):
        gemm, wgrad = dict(tuning.INTERPRETER, **order), dict(tuning.WGRAD_INTERPRETER, **order)
        out = on_device(gm.fused_experts, *args, num_tokens=T, single_launch=False, config=gemm, **kw)
        grads = on_device(gb.fused_experts_backward, grad_out, *args, config={"gemm": gemm, "wgrad": wgrad}, **kw)
        runs.append([out] + [g for g in grads if g is not None])
    assert all(torch.equal(a, b) for a, b in zip(*runs))


def test_two_launch_split_equals_the_single_launch():
    """With fewer row tiles than SMs the layer runs as up_act + down_combine: same result."""
    t, tok, counts, kw = make_problem(42, "gpt_oss", torch.float32, "skewed")
    args = (t["x"], tok, counts, t["cw"], *_args(t))
    one = on_device(gm.fused_experts, *args, num_tokens=42, single_launch=True, **kw)
    two = on_device(gm.fused_experts, *args, num_tokens=42, single_launch=False, **kw)
    assert relerr(two, one) < 1e-6


def test_one_program_walks_every_tile():
    """The persistent kernel with a single program: it must visit every tile of every expert itself."""
    t, tok, counts, kw = make_problem(42, "mixtral", torch.float32, "skewed")
    want, _ = _reference(t, tok, counts, kw)
    got = on_device(gm.fused_experts, t["x"], tok, counts, t["cw"], *_args(t), num_tokens=42, num_programs=1, **kw)
    assert relerr(got, want) < 1e-5


def test_dropped_tail_rows_are_not_computed():
    """Capacity-dropped rows sit past the counted ones (expert id E, weight 0): no kernel touches them."""
    t, tok, counts, kw = make_problem(42, "mixtral", torch.float32)
    counts = counts.clone()
    counts[-1] = 0  # the last expert's rows become an uncounted tail, as build_pft leaves dropped rows
    cw = t["cw"].clone()
    cw[int(counts.sum()):] = 0.0
    want = gm.fused_experts_ref(t["x"], tok, counts, cw, *_args(t), num_tokens=42, **kw)
    got = on_device(gm.fused_experts, t["x"], tok, counts, cw, *_args(t), num_tokens=42, single_launch=True, **kw)
    assert relerr(got, want) < 1e-5
    h = on_device(gm.up_act, t["x"], tok, counts, t["wg"], t["wu"], **kw)
    y = on_device(gm.down_combine, h, tok, counts, t["wd"], combine=False)
    assert y[int(counts.sum()):].abs().max() == 0
    t["cw"] = cw
    grad_out = torch.randn(42, H, generator=torch.Generator().manual_seed(2))
    _, want_grads = _reference(t, tok, counts, kw, None, grad_out)
    grads = on_device(gb.fused_experts_backward, grad_out, t["x"], tok, counts, cw, *_args(t), **kw)
    for name, g in zip(NAMES, grads):
        if g is not None:
            assert relerr(g, want_grads[name]) < 1e-5, name
    assert grads[1][int(counts.sum()):].abs().max() == 0  # dropped rows: no combine-weight gradient


def test_bad_input_is_named():
    t, tok, counts, kw = make_problem(6, "mixtral", torch.float32)
    t = {k: None if v is None else v.to(DEV) for k, v in t.items()}
    tok, counts = tok.to(DEV), counts.to(DEV)
    with pytest.raises(ValueError, match="w_down_EHI has shape"):
        gm.fused_experts(t["x"], tok, counts, t["cw"], t["wg"], t["wu"], t["wd"][:, :-1], num_tokens=6, **kw)
    with pytest.raises(ValueError, match="share one dtype"):
        gm.fused_experts(t["x"], tok, counts, t["cw"], t["wg"].half(), t["wu"], t["wd"], num_tokens=6, **kw)
    with pytest.raises(ValueError, match="needs a gate projection"):
        gm.fused_experts(t["x"], tok, counts, t["cw"], None, t["wu"], t["wd"], num_tokens=6,
                         activation="swiglu_clamp")
    with pytest.raises(ValueError, match="tokens_per_expert_E has shape"):
        gm.up_act(t["x"], tok, counts[:-1], t["wg"], t["wu"], **kw)


# ---- deterministic combine (runtime/kernels/combine.py) --------------------------------------------------------


def _src_problem(T, K, seed=0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)])
    return ref.build_pft_ref(ids, torch.rand(ids.shape, generator=gen), E)


@pytest.mark.parametrize("T,K", [(6, 2), (123, 3), (1, 8)])
def test_token_rows_inverts_the_pft(T, K):
    """rows_TK[t, k] is the buffer row of assignment (t, k): from src (one scatter kernel) or by sorting."""
    from moecompile.runtime.kernels import combine as cb

    tok, _, _, _, src = _src_problem(T, K)
    rows = on_device(cb.token_rows, tok, T, src)
    assert torch.equal(src[rows.reshape(-1)], torch.arange(T * K))
    sorted_rows = on_device(cb.token_rows, tok, T)
    assert torch.equal(tok[sorted_rows], torch.arange(T)[:, None].expand(T, K))
    with pytest.raises(ValueError, match="K rows per token"):
        cb.token_rows(tok, T * K + 1)


@pytest.mark.parametrize("dtype", DTYPES, ids=[str(d)[6:] for d in DTYPES])
def test_combine_kernel_against_its_reference(dtype):
    from moecompile.runtime.kernels import combine as cb

    T, K = 42, 3
    tok, _, counts, cw, src = _src_problem(T, K)
    counts = counts.clone()
    counts[-1] = 0  # the last expert's rows become an uncounted (dropped) tail: skipped
    y = torch.randn(T * K, 200, generator=torch.Generator().manual_seed(3)).to(dtype)
    rows = cb.token_rows(tok, T)
    for w, rnd, out_dtype in ((cw, False, torch.float32), (None, False, dtype), (cw, True, dtype)):
        got = on_device(cb.combine, y, rows, counts, w, out_dtype=out_dtype, round_weights=rnd)
        want = cb.combine_ref(y, rows, counts, w, out_dtype=out_dtype, round_weights=rnd)
        assert got.dtype == out_dtype
        assert relerr(got, want) <= (1e-6 if out_dtype == torch.float32 else 1e-3)


def test_forward_and_backward_are_bitwise_deterministic():
    """Run to run, the same inputs give bitwise the same output and gradients (no float atomics): the forward
    in both forms, the backward, with the PFT's src and without it."""
    T = 123
    t, tok, counts, kw = make_problem(T, "llama4", torch.float32)  # input scale: dx sums scaled rows
    t2, tok2, counts2, kw2 = make_problem(T, "mixtral", torch.float32, seed=1)
    grad_out = torch.randn(T, H, generator=torch.Generator().manual_seed(4))
    for p, tk, cn, k, src in ((t, tok, counts, kw, None), (t2, tok2, counts2, kw2, t2["src"])):
        runs = []
        for _ in range(2):
            outs = [on_device(gm.fused_experts, p["x"], tk, cn, p["cw"], *_args(p), num_tokens=T,
                              single_launch=single, src_B=src, **k) for single in (True, False)]
            grads = on_device(gb.fused_experts_backward, grad_out, p["x"], tk, cn, p["cw"], *_args(p), src_B=src,
                              **k)
            runs.append(outs + [g for g in grads if g is not None])
        for a, b in zip(*runs):
            assert torch.equal(a, b)
