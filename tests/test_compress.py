"""SR compression of gathered experts (runtime/comm/compress.py, hybridep.md §IV-B): q = 1 round-trips exactly;
q < 1 keeps the residual entries largest in magnitude and costs k x (value + int32 index) bytes per expert;
bad q is refused. ``decoded_in_backward_again`` is run by tests/test_hybrid.py's world-4 training with compress=q:
the decoded copies are computed again in backward, not kept from forward."""

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
    """The decoded copies are not kept from forward to backward: no tensor saved for backward has their shape, and
    moe.sr_decode runs in backward as often as in forward (the partitioner computes it again)."""
    from unittest import mock

    copies = {(world * w.shape[0], *w.shape[1:]) for w in (experts.gate_up_proj, experts.down_proj)}
    saved, decodes = [], []
    real = compress._decode_domain
    with mock.patch.object(compress, "_decode_domain", lambda *a: (decodes.append(torch.is_grad_enabled()),
                                                                    real(*a))[1]):
        with torch.autograd.graph.saved_tensors_hooks(lambda t: (saved.append(tuple(t.shape)), t)[1], lambda t: t):
            loss = compiled(ids, labels=ids).loss
        forward = len(decodes)
        loss.backward()
    assert saved and not copies & set(saved), (copies, saved)
    assert forward == 2 * len(compiled.model.layers) and len(decodes) == 2 * forward, decodes
