"""HybridEP's stream model (hybridep.md §III, Eqs. 1-12), priced on the collectives our runtime runs, and the
choice of expert-domain sizes it makes (``parallelize(..., expert_domains="auto")``).

A layer on a mesh of levels (sizes s_l, outermost first) with domain sizes d_l (``hybrid.py``); every collective
costs ``alpha + beta x n`` of its kind (``cost_model.LinkModel``, ``levels.kind``: the dimensions its ranks differ
in), ``n`` the bytes its busiest rank sends or receives (the same expression ``exchange.emulate_links`` waits):

    Eq. 1   a GEMM of (L, H) x (H, M) takes L M H / C seconds, C the measured compute rate (multiply-adds / s)
    Eq. 2   comp   = pre-expert time (PE, given) + this rank's expert rows x their GEMMs / C
    Eq. 4   AG     = the domain's all-gather: (D_size - 1) x P_E bytes in (P_E: one rank's own experts' bytes)
    Eq. 3,5 A2A    = the exchange over the ranks of equal offsets: the per-expert counts, the routed rows (only
                     those for other domains' experts), the outputs back (the two A2As of Eq. 5)
    Eq. 7   ovlp   = min(PE, AG) where the runtime starts the all-gather before the pre-expert part
                     (``overlap``: the distribute pass does), else 0; our expert GEMMs do not overlap
                     communication, so no n Lat_EP term
    Eq. 8,9 total  = comp + AG + A2A - ovlp, comp of the slowest rank (every collective lasts as its busiest rank)

The paper prices a forward. A training step (``backward=True``) adds the backward's terms, ``bwd``: the expert
GEMMs twice (input and weight gradients, 2 x comp - PE), the rows' gradients exchanged as the rows were (the two
A2As; the counts are known), each gathered copy's gradient reduce-scattered back to its owner (the all-gather's
bytes, over its group), and with ``reshard`` the all-gather again. That one is started ahead as in forward
(``passes/regather.py``: right after the later layer's experts' backward) and, with ``overlap``, hidden behind the
pre-expert part's backward, taken as twice its forward (2 PE); the others overlap nothing in our runtime
(``domains.py``'s backward waits for its reduce-scatter), so a large domain whose all-gather the pre-expert time
hides in forward still pays its gradients' way back.

Eqs. 10-12 solve this for one level, uniform routing and one p on every GPU (p = (G - d) / (G - 1), d the domain
size): all-gather only (p = 0) when 2 D >= G P_E (D: a rank's routed-row bytes), else the least p with
AG <= PE (``closed_form``); without overlap that is p = 1 (plain expert parallelism). ``choose`` searches every
candidate instead (each level's divisors), on the example's real routing, and agrees with the closed form where
both apply (``tests/test_hybrid.py``).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch

from . import hybrid
from .levels import kind


@dataclass(frozen=True)
class Prediction:
    """Seconds of one forward of a layer's expert communication and compute, per Eq. 8's terms, and ``bwd``, its
    backward's (0 for a forward alone); bytes per collective of the busiest rank."""

    domain_sizes: tuple[int, ...]
    comp: float
    ag: float
    a2a: float
    ovlp: float
    ag_bytes: float
    a2a_bytes: float
    bwd: float = 0.0

    @property
    def total(self) -> float:
        return self.comp + self.ag + self.a2a - self.ovlp + self.bwd


def candidates(sizes) -> list[tuple[int, ...]]:
    """Every choice of domain sizes: per level, each divisor of its size (plain expert parallelism first)."""
    return list(itertools.product(*[[d for d in range(1, s + 1) if s % d == 0] for s in sizes]))


def _busiest(matrix: torch.Tensor) -> float:
    off = matrix - torch.diag(torch.diag(matrix))
    return float(torch.maximum(off.sum(0), off.sum(1)).max()) if off.numel() else 0.0


