"""Expert domains as data (HybridEP, hybridep.md §IV-A; runtime/comm/hybrid.py): Algorithm 1's decision for every
ordered pair of ranks, checked against the paper's Table VII (the communication frequency of one level of 8, 16
and 32 workers at every domain size), Fig. 8(b)'s two-level example, and bad input; and the all-gather of a domain's experts with its gradient
(runtime/comm/domains.py) on gloo."""

import itertools
from datetime import timedelta

import pytest
import torch
import torch.multiprocessing as mp

import moecompile
from moecompile.runtime.comm import hybrid

# hybridep.md Table VII: EP size -> {domain size: (A2A, AG)}
TABLE_VII = {
    8: {1: (56, 0), 2: (24, 8), 4: (8, 24), 8: (0, 56)},
    16: {1: (240, 0), 2: (112, 16), 4: (48, 48), 8: (16, 112), 16: (0, 240)},
    32: {1: (992, 0), 2: (480, 32), 4: (224, 96), 8: (96, 224), 16: (32, 480), 32: (0, 992)},
}


@pytest.mark.parametrize("workers", sorted(TABLE_VII))
def test_one_level_counts_equal_table_vii(workers):
    for size, (a2a, ag) in TABLE_VII[workers].items():
        pairs = moecompile.hybrid_topology(sizes=[workers], domain_sizes=[size])
        kinds = [kind for *_, kind in pairs]
        ours = (kinds.count("A2A"), kinds.count("AG"))
        print(f"EP {workers}, S_ED {size}: paper A2A {a2a} AG {ag}, ours A2A {ours[0]} AG {ours[1]}")
        assert ours == (a2a, ag)


def test_two_levels_fig_8b():
    """4 datacenters x 4 GPUs, datacenters in domains of 2, each datacenter's GPUs one domain: GPUs of one
    datacenter all-gather; at the datacenter level, GPUs of equal index in datacenters of one domain all-gather
    and those at the same offset of different domains all-to-all; ranks of different datacenters and GPU indices never talk."""
    pairs = moecompile.hybrid_topology(sizes=[4, 4], domain_sizes=[2, 4])
    found = {(m, n): (level, kind) for m, n, level, kind in pairs}
    assert len(found) == len(pairs)  # one level per pair at most
    for m, n in itertools.permutations(range(16), 2):
        (dc_m, gpu_m), (dc_n, gpu_n) = hybrid.locations(m, [4, 4]), hybrid.locations(n, [4, 4])
        assert (dc_m, gpu_m) == divmod(m, 4) and (dc_n, gpu_n) == divmod(n, 4)
        if dc_m == dc_n:
            want = (1, "AG")
        elif gpu_m == gpu_n and dc_m // 2 == dc_n // 2:
            want = (0, "AG")
        elif gpu_m == gpu_n and dc_m % 2 == dc_n % 2:  # other domain, the same offset in it
            want = (0, "A2A")
        else:
            want = None
        assert found.get((m, n)) == want, (m, n)
    gather, exchange = hybrid.groups(5, [4, 4], [2, 4])  # datacenter 1, GPU 1
    assert gather == list(range(8))  # datacenters 0 and 1 (its domain), every GPU
    assert exchange == [5, 13]  # GPU 1 of datacenters 1 and 3 (offset 1 in domains 0 and 1)


def test_domain_size_one_is_expert_parallelism_and_one_domain_gathers_all():
    assert all(kind == "A2A" for *_, kind in hybrid.hybrid_topology([2, 4], [1, 1]))
    assert all(kind == "AG" for *_, kind in hybrid.hybrid_topology([2, 4], [2, 4]))
    assert hybrid.groups(3, [8], [1]) == ([3], list(range(8)))
    assert hybrid.groups(3, [8], [8]) == (list(range(8)), [3])


def test_bad_input_names_the_fix():
    with pytest.raises(ValueError, match="one domain size per level"):
        moecompile.hybrid_topology([4, 4], [2])
    with pytest.raises(ValueError, match=r"domain size 3: .* one of \[1, 2, 4\]"):
        moecompile.hybrid_topology([4], [3])
    with pytest.raises(ValueError, match="whole number >= 1"):
        moecompile.hybrid_topology([0], [1])


def _gather_ranks(rank, world, tmp):
    """moe::domain_gather over domains of 2 ranks of world 4: the domain's experts in rank order, and each owner's
    gradient the sum of every copy's (the reduce-scatter gloo does as an all-reduce), counted bytes included."""
    import torch.distributed as dist

    import moecompile.runtime.comm.ops  # noqa: F401  (registers the ops)
    from moecompile.runtime.comm.stats import COMM

    dist.init_process_group("gloo", init_method=f"file://{tmp}/rdv", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    try:
        domains = [[0, 1], [2, 3]]
        mine, _ = dist.new_subgroups_by_enumeration(domains, timeout=timedelta(seconds=60))
        weights = [torch.arange(6.0).reshape(2, 3) + 10 * r for r in range(world)]  # rank r's 2 experts
        coef = [torch.randn(4, 3, generator=torch.Generator().manual_seed(r)) for r in range(world)]
        w = weights[rank].clone().requires_grad_(True)
        COMM.reset()
        got = torch.ops.moe.domain_gather(w, mine.group_name, "layer")
        domain = domains[rank // 2]
        torch.testing.assert_close(got, torch.cat([weights[q] for q in domain]))
        (got * coef[rank]).sum().backward()
        mine_rows = slice(2 * domain.index(rank), 2 * domain.index(rank) + 2)
        torch.testing.assert_close(w.grad, sum(coef[q][mine_rows] for q in domain))
        sent = COMM.snapshot()["layer"]
        assert sent["calls.domain_gather"] == 1 and sent["calls.domain_reduce"] == 1, sent
    finally:
        dist.destroy_process_group()


def test_domain_gather_and_its_gradient(tmp_path):
    mp.spawn(_gather_ranks, args=(4, str(tmp_path)), nprocs=4, join=True)
