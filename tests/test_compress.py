"""SR compression of gathered experts (runtime/comm/compress.py, hybridep.md §IV-B): q = 1 round-trips exactly;
q < 1 keeps the residual entries largest in magnitude and costs k x (value + int32 index) bytes per expert;
bad q is refused; the experts decode one owner's experts at a time (moe.expert_mlp_sr) and equal the whole domain
decoded. ``decoded_in_backward_again`` is run by tests/test_hybrid.py's world-4 training with compress=q: the
decoded copies are computed again in backward, not kept from forward, and never whole. ``gathered_copies_saved``,
run there too, measures what exact domains save for backward (their copies, unless reshard_after_forward=True)."""

import pytest
import torch

from moecompile.runtime.comm import compress


def test_round_trip_at_q_one_is_exact():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(4, 6, 5, generator=gen)
    shared = w.mean(0)
    values, indices = compress.encode(w, shared, 1.0)
    assert values.shape == (4, 30) and indices.dtype == torch.int32
    torch.testing.assert_close(compress.decode(values, indices, shared).view_as(w), w, rtol=0, atol=1e-6)


def test_keeps_the_largest_residuals_and_counts_bytes():
    shared = torch.zeros(10)
    w = torch.zeros(2, 10)
    w[0, 3], w[0, 7], w[1, 1] = 5.0, -4.0, 2.0  # sparse residuals: two and one entries
    w[0, 0] = 0.1
    values, indices = compress.encode(w, shared, 0.2)  # k = 2 of 10
    got = compress.decode(values, indices, shared)
    want = w.clone()
    want[0, 0] = 0.0  # the smallest residual of expert 0 dropped
    torch.testing.assert_close(got, want)
    assert compress.encoded_bytes(2, 10, 0.2, 4) == 2 * 2 * (4 + 4)
    assert compress.encoded_bytes(2, 10_000, 0.02, 2) == 2 * 200 * 6  # vs 2 x 10_000 x 2 bytes uncompressed


@pytest.mark.parametrize("q", [0, -0.1, 1.5])
def test_bad_fraction_is_refused(q):
    with pytest.raises(ValueError, match="must be in \\(0, 1\\]"):
        compress.kept(10, q)


def decoded_in_backward_again(compiled, ids, experts, world):
    """The decoded copies are not kept from forward to backward, and never exist whole: no tensor saved for backward
    has a whole domain's shape, and the experts decode one owner's experts at a time (moe.expert_mlp_sr), each of
    the W - 1 other owners per weight (gate, up, down) and layer, in forward and again in backward."""
    from unittest import mock

    from moecompile.runtime.comm import sr_experts

    E_l, (I, H) = experts.gate_up_proj.shape[0], experts.down_proj.shape[2:0:-1]
    copies = {(world * E_l, I, H), (world * E_l, H, I)}
    saved, decodes = [], []
    real = compress.decode
    with mock.patch.object(sr_experts, "decode", lambda *a: (decodes.append((torch.is_grad_enabled(),
                                                                              a[0].shape[0])), real(*a))[1]):
        with torch.autograd.graph.saved_tensors_hooks(lambda t: (saved.append(tuple(t.shape)), t)[1], lambda t: t):
            loss = compiled(ids, labels=ids).loss
        forward = len(decodes)
        loss.backward()
    assert saved and not copies & set(saved), (copies, saved)
    assert forward == 3 * (world - 1) * len(compiled.model.layers) and len(decodes) == 2 * forward, decodes
    assert {rows for _, rows in decodes} == {E_l}, decodes


def gathered_copies_saved(compiled, ids, model, world: int) -> tuple[int, int]:
    """The bytes one training step of ``compiled`` saves for backward: (those with a whole domain's rows of expert
    weights, [world x E_l, ...]: the copies one domain of every rank gathers, or views of them; all of them)."""
    rows = {world * p.shape[0] for p in model.parameters() if getattr(p, "_moe_sharded", False) and p.dim() == 3}
    held = {}  # a ModuleList layer's: the experts it holds here (world x as many stacked, gathered)
    for name in model._moe_parallel.module_list_experts & dict(model.named_parameters()).keys():
        layer, _, rest = name.partition(".experts.")
        held.setdefault(layer, set()).add(rest.split(".")[0])
    rows |= {world * len(experts) for experts in held.values()}
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: (saved.append(t), t)[1], lambda t: t):
        loss = compiled(ids, labels=ids).loss
    loss.backward()
    nbytes = [t.numel() * t.element_size() for t in saved]
    return sum(b for t, b in zip(saved, nbytes) if t.dim() == 3 and t.shape[0] in rows), sum(nbytes)


