"""Pure routing arithmetic of expert parallelism (runtime/comm/plan.py): what deduplication at each mesh level
saves, checked against HierMoE's Table II (uniform routing, E = 256, k = 8)."""

import pytest
import torch

from moecompile.runtime.comm.plan import Placement, dedup_stats, distinct_pairs, expected_removed


def _uniform_ids(T, E, K, seed=0):
    return torch.rand(T, E, generator=torch.Generator().manual_seed(seed)).argsort(-1)[:, :K]


@pytest.mark.parametrize("nodes, table", [(4, 0.55), (8, 0.34)])
def test_dedup_removes_what_hiermoe_table_ii_reports(nodes, table):
    """Uniform routing, E = 256, k = 8: 55% of (token, node) sends removed at 4 nodes, 34% at 8; the closed form
    and a sampled routing of 4000 tokens agree with it."""
    assert round(expected_removed(256, 8, nodes), 2) == table
    placement = Placement.contiguous(256, (nodes, 2))
    stats = dedup_stats(_uniform_ids(4000, 256, 8), placement)
    assert abs(stats[0]["removed"] - expected_removed(256, 8, nodes)) < 0.01
    assert stats[1]["removed"] < stats[0]["removed"]  # fewer duplicates per rank than per node


def test_pairs_per_level_and_remote_pairs():
    placement = Placement.contiguous(16, (2, 2))  # 4 experts per rank; ranks 0, 1 on node 0
    ids = torch.tensor([[0, 5], [1, 2], [9, 13]])
    assert distinct_pairs(ids, placement, 0).tolist() == [1, 1, 1]
    assert distinct_pairs(ids, placement, 1).tolist() == [2, 1, 2]
    stats = dedup_stats(ids, placement, source_rank_T=torch.tensor([0, 3, 3]))
    assert stats["assignments"] == 6
    assert (stats[0]["pairs"], stats[1]["pairs"]) == (3, 5)
    # by node: only token 1 (on rank 3, node 1) leaves its node, once for its two experts on node 0
    assert (stats[0]["remote_pairs"], stats[0]["remote_assignments"]) == (1, 2)
    # by rank: token 0 to rank 1, token 1 to rank 0 (once), token 2 to rank 2 (expert 13 is on its own rank 3)
    assert (stats[1]["remote_pairs"], stats[1]["remote_assignments"]) == (3, 4)


def test_bad_placements_name_the_fix():
    with pytest.raises(ValueError, match="do not divide over 4 ranks"):
        Placement.contiguous(10, (2, 2))
    with pytest.raises(ValueError, match=r"ranks in \[0, 4\)"):
        Placement(torch.tensor([0, 4]), (2, 2))
    with pytest.raises(ValueError, match="level 2 is not one of the mesh's 2 levels"):
        Placement.contiguous(8, (2, 2)).group(torch.tensor([0]), 2)