def predict(ids_TK: torch.Tensor, source_rank_T: torch.Tensor, sizes, names, domain_sizes, num_experts: int,
            row_bytes: int, expert_bytes: int, link, macs_per_row: float = 0.0, rate: float = math.inf,
            pre_s: float = 0.0, overlap: bool = False, backward: bool = False, reshard: bool = False) -> Prediction:
    """Eq. 8 for these domain sizes and this routing (every rank's tokens: token t starts on rank
    ``source_rank_T[t]``; experts owned contiguously, E / W per rank). ``row_bytes``: one routed row's bytes;
    ``expert_bytes``: P_E; ``macs_per_row``: the multiply-adds of one row through its expert; ``rate``: C.
    ``backward``: a training step, the backward's terms too (module docstring; ``reshard``: gathered again)."""
    sizes, domain_sizes = hybrid.check(sizes, domain_sizes)
    names = tuple(names)
    W = math.prod(sizes)
    per_rank = num_experts // W
    gather = [hybrid.groups(m, sizes, domain_sizes)[0] for m in range(W)]
    exchange = [hybrid.groups(m, sizes, domain_sizes)[1] for m in range(W)]
    T, K = ids_TK.shape
    src = source_rank_T.repeat_interleave(K)
    owner = (ids_TK.reshape(-1) // per_rank).tolist()
    # where each (token, expert) row is computed: at home if its owner is in the home rank's domain, else at the
    # home rank's exchange peer in the owner's domain
    peer = {(s, o): next(n for n in exchange[s] if n in gather[o]) for s in range(W) for o in range(W)}
    dest = torch.tensor([s if o in gather[s] else peer[(s, o)] for s, o in zip(src.tolist(), owner)],
                        dtype=torch.long)
    rows = torch.bincount(src * W + dest, minlength=W * W).view(W, W).double()
    computed = rows.sum(0)  # rows each rank runs its experts on
    comp = pre_s + float(computed.max()) * macs_per_row / rate
    return price(link, names, sizes, domain_sizes, expert_bytes, _busiest(rows * row_bytes), per_rank, comp, pre_s,
                 overlap, backward, reshard)


def price(link, names, sizes, domain_sizes, expert_bytes: float, a2a_bytes: float, experts_per_rank: int,
          comp: float = 0.0, pre_s: float = 0.0, overlap: bool = False, backward: bool = False,
          reshard: bool = False) -> Prediction:
    """Eqs. 4-8 priced on ``link`` (one kind per set of levels a collective spans) from the bytes they move: the
    domain's all-gather of (S - 1) x ``expert_bytes``; the exchange's per-expert counts, then ``a2a_bytes`` of rows
    (the busiest rank's: a measured routing's, or the planner's expectation, ``moecompile/plan``) and the outputs
    back; with ``backward``, the backward's terms (module docstring). ``predict`` and the planner's
    ``domain_times`` both price with it (the planner adds a step's backward itself, ``plan/cost.py``)."""
    sizes, domain_sizes = hybrid.check(sizes, domain_sizes)
    gather, exchange = hybrid.groups(0, sizes, domain_sizes)
    d = len(gather)
    ag = a2a = ag_bytes = rows = 0.0
    if d > 1:
        ag_bytes = (d - 1) * expert_bytes
        ag = link.time(kind(names, spanned(gather, sizes)), ag_bytes)
    if len(exchange) > 1:
        a2a_kind = kind(names, spanned(exchange, sizes))
        counts = (len(exchange) - 1) * experts_per_rank * d * 8  # each peer's per-expert counts (int64)
        rows = 2 * link.time(a2a_kind, a2a_bytes)  # the rows out, the outputs back
        a2a = link.time(a2a_kind, counts) + rows
    else:
        a2a_bytes = 0.0
    # the backward: input and weight gradients (2 x the expert GEMMs), the rows' gradients both ways, the gathered
    # copies' gradients reduce-scattered (the all-gather's bytes), with reshard the all-gather again, started ahead
    regather = (max(0.0, ag - 2 * pre_s) if overlap else ag) if reshard else 0.0
    bwd = 2 * (comp - pre_s) + rows + ag + regather if backward else 0.0
    return Prediction(tuple(domain_sizes), comp, ag, a2a, min(pre_s, ag) if overlap else 0.0, ag_bytes, a2a_bytes,
                      bwd)


def spanned(ranks, sizes) -> tuple[int, ...]:
    """The levels (mesh dimensions) the ranks differ in: their collective's kind (``levels.kind``)."""
    locs = [hybrid.locations(r, sizes) for r in ranks]
    return tuple(d for d in range(len(sizes)) if len({loc[d] for loc in locs}) > 1)


def choose(predictions: list[Prediction]) -> Prediction:
    """The least total (the smaller domains on a tie: less memory for gathered copies)."""
    return min(predictions, key=lambda p: (p.total, math.prod(p.domain_sizes)))


def closed_form(G: int, D: float, P_E: float, B: float, pre_s: float) -> float:
    """Eqs. 11-12's p for one level of G workers, a rank's routed-row bytes D, its experts' bytes P_E, bandwidth
    B (bytes / s) and pre-expert time PE (with the overlap of Eq. 7): 0 when 2 D >= G P_E, else the least p
    whose all-gather the pre-expert part hides."""
    if 2 * D >= G * P_E:
        return 0.0
    return min(1.0, max(0.0, 1 - B * pre_s / (P_E * (G - 1))))
