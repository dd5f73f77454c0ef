"""Alpha-beta time model of the expert-parallel all-to-alls, per mesh level (HierMoE §III-B), and the dedup choice.

A message of ``n`` bytes over a collective of kind ``c`` takes ``alpha[c] + beta[c] * n`` seconds: ``alpha`` the
start-up latency, ``beta`` the time per byte. Kinds: ``"flat"`` (an all-to-all over every rank), and one per mesh
level name (``"node"``: among the ranks of equal local index, one per node; ``"local"``: among the ranks of one
node). ``LinkModel.fit`` takes measured (bytes, seconds) pairs per kind and fits both by least squares, with r2.

``dispatch_times`` predicts one dispatch of a layer from its routing, for a 2-level ``(nodes, local)`` mesh:

    off   one flat all-to-all, one row per distinct (token, rank):        alpha_flat + beta_flat * n_flat
    node  one row per distinct (token, node) across nodes to the peer of equal local index, then one per distinct
          (token, rank) inside the node:                                  alpha_node + beta_node * n_node
                                                                        + alpha_local + beta_local * n_local
    n_c = (ranks in one collective) * (most rows any sender sends any one destination) * H * element size

(the padded size a collective moves, as HierMoE's Eqs. 2, 4 and 5); ``choose_dedup`` takes the least.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .dispatch_plan import Placement

KINDS = ("flat", "node", "local")


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


def _most_rows(sender: torch.Tensor, dest: torch.Tensor, senders: int, dests: int) -> int:
    """The largest count of rows any one sender sends any one destination."""
    if sender.numel() == 0:
        return 0
    return int(torch.bincount(sender * dests + dest, minlength=senders * dests).max())


def _distinct(token: torch.Tensor, dest: torch.Tensor, dests: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The distinct (token, destination) pairs among the given ones."""
    pairs = torch.unique(token * dests + dest)
    return pairs // dests, pairs % dests


def dispatch_times(ids_TK: torch.Tensor, placement: Placement, source_rank_T: torch.Tensor, hidden: int,
                   elem_bytes: int, link: LinkModel) -> dict[str, float]:
    """Predicted seconds of one dispatch of this routing, per dedup choice (``off``, ``node``); the combine moves the
    same rows back. Needs a 2-level ``(nodes, local)`` placement."""
    if len(placement.mesh_shape) != 2:
        raise ValueError(f"dispatch_times models a 2-level (nodes, local) mesh; got {placement.mesh_shape}")
    nodes, local = placement.mesh_shape
    ranks = nodes * local
    T, K = ids_TK.shape
    row = hidden * elem_bytes
    token = torch.arange(T).repeat_interleave(K)
    dest_rank = placement.expert_rank[ids_TK].reshape(-1)
    tok_r, rank_r = _distinct(token, dest_rank, ranks)  # off: one row per (token, rank)
    src_r = source_rank_T[tok_r]
    flat = ranks * _most_rows(src_r, rank_r, ranks, ranks) * row
    # node: one row per (token, node) to the rank of the sender's local index in that node, which then sends one
    # row per (token, rank) inside the node
    tok_n, node_n = _distinct(token, dest_rank // local, nodes)
    inter = nodes * _most_rows(source_rank_T[tok_n], node_n, ranks, nodes) * row
    peer = (rank_r // local) * local + src_r % local
    intra = local * _most_rows(peer, rank_r, ranks, ranks) * row
    return {
        "off": link.time("flat", flat),
        "node": link.time("node", inter) + link.time("local", intra),
    }


def choose_dedup(times: dict[str, float]) -> str:
    """The choice of least predicted time (``off`` on a tie: the simpler path)."""
    return min(times, key=lambda k: (times[k], k != "off"))
