"""Alpha-beta time model of the expert-parallel all-to-alls, per mesh level (HierMoE §III-B), and the dedup choice.

A message of ``n`` bytes over a collective of kind ``c`` takes ``alpha[c] + beta[c] * n`` seconds: ``alpha`` the
start-up latency, ``beta`` the time per byte. Kinds (``runtime/comm/levels.py``): ``"flat"`` (an all-to-all over
every rank), and per dedup level its two collectives, named by the mesh dimensions their ranks differ in (on a
``("node", "local")`` mesh ``"node"``: among the ranks of equal local index, one per node; ``"local"``: among the
ranks of one node; on ``("rack", "node", "local")`` also ``"rack"``, ``"node+local"``, ``"rack+node"``).
``LinkModel.fit`` takes measured (bytes, seconds) pairs per kind and fits both by least squares, with r2.

``dispatch_times`` predicts one dispatch and combine of a layer from its routing, as the runtime does them on the
mesh, message by message, for ``off`` and each level dedup can run at. Our all-to-alls have exact uneven splits,
so a collective lasts as long as its busiest rank: ``n`` is the most bytes any rank sends to, or receives from,
the others in it (the time the link emulation of ``exchange.emulate_links`` waits is the same expression, per
rank). With dedup at level L, "cross" is L's cross kind and "inner" its inner kind:

    off   flat: the per-expert counts, the rows (one per (token, expert)), the outputs back
    L     cross: the counts, the rows (one per distinct (token, group of L)), the expert ids and routing weights
                of the assignments, the weighted sums back
          inner: the counts, the rows copied to the experts' ranks (one per assignment), the outputs back

``choose_dedup`` takes the least (``off`` on a tie). HierMoE's model (Eqs. 2-5) prices an all-to-all by its
padded size, which fits NCCL's equal-split all-to-all; ours never pads.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .plan import Placement
from .levels import dedup_levels, inner_size, level_kinds

TWO_LEVELS = ("node", "local")


@dataclass(frozen=True)
class LinkModel:
    """Per collective kind: (alpha seconds, beta seconds per byte)."""

    params: dict[str, tuple[float, float]]
    r2: dict[str, float] = field(default_factory=dict)  # of the fit, per kind (empty when written by hand)

    def __post_init__(self):
        for kind, (alpha, beta) in self.params.items():
            if not (alpha >= 0 and beta >= 0 and math.isfinite(alpha) and math.isfinite(beta)):
                raise ValueError(f"link model {kind!r}: alpha and beta must be finite and >= 0, got {alpha}, {beta}")

    def time(self, kind: str, nbytes: float) -> float:
        if kind not in self.params:
            raise ValueError(f"the link model has no {kind!r} collective (it has {sorted(self.params)}): calibrate "
                             "it, or give (alpha, beta) for it")
        alpha, beta = self.params[kind]
        return alpha + beta * nbytes

    @classmethod
    def fit(cls, samples: dict[str, list[tuple[float, float]]]) -> "LinkModel":
        """Least-squares alpha and beta per kind from (bytes, seconds) samples (two sizes at least), with r2."""
        params, r2 = {}, {}
        for kind, pairs in samples.items():
            sizes = {b for b, _ in pairs}
            if len(sizes) < 2:
                raise ValueError(f"{kind!r}: fitting alpha and beta needs timings at two message sizes at least")
            x = torch.tensor([[1.0, float(b)] for b, _ in pairs], dtype=torch.float64)
            y = torch.tensor([float(t) for _, t in pairs], dtype=torch.float64)
            scale = x[:, 1].abs().max()  # bytes span orders of magnitude: solve on a scaled column
            coef = torch.linalg.lstsq(x / torch.tensor([1.0, scale]), y[:, None]).solution[:, 0]
            alpha, beta = float(coef[0]), float(coef[1] / scale)
            residual = y - (alpha + beta * x[:, 1])
            total = ((y - y.mean()) ** 2).sum()
            r2[kind] = float(1 - (residual ** 2).sum() / total) if total > 0 else 1.0
            params[kind] = (max(alpha, 0.0), max(beta, 0.0))  # noise may fit a tiny negative latency
        return cls(params, r2)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps({"params": self.params, "r2": self.r2}, indent=2))

    @classmethod
    def load(cls, path: str | Path) -> "LinkModel":
        data = json.loads(Path(path).read_text())
        return cls({k: tuple(v) for k, v in data["params"].items()}, data.get("r2", {}))


def smooth_max(x: torch.Tensor, gamma: float) -> float:
    """HierMoE's Eq. 11: max(x) * (sum_i (x_i / max(x)) ** gamma) ** (1 / gamma); the max as gamma grows, and it
    moves with every entry (so an expert swap that unloads the second busiest rank also counts)."""
    top = float(x.max())
    if top <= 0:
        return 0.0
    return top * float(((x / top) ** gamma).sum() ** (1.0 / gamma))


def _busiest(sent_SD: torch.Tensor, gamma: float | None = None) -> float:
    """The most bytes any rank sends to, or receives from, the other ranks (``sent_SD[s, d]``: bytes s sends d);
    with ``gamma``, their smooth max."""
    off_diagonal = sent_SD - torch.diag(torch.diag(sent_SD))
    per_rank = torch.maximum(off_diagonal.sum(1), off_diagonal.sum(0))
    return float(per_rank.max()) if gamma is None else smooth_max(per_rank, gamma)


def _matrix(src: torch.Tensor, dst: torch.Tensor, ranks: int, nbytes: float) -> torch.Tensor:
    """Bytes each rank sends each rank, for one ``nbytes`` message per (src, dst) entry."""
    counts = torch.bincount(src * ranks + dst, minlength=ranks * ranks).view(ranks, ranks)
    return counts.double() * nbytes


def messages(ids_TK: torch.Tensor, placement: Placement, source_rank_T: torch.Tensor, row_bytes: int,
             weight_bytes: int = 4, gamma: float | None = None, names=TWO_LEVELS
             ) -> dict[str, list[tuple[str, float]]]:
    """Per dedup choice (``off`` and each level of ``names`` but the innermost), the (collective kind, busiest
    rank's bytes) of each all-to-all of one dispatch and combine of this routing (the tokens of every rank:
    ``source_rank_T[t]`` is where token t starts); with ``gamma``, the smooth max over the ranks (``smooth_max``)
    in place of the busiest. ``names``: the mesh's level names, outermost first (``placement.mesh_shape``'s).
    An id below 0 is a row that stays on its rank (an identity expert's, or one dropped past a capacity)."""
    names = tuple(names)
    if len(names) != len(placement.mesh_shape):
        raise ValueError(f"mesh levels {names} do not match the placement's mesh shape {placement.mesh_shape}")
    ranks, E = math.prod(placement.mesh_shape), placement.num_experts
    T, K = ids_TK.shape
    sent = ids_TK.reshape(-1) >= 0
    src = source_rank_T.repeat_interleave(K)[sent]  # per assignment
    dest = placement.expert_rank[ids_TK.reshape(-1)[sent]]
    token = torch.arange(T).repeat_interleave(K)[sent]
    everyone = torch.ones(ranks, ranks, dtype=torch.float64) - torch.eye(ranks, dtype=torch.float64)
    rows = _matrix(src, dest, ranks, row_bytes)
    plan = {"off": [("flat", _busiest(everyone * (E // ranks) * 8, gamma)), ("flat", _busiest(rows, gamma)),
                    ("flat", _busiest(rows.T, gamma))]}
    r = torch.arange(ranks)
    for level in dedup_levels(names):
        cross, inner = level_kinds(names, level)
        n = inner_size(placement.mesh_shape, names, level)
        same_inner = (r[:, None] % n == r % n).double()  # the cross group: one rank per group of the level
        same_group = (r[:, None] // n == r // n).double()  # the inner group: the ranks of one group of the level
        relay = (dest // n) * n + src % n  # the rank of the token's inner coordinates in the expert's group
        pairs = torch.unique(token * ranks + relay)  # distinct (token, group of the level): one relay per group
        pair_rows = _matrix(source_rank_T[pairs // ranks], pairs % ranks, ranks, row_bytes)
        copies = _matrix(relay, dest, ranks, row_bytes)
        plan[level] = [
            (cross, _busiest(same_inner * 16, gamma)), (cross, _busiest(pair_rows, gamma)),
            (cross, _busiest(_matrix(src, relay, ranks, 16), gamma)),
            (cross, _busiest(_matrix(src, relay, ranks, weight_bytes), gamma)),
            (inner, _busiest(same_group * (E // ranks) * 8, gamma)), (inner, _busiest(copies, gamma)),
            (inner, _busiest(copies.T, gamma)), (cross, _busiest(pair_rows.T, gamma))]
    return plan


def dispatch_times(ids_TK: torch.Tensor, placement: Placement, source_rank_T: torch.Tensor, hidden: int,
                   elem_bytes: int, link: LinkModel, weight_bytes: int = 4, gamma: float | None = None,
                   names=TWO_LEVELS) -> dict[str, float]:
    """Predicted seconds of one dispatch and combine of this routing, per dedup choice (``off`` and each level of
    ``names`` dedup can run at)."""
    return price(messages(ids_TK, placement, source_rank_T, hidden * elem_bytes, weight_bytes, gamma, names), link)


def price(plan: dict[str, list[tuple[str, float]]], link: LinkModel) -> dict[str, float]:
    """Seconds of each choice's all-to-alls, one after another: alpha + beta x bytes of each. The dedup choice
    prices a measured routing's ``messages`` with it, the planner (``moecompile/plan``) their expectation under
    uniform routing (``expected.expected_messages``)."""
    return {mode: sum(link.time(kind, n) for kind, n in msgs) for mode, msgs in plan.items()}


def choose_dedup(times: dict[str, float]) -> str:
    """The choice of least predicted time (``off`` on a tie: the simpler path)."""
    return min(times, key=lambda k: (times[k], k != "off"))
