"""Where routed tokens go under expert parallelism, and what deduplication saves (pure torch: no process group).

Experts live on the ranks of a mesh whose levels are listed outermost first, e.g. ``("node", "local")`` of shape
``(2, 2)``: rank ``r`` is on node ``r // 2``. A token routed to K experts is, without dedup, sent once per
assignment; deduplicated at a level, once per distinct (token, group of that level) pair, and copied to its
experts inside the group (X-MoE's redundancy-bypassing dispatch, HierMoE's HierD-AlltoAll). On the way back the
expert outputs are weighted and summed inside the group before the one return transfer, so the return bytes are
the same pairs.

    ids [T, K] = [[0, 5], [1, 2]], 4 experts per rank, mesh (2, 2): experts 0-3 on rank 0, 4-7 on rank 1 (node 0)
    assignments 4; distinct (token, rank) 3; distinct (token, node) 2: dedup at "node" sends 2 rows, not 4
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Placement:
    """Which rank holds each expert, on a mesh of ``mesh_shape`` ranks per level (outermost first)."""

    expert_rank: torch.Tensor  # [E] int64
    mesh_shape: tuple[int, ...]

    def __post_init__(self):
        ranks = math.prod(self.mesh_shape)
        if not self.mesh_shape or any(n < 1 for n in self.mesh_shape):
            raise ValueError(f"mesh_shape must be positive sizes, outermost level first; got {self.mesh_shape}")
        r = self.expert_rank
        if r.dim() != 1 or r.dtype != torch.int64 or (r.numel() and (int(r.min()) < 0 or int(r.max()) >= ranks)):
            raise ValueError(f"expert_rank must be a 1-D int64 tensor of ranks in [0, {ranks}); got {r}")

    @classmethod
    def contiguous(cls, num_experts: int, mesh_shape: tuple[int, ...]) -> "Placement":
        """E / ranks consecutive experts per rank, in rank order (expert parallelism's default placement)."""
        ranks = math.prod(mesh_shape)
        if num_experts % ranks:
            raise ValueError(f"{num_experts} experts do not divide over {ranks} ranks (mesh {tuple(mesh_shape)}): "
                             f"use a mesh whose size divides the expert count")
        return cls(torch.arange(num_experts) // (num_experts // ranks), tuple(mesh_shape))

    @property
    def num_experts(self) -> int:
        return self.expert_rank.numel()

    def group(self, ranks: torch.Tensor, level: int) -> torch.Tensor:
        """The index of the group at ``level`` (0: the outermost) that each of ``ranks`` belongs to; the last level
        is the rank itself."""
        if not 0 <= level < len(self.mesh_shape):
            raise ValueError(f"level {level} is not one of the mesh's {len(self.mesh_shape)} levels")
        return ranks // math.prod(self.mesh_shape[level + 1:])


def _firsts(ids_TK: torch.Tensor, placement: Placement, level: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's K destination groups at ``level``, sorted, and whether each is the first of its group (one
    row is sent per first)."""
    if ids_TK.dim() != 2:
        raise ValueError(f"ids_TK must be [T, K] expert ids; got shape {tuple(ids_TK.shape)}")
    ordered = placement.group(placement.expert_rank[ids_TK], level).sort(dim=-1).values
    first = torch.ones_like(ordered, dtype=torch.bool)
    first[:, 1:] = ordered[:, 1:] != ordered[:, :-1]
    return ordered, first


def distinct_pairs(ids_TK: torch.Tensor, placement: Placement, level: int) -> torch.Tensor:
    """[T] number of distinct groups at ``level`` each token's K experts live in: the rows it sends when
    deduplicated there."""
    return _firsts(ids_TK, placement, level)[1].sum(-1)


def dedup_stats(ids_TK: torch.Tensor, placement: Placement, source_rank_T: torch.Tensor | None = None) -> dict:
    """Rows sent per level with and without dedup. ``{"assignments": T*K, level: {"pairs": distinct (token, group)
    pairs, "removed": fraction of the assignments they save, "remote_pairs": pairs whose group is not the token's
    own (with ``source_rank_T``, the rank each token starts on), ...}}``. Bytes on a level's links are its remote
    pairs times H times the element size, each way."""
    out: dict = {"assignments": ids_TK.numel()}
    for level in range(len(placement.mesh_shape)):
        ordered, first = _firsts(ids_TK, placement, level)
        pairs = int(first.sum())
        stats = {"pairs": pairs, "removed": 1 - pairs / max(1, ids_TK.numel())}
        if source_rank_T is not None:
            remote = ordered != placement.group(source_rank_T, level)[:, None]
            stats["remote_pairs"] = int((first & remote).sum())
            stats["remote_assignments"] = int(remote.sum())
        out[level] = stats
    return out


def expected_removed(num_experts: int, top_k: int, groups: int) -> float:
    """The fraction of assignments that dedup over ``groups`` equal groups removes, in expectation, when each token
    picks K distinct experts uniformly at random (HierMoE's Table II setting): 1 - groups * P(a group is hit) / K,
    P(hit) = 1 - C(E - E/groups, K) / C(E, K)."""
    if num_experts % groups or not 1 <= top_k <= num_experts:
        raise ValueError(f"need groups dividing E and 1 <= K <= E; got E={num_experts}, K={top_k}, groups={groups}")
    miss = math.comb(num_experts - num_experts // groups, top_k) / math.comb(num_experts, top_k)
    return 1 - groups * (1 - miss) / top_k
