"""Canonical MoE ops: semantics against brute force, autograd against finite differences, odd shapes."""

import pytest
import torch

from moecompile.runtime import ops  # noqa: F401
from moecompile.runtime import reference as ref
from moecompile.runtime.stats import DROPS

ROUTE_DEFAULTS = dict(renormalize=False, renorm_eps=0.0, scaling=1.0, n_group=1, topk_group=1,
                      group_score="top2_sum", jitter_eps=0.0)


def route(logits, bias=None, **kw):
    a = {**ROUTE_DEFAULTS, **kw}
    return torch.ops.moe.route(logits, bias, a["top_k"], a["score_fn"], a["renormalize"], a["renorm_eps"],
                               a["scaling"], a["n_group"], a["topk_group"], a["group_score"], a["jitter_eps"])


def brute_moe(x, ids, w, wg, wu, wd, act=torch.nn.functional.silu):
    out = torch.zeros(x.shape[0], wd.shape[1], dtype=torch.promote_types(x.dtype, w.dtype))
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = ids[t, k]
            out[t] += w[t, k] * (wd[e] @ (act(wg[e] @ x[t]) * (wu[e] @ x[t])))
    return out


def test_softmax_route_matches_topk_of_softmax():
    logits = torch.randn(42, 8)
    w, ids = route(logits, top_k=2, score_fn="softmax", renormalize=True)
    p = logits.softmax(-1)
    v, i = p.topk(2)
    assert torch.equal(ids, i)
    torch.testing.assert_close(w, v / v.sum(-1, keepdim=True))


