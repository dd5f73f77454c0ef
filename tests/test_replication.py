"""The placement scheduler, row routing and gradient sources of adaptive expert replication (pure functions,
``runtime/placement/replication.py``), against hand-worked cases and a row-by-row reference; which ``nn.ModuleList``
layers replicate (``moecompile/distributed/replicate_list.py``)."""

import pytest
import torch

from moecompile.runtime.placement.replication import (consecutive_groups, gradient_source, hosting_ranks, instances,
                                            route_to_instances, schedule, uniform)


def test_instances_follow_popularity():
    assert instances(torch.tensor([8, 4, 2, 2]), 8).tolist() == [4, 2, 1, 1]
    assert instances(torch.zeros(4), 8).tolist() == [2, 2, 2, 2]  # nothing routed yet: equal shares
    assert instances(torch.tensor([100, 0, 0, 0]), 8).tolist() == [5, 1, 1, 1]  # at least one each
    # shares 3.5, 2.5, 1.0, 1.0 -> floors 3, 2, 1, 1 (7): the most under-provisioned (lowest id on ties) gets one
    assert instances(torch.tensor([7, 5, 2, 2]), 8).tolist() == [4, 2, 1, 1]
    # shares 7.6, 0.2, 0.2 -> at least one each: 7, 1, 1 (9 > 8): the expert with several gives one back
    assert instances(torch.tensor([38, 1, 1]), 8).tolist() == [6, 1, 1]
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        E = int(torch.randint(1, 12, (1,), generator=gen))
        slots = E + int(torch.randint(0, 20, (1,), generator=gen))
        pop = torch.randint(0, 50, (E,), generator=gen) * (torch.rand(E, generator=gen) < 0.7)
        count = instances(pop, slots)
        assert int(count.sum()) == slots and int(count.min()) >= 1, (pop, slots, count)
        share = pop.double() / max(1, int(pop.sum())) * slots
        if bool((share >= 1).all()):  # no floor of one instance binds: each expert within one of its share
            assert bool(((count - share).abs() < 1 + 1e-9).all()), (pop, slots, count)
    with pytest.raises(ValueError, match="cannot hold one instance"):
        instances(torch.ones(5), 4)