@pytest.mark.parametrize("gated, H", [(True, 8), (False, 8), (True, 6)])  # H = 6: no grouped_mm (16-byte rows)
def test_experts_decode_one_owner_at_a_time(gated, H):
    """moe.expert_mlp_sr (runtime/comm/sr_experts.py) equals decoding the whole domain (4 owners x 2 experts) and
    running moe.expert_mlp, forward and every gradient (x, biases, input scale, and each weight's whole-domain
    copies), on grouped GEMMs and (H = 6) without, with this rank's own experts exact; every decode it makes is one
    owner's 2 experts, never the domain's 8, and an owner whose experts got no rows is not decoded. With the
    experts frozen the weights' gradients are not computed, the others the same."""
    from unittest import mock

    from moecompile.runtime.comm import sr_experts

    gen = torch.Generator().manual_seed(1)
    S, E_l, I, T, rank = 4, 2, 4, 6, 1
    own = [torch.randn(E_l, *shape, generator=gen) for shape in ([(I, H)] if gated else []) + [(I, H), (H, I)]]
    others = [torch.randn(S * E_l, *w.shape[1:], generator=gen) for w in own]
    for w, o in zip(own, others):
        o[rank * E_l:(rank + 1) * E_l] = w
    shared = [o.mean(0) for o in others]
    pairs = [compress.encode(o, s, 0.5) for o, s in zip(others, shared)]
    values, indices = [p[0] for p in pairs], [p[1] for p in pairs]
    counts = torch.tensor([3, 1, 2, 1, 0, 0, 1, 2])  # owner 1 is this rank; owner 2 gets no rows
    tok = torch.randint(0, T, (int(counts.sum()),), generator=gen)
    x = torch.randn(T, H, generator=gen)
    biases = [torch.randn(S * E_l, n, generator=gen) for n in (I, I, H)]
    biases[0] = biases[0] if gated else None
    scale = torch.rand(tok.shape[0], generator=gen)
    attrs = ("silu" if gated else "gelu", 1.702, 7.0)

    copies = [compress._decode_domain(v, i, s, w, rank) for v, i, s, w in zip(values, indices, shared, own)]
    leaves = [t.clone().requires_grad_(True) for t in (x, *copies, *[b for b in biases if b is not None], scale)]
    x_, *rest = leaves
    weights, extra = rest[:len(own)], iter(rest[len(own):])
    bg, bu, bd = [next(extra) if b is not None else None for b in biases]
    want = torch.ops.moe.expert_mlp(x_, tok, counts, *(weights if gated else [None, *weights]), bg, bu, bd,
                                    rest[-1], *attrs)
    grad_y = torch.randn(want.shape, generator=gen)
    want_grads = torch.autograd.grad(want, leaves, grad_y)

    decoded, real = [], compress.decode
    args = (x, tok, counts, values, indices, shared, own, gated, *biases, scale, *attrs)
    with mock.patch.object(sr_experts, "decode", lambda *a: (decoded.append(a[0].shape[0]), real(*a))[1]):
        got = sr_experts.sr_forward(*args, rank=rank)
        got_grads = sr_experts.sr_backward(grad_y, *args, rank=rank)
    torch.testing.assert_close(got, want)
    assert len(got_grads) == len(want_grads)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w)
    assert decoded == [E_l] * (2 * 2 * len(own)), decoded  # owners 0 and 3, forward and backward, each weight
    frozen = sr_experts.sr_backward(grad_y, *args, rank=rank, needs=[True, False, True, True, True, True])
    assert len(frozen) == len(want_grads) - len(own)  # frozen experts: no weight gradient, the rest as before
    for g, w in zip(frozen, want_grads[:1] + want_grads[1 + len(own):]):
        torch.testing.assert_close(g, w)


def test_frozen_experts_of_a_domain_get_no_gradient_and_no_reduction(tmp_path):
    """moe.expert_mlp_sr through autograd (one rank's group): with the experts frozen the op asks for no weight
    gradient, so none is computed nor reduced to the owners (``moe.domain_reduce`` is not called: every rank's
    experts are frozen alike); x's and the down bias's gradients as with the experts trained."""
    from datetime import timedelta

    import torch.distributed as dist

    from moecompile.runtime.comm import sr_experts  # noqa: F401  (registers moe.expert_mlp_sr)

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rendezvous", rank=0, world_size=1,
                            timeout=timedelta(seconds=60))
    try:
        gen = torch.Generator().manual_seed(1)
        E_l, I, H, T = 4, 8, 16, 6
        own = [torch.randn(E_l, *shape, generator=gen) for shape in [(I, H), (I, H), (H, I)]]
        shared = [o.mean(0) for o in own]
        pairs = [compress.encode(o, s, 0.5) for o, s in zip(own, shared)]
        counts, tok = torch.tensor([3, 1, 2, 1]), torch.randint(0, T, (7,), generator=gen)
        inputs = (torch.randn(T, H, generator=gen), torch.randn(E_l, H, generator=gen))
        group = dist.group.WORLD.group_name

        def run(frozen):
            x, bd = (t.clone().requires_grad_(True) for t in inputs)
            weights = [w.clone().requires_grad_(not frozen) for w in own]
            y = torch.ops.moe.expert_mlp_sr(x, tok, counts, [p[0] for p in pairs], [p[1] for p in pairs], shared,
                                            weights, True, None, None, bd, None, "silu", 1.702, 7.0, group, "l")
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                y.backward(torch.ones_like(y))
            reduced = sum(1 for e in prof.events() if e.name == "moe::domain_reduce")
            return x.grad, bd.grad, [w.grad for w in weights], reduced

        trained, frozen = run(False), run(True)
        assert trained[3] == 3 and all(g is not None for g in trained[2])
        assert frozen[3] == 0 and all(g is None for g in frozen[2])
        assert torch.equal(trained[0], frozen[0]) and torch.equal(trained[1], frozen[1])
    finally:
        dist.destroy_process_group()