def test_sigmoid_group_limited_route_picks_only_from_best_groups():
    torch.manual_seed(1)
    logits, bias = torch.randn(123, 16), torch.rand(16) * 0.2
    w, ids = route(logits, bias, top_k=3, score_fn="sigmoid", n_group=4, topk_group=2, scaling=2.5,
                   renormalize=True)
    s = torch.sigmoid(logits)
    choice = (s + bias).view(123, 4, 4)
    best_groups = choice.topk(2, dim=-1).values.sum(-1).topk(2, dim=-1).indices
    assert all(set((ids[t] // 4).tolist()) <= set(best_groups[t].tolist()) for t in range(123))
    g = s.gather(1, ids)  # weights come from the scores without the correction bias
    torch.testing.assert_close(w, 2.5 * g / g.sum(-1, keepdim=True))


def test_sqrtsoftplus_route_is_deepseek_v4s():
    """sqrt(softplus(logits)) scores, chosen with the correction bias, weighted without it, renormalised, scaled."""
    torch.manual_seed(2)
    logits, bias = torch.randn(50, 8) * 4, torch.rand(8) * 0.3
    w, ids = route(logits, bias, top_k=2, score_fn="sqrtsoftplus", renormalize=True, renorm_eps=1e-20, scaling=1.5)
    s = torch.nn.functional.softplus(logits).sqrt()
    want = (s + bias).topk(2).indices
    assert torch.equal(ids.sort(-1).values, want.sort(-1).values)
    g = s.gather(1, ids)
    torch.testing.assert_close(w, 1.5 * g / (g.sum(-1, keepdim=True) + 1e-20))


def test_topk_then_softmax_and_sigmoid_routes():
    logits = torch.randn(6, 5)
    v, i = logits.topk(2)
    w, ids = route(logits, top_k=2, score_fn="topk_softmax")
    torch.testing.assert_close(w, v.softmax(-1))
    w, ids = route(logits, top_k=2, score_fn="topk_sigmoid")
    torch.testing.assert_close(w, torch.sigmoid(v))
    assert torch.equal(ids, i)


@pytest.mark.parametrize("score_fn,extra", [
    ("softmax", dict(renormalize=True)), ("sigmoid", dict(n_group=2, topk_group=1, scaling=1.5)),
    ("topk_softmax", {}), ("topk_sigmoid", {}), ("sparsemixer", dict(jitter_eps=0.5)),
    ("sqrtsoftplus", dict(renormalize=True, renorm_eps=1e-20, scaling=1.5)),
])
def test_route_gradient_matches_autograd_of_reference(score_fn, extra):
    torch.manual_seed(0)
    logits = torch.randn(7, 6, dtype=torch.float64, requires_grad=True)
    bias = torch.rand(6, dtype=torch.float64) * 0.1 if score_fn == "sigmoid" else None
    top_k = 2

    def f(x):
        return route(x, bias, top_k=top_k, score_fn=score_fn, **extra)[0].double()

    # float32 inside the router (as the models do): compare analytic gradient to the reference's autograd
    x32 = logits.detach().float().requires_grad_(True)
    g_op = torch.autograd.grad(f(x32).sum() + (f(x32) ** 2).sum(), x32)[0]
    a = {**ROUTE_DEFAULTS, **extra}
    x32b = logits.detach().float().requires_grad_(True)
    w = ref.route_ref(x32b, bias, top_k=top_k, score_fn=score_fn, **{k: a[k] for k in ROUTE_DEFAULTS})[0]
    g_ref = torch.autograd.grad(w.sum() + (w ** 2).sum(), x32b)[0]
    torch.testing.assert_close(g_op, g_ref)
    assert g_op.abs().max() > 0


@pytest.mark.parametrize("T", [6, 42, 123])
def test_build_pft_sorts_by_expert_without_padding(T):
    E, K = 8, 2
    ids = torch.stack([torch.randperm(E)[:K] for _ in range(T)])
    w = torch.rand(T, K)
    tok, exp, cnt, cw, src = torch.ops.moe.build_pft(ids, w, E, -1, "slot_major", "t")
    assert tok.numel() == T * K and cnt.sum() == T * K
    assert torch.equal(exp, torch.sort(exp).values)
    assert torch.equal(cnt, torch.bincount(ids.flatten(), minlength=E))
    assert torch.equal(ids.flatten()[src], exp) and torch.equal(src // K, tok)
    torch.testing.assert_close(cw, w.flatten()[src])


@pytest.mark.parametrize("order", ["slot_major", "token_major"])
def test_capacity_drops_match_brute_force_and_are_counted(order):
    T, K, E, C = 42, 2, 4, 9
    ids = torch.stack([torch.randperm(E)[:K] for _ in range(T)])
    ids[:20, 0] = 1  # overload expert 1
    w = torch.rand(T, K)
    DROPS.reset()
    tok, exp, cnt, cw, src = torch.ops.moe.build_pft(ids, w, E, C, order, "layer.x")
    fill = [0] * E
    kept = set()
    slots = [(k, t) for k in range(K) for t in range(T)] if order == "slot_major" else \
            [(k, t) for t in range(T) for k in range(K)]
    for k, t in slots:
        e = int(ids[t, k])
        if fill[e] < C:
            kept.add(t * K + k)
            fill[e] += 1
    n_kept = int(cnt.sum())
    assert set(src[:n_kept].tolist()) == kept and src.numel() == T * K  # dropped ones at the tail
    assert (exp[n_kept:] == E).all() and (cw[n_kept:] == 0).all() and (exp[:n_kept] < E).all()
    assert cnt.tolist() == fill and max(fill) == C
    assert DROPS.snapshot()["layer.x"] == {"routed": T * K, "dropped": T * K - len(kept)}


@pytest.mark.parametrize("order", ["slot_major", "token_major", "priority"])
def test_capacity_per_sequence_keeps_what_each_sequence_alone_keeps(order):
    """group_tokens=S (Switch Transformers' capacity per sequence): an assignment is kept exactly when it is kept
    building the buffer of its own sequence alone; its gradient reaches the kept weights only."""
    B, S, K, E, C = 3, 10, 2, 4, 3
    gen = torch.Generator().manual_seed(0)
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(B * S)])
    ids[:S, 0] = 2  # the first sequence overloads expert 2, the others do not
    w = torch.rand(B * S, K, generator=gen, requires_grad=True)
    tok, exp, cnt, cw, src = torch.ops.moe.build_pft(ids, w, E, C, order, "", S)
    kept = set(src[: int(cnt.sum())].tolist())
    want, counts = set(), torch.zeros(E, dtype=torch.int64)
    for b in range(B):
        one = ref.build_pft_ref(ids[b * S:(b + 1) * S], w[b * S:(b + 1) * S], E, C, order)
        want |= {b * S * K + i for i in one[4][: int(one[2].sum())].tolist()}
        counts += one[2]
    assert kept == want and cnt.tolist() == counts.tolist() and len(kept) < B * S * K
    assert (exp[:-1] <= exp[1:]).all() and torch.equal(tok, src // K)
    assert torch.equal(cw, w.flatten()[src] * (exp < E))
    (g,) = torch.autograd.grad(cw.sum(), w)
    assert sorted(g.flatten().nonzero().flatten().tolist()) == sorted(kept)
    grouped_once = ref.build_pft_ref(ids, w, E, C, order, B * S)  # one group of every token: as without groups
    assert all(torch.equal(a, b) for a, b in zip(grouped_once, ref.build_pft_ref(ids, w, E, C, order)))


@pytest.mark.parametrize("capacity", [-1, 3])
@pytest.mark.parametrize("order", ["slot_major", "token_major", "priority"])
def test_build_pft_reads_nothing_back_from_the_device(capacity, order):
    """On meta tensors, which have no values, any read of the data (bincount sizing its output, a boolean mask)
    raises: on CUDA each such read waits for the GPU in every forward."""
    ids, w = torch.empty(10, 2, dtype=torch.int64, device="meta"), torch.empty(10, 2, device="meta")
    for group_tokens in (0, 5):
        out = ref.build_pft_ref(ids, w, 4, capacity, order, group_tokens)
        assert [tuple(t.shape) for t in out] == [(20,), (20,), (4,), (20,), (20,)]


def test_build_pft_gradient_scatters_back():
    ids = torch.tensor([[0, 1], [1, 0], [0, 1]])
    w = torch.rand(3, 2, requires_grad=True)
    cw = torch.ops.moe.build_pft(ids, w, 2, 2, "slot_major", "t")[3]
    (g,) = torch.autograd.grad((cw * torch.arange(1.0, cw.numel() + 1)).sum(), w)
    assert g.count_nonzero() == 4 and cw.numel() == 6  # the two dropped assignments get no gradient


@pytest.mark.parametrize("T,case", [(6, "random"), (42, "one_expert"), (123, "empty_expert"), (5, "k_equals_e")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_expert_mlp_and_combine_match_brute_force(T, case, dtype):
    torch.manual_seed(T)
    H, I, E, K = 8, 6, 4, 2
    if case == "k_equals_e":
        K = E
    x = torch.randn(T, H, dtype=dtype, requires_grad=True)
    wg, wu, wd = (torch.randn(E, I, H, dtype=dtype, requires_grad=True),
                  torch.randn(E, I, H, dtype=dtype, requires_grad=True),
                  torch.randn(E, H, I, dtype=dtype, requires_grad=True))
    ids = torch.stack([torch.randperm(E)[:K] for _ in range(T)])
    if case == "one_expert":
        ids = torch.zeros(T, 1, dtype=torch.long)
        K = 1
    if case == "empty_expert":
        ids = ids % 3  # expert 3 gets nothing
        ids[:, 1] = (ids[:, 0] + 1) % 3
    w = torch.rand(T, K, dtype=dtype, requires_grad=True)
    tok, exp, cnt, cw, src = torch.ops.moe.build_pft(ids, w, E, -1, "slot_major", "t")
    y = torch.ops.moe.expert_mlp(x, tok, cnt, wg, wu, wd, None, None, None, None, "silu", 1.702, 7.0)
    out = torch.ops.moe.combine(y, tok, cw, T)
    expect = brute_moe(x, ids, w, wg, wu, wd)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else {}
    torch.testing.assert_close(out, expect, **tol)
    leaves = [x, wg, wu, wd, w]
    g = torch.autograd.grad((out ** 2).sum(), leaves)
    ge = torch.autograd.grad((expect ** 2).sum(), leaves)
    for a, b in zip(g, ge):
        torch.testing.assert_close(a, b, rtol=1e-4 if dtype == torch.float32 else 1e-7, atol=1e-4)


def test_gradcheck_expert_mlp_with_biases_and_input_scale():
    torch.manual_seed(0)
    T, H, I, E = 5, 4, 3, 3
    d = dict(dtype=torch.float64, requires_grad=True)
    x, wu, wd = torch.randn(T, H, **d), torch.randn(E, I, H, **d), torch.randn(E, H, I, **d)
    wg, bg, bu, bd = torch.randn(E, I, H, **d), torch.randn(E, I, **d), torch.randn(E, I, **d), torch.randn(E, H, **d)
    tok = torch.tensor([0, 3, 1, 2, 4, 0, 2])
    cnt = torch.tensor([3, 0, 4])
    scale = torch.rand(7, **d)
    for act in ("silu", "gelu", "gelu_tanh", "swiglu_clamp", "swiglu_softcap", "silu_clamp"):
        def f(x, wg, wu, wd, bg, bu, bd, scale):
            return torch.ops.moe.expert_mlp(x, tok, cnt, wg, wu, wd, bg, bu, bd, scale, act, 1.702, 0.5)
        assert torch.autograd.gradcheck(f, (x, wg, wu, wd, bg, bu, bd, scale))
    f = lambda x, wu, wd: torch.ops.moe.expert_mlp(x, tok, cnt, None, wu, wd, None, None, None, None, "relu", 1.0, 1.0)  # noqa: E731
    assert torch.autograd.gradcheck(f, (x, wu, wd))


def test_gradcheck_combine():
    y = torch.randn(6, 4, dtype=torch.float64, requires_grad=True)
    w = torch.rand(6, dtype=torch.float64, requires_grad=True)
    tok = torch.tensor([2, 0, 1, 2, 0, 0])
    assert torch.autograd.gradcheck(lambda y, w: torch.ops.moe.combine(y, tok, w, 3), (y, w))
    assert torch.autograd.gradcheck(lambda y: torch.ops.moe.combine(y, tok, None, 4), (y,))


def test_ops_compile_fullgraph_with_dynamic_shapes():
    E, H, I = 4, 8, 6
    wr = torch.randn(E, H)
    wg, wu, wd = torch.randn(E, I, H), torch.randn(E, I, H), torch.randn(E, H, I)

    def layer(x):
        w, ids = route(x @ wr.T, top_k=2, score_fn="softmax", renormalize=True)
        tok, _, cnt, cw, _ = torch.ops.moe.build_pft(ids, w, E, -1, "slot_major", "t")
        y = torch.ops.moe.expert_mlp(x, tok, cnt, wg, wu, wd, None, None, None, None, "silu", 1.702, 7.0)
        return torch.ops.moe.combine(y, tok, cw, x.shape[0])

    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True, dynamic=True)
    for T in (6, 42, 1):
        x = torch.randn(T, H)
        torch.testing.assert_close(compiled(x), layer(x))


def test_unknown_activation_is_a_clear_error():
    from moecompile.runtime.activations import check_activation

    with pytest.raises(ValueError, match="valid: silu"):
        check_activation("swish2", True)


@pytest.mark.parametrize("kw,match", [
    (dict(score_fn="softplus"), r"score_fn='softplus' is not valid; choose one of \['softmax'"),
    (dict(top_k=9), r"top_k=9 must be between 1 and the number of experts \(8\)"),
    (dict(score_fn="sigmoid", n_group=3), r"n_group=3 must divide the 8 experts"),
])
def test_route_rejects_bad_arguments(kw, match):
    with pytest.raises(ValueError, match=match):
        route(torch.randn(4, 8), **{"top_k": 2, "score_fn": "softmax", **kw})


def test_build_pft_and_expert_mlp_reject_bad_arguments():
    ids, w = torch.zeros(3, 1, dtype=torch.long), torch.ones(3, 1)
    with pytest.raises(ValueError, match="drop_order='random' is not valid"):
        torch.ops.moe.build_pft(ids, w, 2, 1, "random", "t")
    x, wu, wd = torch.randn(3, 4), torch.randn(2, 5, 4), torch.randn(2, 4, 5)
    tok, _, cnt, _, _ = torch.ops.moe.build_pft(ids, w, 2, -1, "slot_major", "t")
    with pytest.raises(ValueError, match="needs a gate projection"):
        torch.ops.moe.expert_mlp(x, tok, cnt, None, wu, wd, None, None, None, None, "swiglu_clamp", 1.0, 1.0)


def _same_layout_as_fake(op, *args):
    from torch._subclasses.fake_tensor import FakeTensorMode

    args = [a.detach() if isinstance(a, torch.Tensor) else a for a in args]
    real = op(*args)
    mode = FakeTensorMode()
    fake_args = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
    with mode:
        fake = op(*fake_args)
    real, fake = (list(t) if isinstance(t, (list, tuple)) else [t] for t in (real, fake))
    assert [(r.shape, r.stride(), r.dtype) for r in real] == [(f.shape, f.stride(), f.dtype) for f in fake]


def test_opcheck_every_op_with_transposed_weights():
    """torch.library.opcheck: schema, fake functions (shapes and strides) and autograd registration agree."""
    torch.manual_seed(0)
    T, H, I, E = 6, 8, 4, 3
    logits = torch.randn(T, E, requires_grad=True)
    torch.library.opcheck(torch.ops.moe.route.default,
                          (logits, torch.rand(E), 2, "sigmoid", True, 1e-20, 2.5, 1, 1, "top2_sum", 0.0))
    ids, w = torch.randint(0, E, (T, 2)), torch.rand(T, 2, requires_grad=True)
    for cap in (-1, 3):  # (opcheck's aot_dispatch check cannot sum an op whose first output is an int tensor)
        torch.library.opcheck(torch.ops.moe.build_pft.default, (ids, w, E, cap, "slot_major", ""),
                              test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))
    tok, _, cnt, cw, _ = torch.ops.moe.build_pft(ids, w.detach(), E, -1, "slot_major", "")
    x = torch.randn(T, H, requires_grad=True)
    wg = torch.randn(E, H, I).transpose(1, 2).requires_grad_(True)  # [E, I, H] view, strides of [E, H, I]
    wu = torch.randn(E, I, H, requires_grad=True)
    wd = torch.randn(E, I, H).transpose(1, 2).requires_grad_(True)
    args = (x, tok, cnt, wg, wu, wd, None, None, None, None, "silu", 1.702, 7.0)
    torch.library.opcheck(torch.ops.moe.expert_mlp.default, args)
    # the backward ops run inside autograd only: check that their fakes promise the real shapes and strides
    _same_layout_as_fake(torch.ops.moe.expert_mlp_backward, torch.randn(T * 2, H), *args)
    _same_layout_as_fake(torch.ops.moe.route_backward, torch.randn(T, 2), torch.randn(E, T).t(), None, 2,
                         "softmax", False, 0.0, 1.0, 1, 1, "top2_sum", 0.0)
    y = torch.randn(T * 2, H, requires_grad=True)
    torch.library.opcheck(torch.ops.moe.combine.default, (y, tok, cw.requires_grad_(True), T))