def test_schedule_is_contiguous():
    placement = schedule(torch.tensor([8, 4, 2, 2]), world=2, slots_per_rank=4)
    assert placement.tolist() == [0, 0, 0, 0, 1, 1, 2, 3]
    assert hosting_ranks(placement, 0, 4) == [0] and hosting_ranks(placement, 1, 4) == [1]
    gen = torch.Generator().manual_seed(1)
    for _ in range(100):
        E, W = int(torch.randint(2, 10, (1,), generator=gen)), int(torch.randint(1, 5, (1,), generator=gen))
        S = -(-E // W) + int(torch.randint(0, 3, (1,), generator=gen))
        placement = schedule(torch.randint(0, 30, (E,), generator=gen), W, S)
        assert placement.numel() == W * S and bool((placement[1:] >= placement[:-1]).all())
        for e in range(E):  # every expert placed, on consecutive ranks
            hosts = hosting_ranks(placement, e, S)
            assert hosts and hosts == list(range(hosts[0], hosts[-1] + 1)), (placement, e)
    assert uniform(4, 2, 4).tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    with pytest.raises(ValueError, match=r"use slots_per_rank >= 3"):
        schedule(torch.ones(6), world=2, slots_per_rank=2)
    with pytest.raises(ValueError, match="slots_per_rank must be a whole number"):
        schedule(torch.ones(2), world=2, slots_per_rank=0)


def _rows_reference(counts_WE, placement, capacity):
    """Row by row: expert e's rows in global order (rank 0's first), the k-th of n to the last instance j with
    j * n // r <= k, or with a capacity that n exceeds, k // capacity (dropped past r x capacity)."""
    W, E = counts_WE.shape
    out = torch.zeros(W, placement.numel(), dtype=torch.int64)
    for e in range(E):
        slots = [int(s) for s in torch.nonzero(placement == e).flatten()]
        owners = [w for w in range(W) for _ in range(int(counts_WE[w, e]))]
        n, r = len(owners), len(slots)
        for k, w in enumerate(owners):
            if capacity is not None and n > r * capacity:
                if k < r * capacity:
                    out[w, slots[k // capacity]] += 1
            else:
                out[w, slots[max(j for j in range(r) if j * n // r <= k)]] += 1
    return out


def test_rows_go_to_instances_balanced():
    counts = torch.tensor([[5, 1, 0, 2], [3, 1, 1, 0]])  # 2 ranks, 4 experts
    placement = torch.tensor([0, 0, 0, 1, 2, 3])  # expert 0: 3 instances (slots 0-2)
    rows = route_to_instances(counts, placement)
    assert rows[:, :3].tolist() == [[2, 3, 0], [0, 0, 3]]  # 8 rows of expert 0: runs of 2, 3, 3 (rank 0's first)
    assert rows[:, 3:].tolist() == [[1, 0, 2], [1, 1, 0]]
    capped = route_to_instances(counts, placement, capacity=2)
    assert capped[:, :3].tolist() == [[2, 2, 1], [0, 0, 1]]  # 6 of expert 0's 8 rows kept: 2 dropped (rank 1's)
    gen = torch.Generator().manual_seed(2)
    for _ in range(100):
        W, E = int(torch.randint(1, 5, (1,), generator=gen)), int(torch.randint(1, 8, (1,), generator=gen))
        S = -(-E // W) + int(torch.randint(0, 3, (1,), generator=gen))
        counts = torch.randint(0, 9, (W, E), generator=gen)
        placement = schedule(counts.sum(0), W, S)
        capacity = None if torch.rand(1, generator=gen) < 0.5 else int(torch.randint(1, 6, (1,), generator=gen))
        rows = route_to_instances(counts, placement, capacity)
        assert torch.equal(rows, _rows_reference(counts, placement, capacity)), (counts, placement, capacity)
        per_slot = rows.sum(0)
        for e in range(E):
            load = per_slot[placement == e]
            assert int(load.max() - load.min()) <= 1 or capacity is not None
            if capacity is None:
                assert int(rows[:, placement == e].sum()) == int(counts[:, e].sum())
            else:
                assert int(load.max()) <= capacity


def test_adaptive_placement_lowers_the_busiest_slot():
    """Skewed routing: the most rows any slot receives under the scheduled placement is at most the uniform
    placement's, and with a capacity fewer rows are dropped (the point of the paper)."""
    gen = torch.Generator().manual_seed(3)
    W, S, E = 4, 4, 8
    weights = torch.tensor([8.0, 4, 2, 1, 1, 0.5, 0.5, 0.25])
    ids = torch.multinomial(weights, W * 256, replacement=True, generator=gen).view(W, 256)
    counts = torch.stack([torch.bincount(ids[w], minlength=E) for w in range(W)])
    static, adaptive = uniform(E, W, S), schedule(counts.sum(0), W, S)
    busiest = lambda placement, cap=None: int(route_to_instances(counts, placement, cap).sum(0).max())  # noqa: E731
    kept = lambda placement, cap: int(route_to_instances(counts, placement, cap).sum())  # noqa: E731
    assert busiest(adaptive) < busiest(static) / 2, (busiest(adaptive), busiest(static))
    capacity = W * 256 // (W * S)  # capacity factor 1
    assert W * 256 - kept(adaptive, capacity) < (W * 256 - kept(static, capacity)) / 2


def test_gradient_sources():
    placement = torch.tensor([0, 0, 0, 0, 0, 1, 2, 3])  # S = 2, W = 4: expert 0 on ranks 0-2
    assert [gradient_source(placement, 0, r, 4, 2) for r in range(4)] == [0, 1, 2, 0]
    assert [gradient_source(placement, 3, r, 4, 2) for r in range(4)] == [3, 3, 3, 3]
    gen = torch.Generator().manual_seed(4)
    for _ in range(50):
        W, E = int(torch.randint(2, 6, (1,), generator=gen)), int(torch.randint(2, 9, (1,), generator=gen))
        S = -(-E // W) + int(torch.randint(0, 3, (1,), generator=gen))
        placement = schedule(torch.randint(0, 20, (E,), generator=gen), W, S)
        for e in range(E):
            hosts = hosting_ranks(placement, e, S)
            sources = [gradient_source(placement, e, r, W, S) for r in range(W)]
            assert all(sources[h] == h for h in hosts) and set(sources) <= set(hosts)
            others = torch.tensor([s for r, s in enumerate(sources) if r not in hosts], dtype=torch.long)
            served = torch.bincount(others, minlength=W)
            assert int(served.max()) <= -(-(W - len(hosts)) // len(hosts)), (placement, e, sources)
    assert consecutive_groups(4) == [(0, 1), (0, 2), (0, 3), (1, 2), (1, 3), (2, 3)]


def test_which_module_list_layers_replicate():
    """A ModuleList (or ModuleDict) layer replicates where each role's weights are ``<list>.<expert>.<weight>`` in one
    list, alike in shape, dtype and requires_grad; otherwise it is sharded without replication, saying why."""
    from test_parallelize import _build

    from moecompile.distributed.replicate import replicable
    from moecompile.distributed.replicate_list import container

    assert container(["b.experts.0.w1.weight", "b.experts.1.w1.weight"]) == ("b.experts", ["0.w1.weight",
                                                                                           "1.w1.weight"])
    assert container(["m.experts.expert_0.wi.weight", "m.experts.expert_1.wi.weight"])[0] == "m.experts"
    for names in (["b.experts.0.w1.weight", "b.experts.0.w1.weight"],
                  ["b.experts.0.w1.weight", "c.experts.1.w1.weight"],
                  ["b.experts.0.w1.weight", "b.experts.1.w2.weight"], ["b.experts.0.w1.weight"]):
        assert container(names) is None, names
    model = _build("loop")
    params = {role: [f"blocks.0.experts.{i}.{w}.weight" for i in range(8)] for role, w in
              (("gate", "w1"), ("up", "w3"), ("down", "w2"))}
    assert replicable(model, params) == ""
    model.blocks[0].experts[5].w1.weight.requires_grad_(False)  # one expert frozen, the others not
    assert "differ in shape, dtype or requires_grad" in replicable(model, params)
    params["gate"] = [n.replace("blocks.0", f"blocks.{i % 2}") for i, n in enumerate(params["gate"])]
    assert "not named <list>.<expert>.<weight> alike" in replicable(model, params)
