"""HybridEP's stream model (runtime/comm/stream.py, hybridep.md §III), pure: its choice in both of §III's regimes,
its bytes against the runtime's, its search against Eqs. 11-12's closed form, and a training step's backward
terms. (Its predictions against measured communication under emulated links, and expert_domains="auto" training:
tests/test_hybrid.py.)"""

import pytest
import torch

from moecompile.runtime.comm import stream
from moecompile.runtime.comm.cost_model import LinkModel, messages
from moecompile.runtime.comm.plan import Placement


def _uniform(W, T, E):
    """Every rank's T tokens, one expert each, spread evenly over the E experts (hybridep.md §III's even gate)."""
    ids = (torch.arange(W * T) % E).view(-1, 1)
    return ids, torch.arange(W).repeat_interleave(T)


def test_stream_model_moves_as_section_iii_says():
    """One level of 4 workers, no start-up cost, even routing: the model picks one domain of every worker (all-
    gather only) when a rank's data D is large against its experts' bytes P_E (2 D > G P_E), and domain size 1
    (plain expert parallelism) when the experts are large (hybridep.md Eqs. 11-12 without overlap); its bytes are
    the runtime's (domain size 1: plain expert parallelism's rows; one domain: (G - 1) P_E, no row)."""
    link = LinkModel({"flat": (0.0, 1e-9)})
    W, T, E, row = 4, 64, 8, 256
    ids, source = _uniform(W, T, E)
    D = T * row  # a rank's routed rows
    for P_E, want in ((D // 8, (4,)), (D, (1,))):  # 2 D = 16 P_E > 4 P_E; 2 D = 2 P_E < 4 P_E
        got = [stream.predict(ids, source, [W], ["ep"], c, E, row, P_E, link) for c in stream.candidates([W])]
        print({p.domain_sizes: f"{p.total * 1e6:.1f} us" for p in got})
        assert stream.choose(got).domain_sizes == want, (P_E, got)
    one, every = (stream.predict(ids, source, [W], ["ep"], (d,), E, row, 1000, link) for d in (1, W))
    plain = messages(ids, Placement.contiguous(E, (W,)), source, row, names=("ep",))["off"]
    assert one.a2a_bytes == plain[1][1] and one.ag_bytes == 0
    assert every.a2a_bytes == 0 and every.ag_bytes == (W - 1) * 1000 and every.a2a == 0


def test_stream_model_agrees_with_the_closed_form():
    """With Eq. 7's overlap and a pre-expert time PE, Eqs. 11-12 give p = 1 - B PE / (P_E (G - 1)) when
    2 D < G P_E: on one level of 8, PE = 3 P_E / B gives p = 4 / 7, a domain of 8 - 4 = 4 workers; the search
    over every candidate (1, 2, 4, 8) picks the same. When 2 D >= G P_E both give p = 0 (one domain of 8)."""
    B = 1e9
    link = LinkModel({"flat": (0.0, 1 / B)})
    W, T, E, row = 8, 64, 8, 1024
    ids, source = _uniform(W, T, E)
    D = T * row
    for P_E, pre in ((D / 2, 3 * (D / 2) / B), (D / 8, 3 * (D / 8) / B)):
        p = stream.closed_form(W, D, P_E, B, pre)
        domain = round(W - p * (W - 1))
        got = [stream.predict(ids, source, [W], ["ep"], c, E, row, P_E, link, pre_s=pre, overlap=True)
               for c in stream.candidates([W])]
        print(f"P_E {P_E:.0f}: closed form p {p:.3f} (domain {domain}), search {stream.choose(got).domain_sizes}")
        assert stream.choose(got).domain_sizes == (domain,)
    assert stream.closed_form(W, D, D / 2, B, 3 * (D / 2) / B) == pytest.approx(4 / 7)


def test_a_training_step_pays_the_gathered_gradients_back():
    """One level of 8, experts as large as a rank's rows (P_E = D) and a pre-expert time that hides even the whole
    all-gather: a forward alone gathers every expert (one domain of 8, its all-gather free behind PE); a training
    step keeps plain expert parallelism, since each gathered copy's gradient goes back to its owner unhidden
    (7 P_E) against the rows' 2 x 7/8 D each way; the expert GEMMs count twice more in backward. Gathered again
    for backward (reshard), the all-gather is started ahead there too: hidden behind the pre-expert backward (2 PE)
    here, 7 P_E more without overlap, and what 2 PE does not hide where PE is short."""
    B = 1e9
    link = LinkModel({"flat": (0.0, 1 / B)})
    W, T, E, row = 8, 64, 8, 1024
    ids, source = _uniform(W, T, E)
    D = T * row
    pre, macs, rate = 10 * D / B, 1000.0, 1e12
    common = dict(macs_per_row=macs, rate=rate, pre_s=pre, overlap=True)

    def priced(**kw):
        return {c: stream.predict(ids, source, [W], ["ep"], c, E, row, D, link, **common, **kw)
                for c in stream.candidates([W])}

    forward, step, resharded = priced(), priced(backward=True), priced(backward=True, reshard=True)
    assert stream.choose(list(forward.values())).domain_sizes == (8,)
    assert stream.choose(list(step.values())).domain_sizes == (1,)
    assert all(p.bwd == 0 for p in forward.values())
    expert = T * macs / rate  # the busiest rank's rows through their experts (even routing: T rows each)
    for c, want in (((8,), 7 * D / B), ((1,), 2 * 7 / 8 * D / B)):  # the gradients' way back
        assert step[c].bwd == pytest.approx(2 * expert + want), c
        assert step[c].total == pytest.approx(forward[c].total + step[c].bwd), c
    assert resharded[(8,)].bwd == pytest.approx(step[(8,)].bwd)  # the all-gather again, hidden behind 2 PE
    assert resharded[(1,)].bwd == step[(1,)].bwd  # no domain: nothing gathered
    for overlap, short_pe, want in ((False, 10, 14), (True, 2, 7 + 7 - 4)):  # ... not hidden; 2 PE hides 4 of 7
        p = stream.price(link, ["ep"], [W], [8], D, 0.0, 1, comp=short_pe * D / B, pre_s=short_pe * D / B,
                         overlap=overlap, backward=True, reshard=True)
        assert p.bwd == pytest.approx(want * D / B), (overlap, p)
