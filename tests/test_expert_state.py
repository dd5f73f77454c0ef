"""The experts' host optimizer of adaptive replication (runtime/placement/expert_state.py) on gloo, world 2 and 4: slot
gradients under one placement are summed over each expert's instances (inside a rank, then over its consecutive
hosting ranks), each rank collects its part of every expert, steps it with torch's own AdamW and SGD, and sends
the updated weights to the slots of another placement: every part, step and slot equals one process doing the
same on whole tensors (fp32 weights, and bf16 weights with fp32 masters), and the bytes each phase moves are
counted exactly: as the paper's Appendix A counts them (every link, local or network), one step under skewed
placements moves as many as under static placement."""

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from ranks import spawn

from moecompile.runtime.placement import expert_state
from moecompile.runtime.placement.expert_state import ExpertPartition, Groups, collect, distribute, reduce_instances
from moecompile.runtime.placement.replication import hosting_ranks, schedule, uniform

E, I, H = 8, 3, 5
P = 2 * I * H + 7  # elements of one expert: two weights and a bias (7 does not divide over the ranks)


def _full():
    gen = torch.Generator().manual_seed(3)
    return [torch.randn(E, I, H, generator=gen), torch.randn(E, H, I, generator=gen), torch.randn(E, 7, generator=gen)]


def _grads(rank, S):
    return torch.randn(S, P, generator=torch.Generator().manual_seed(40 + rank))


def _worker(rank, world, tmp):
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    try:
        group = dist.group.WORLD
        groups = Groups(group, timedelta(seconds=60))
        S = E // world + 2
        now = schedule(torch.tensor([9, 1, 1, 5, 1, 1, 1, 30]), world, S)  # experts 0, 3, 7 several instances
        after = schedule(torch.tensor([1, 20, 1, 1, 1, 1, 12, 1]), world, S)
        flat = ExpertPartition(_full(), rank, world).flatten(_full())  # each expert's elements, in rank order
        summed = torch.zeros(E, P)  # one process: each expert's gradient, every instance on every rank added
        for r in range(world):
            summed.index_add_(0, now[r * S:(r + 1) * S], _grads(r, S))
        for make in (lambda p: torch.optim.AdamW(p, lr=0.1, weight_decay=0.01), lambda p: torch.optim.SGD(p, lr=0.1)):
            expert_state.BYTES.clear()
            part = ExpertPartition(_full(), rank, world)
            lo, hi = part.bounds[rank], part.bounds[rank + 1]
            assert torch.equal(part.master, flat[:, lo:hi])
            _check_layout(part)
            reduced = reduce_instances(_grads(rank, S), now, groups)
            assert set(reduced) == {e for e in range(E) if rank in hosting_ranks(now, e, S)}
            for e, g in reduced.items():
                torch.testing.assert_close(g, summed[e], rtol=1e-6, atol=1e-6)
            part.master.grad = collect(reduced, now, part, group)
            torch.testing.assert_close(part.master.grad, summed[:, lo:hi], rtol=1e-6, atol=1e-6)
            whole = torch.nn.Parameter(flat.clone())
            whole.grad = summed.clone()
            for opt in (make([part.master]), make([whole])):
                opt.step()
            torch.testing.assert_close(part.master, whole.detach()[:, lo:hi], rtol=1e-6, atol=1e-6)
            slots = distribute(part, after, group, "cpu")
            want = whole.detach()[after[rank * S:(rank + 1) * S]]
            torch.testing.assert_close(slots, want, rtol=1e-6, atol=1e-6)
            for got, shape, w in zip(part.unflatten(slots), [(I, H), (H, I), (7,)], _full()):
                assert got.shape == (S, *shape) and got.dtype == w.dtype
            _check_bytes(world, S, now, after, part.bounds)
        _bf16_slots(rank, world, S, now, after, groups)
        static = uniform(E, world, S)
        assert _volume(now, after, rank, world, S, groups) == _volume(static, static, rank, world, S, groups)
    finally:
        dist.destroy_process_group()


def _check_layout(part):
    """Each weight is cut along its dim 1 (rows of each expert), torch.chunk's parts: the rank's piece of each
    weight is those rows (as a DTensor Shard(1) of the weight would hold them); flatten and unflatten invert each
    other; the part of whole weights is the master part."""
    rows = {r: -(-n // part.world) for r, n in ((0, I), (1, H), (2, 7))}
    for k, (piece, w) in enumerate(zip(part.pieces(part.master), _full())):
        lo = min(part.rank * rows[k], w.shape[1])
        assert torch.equal(piece, w[:, lo:min(lo + rows[k], w.shape[1])]), k
    assert all(torch.equal(a, b) for a, b in zip(part.unflatten(part.flatten(_full())), _full()))
    assert torch.equal(part.part_of(_full()), part.master)


def _bf16_slots(rank, world, S, now, after, groups):
    """bf16 expert weights and gradients (the model's dtype), fp32 master weights: the host holds the bf16 weights
    exactly, sums the bf16 gradients in fp32 and steps in fp32; the slots get the updated weights in bf16."""
    full = [w.to(torch.bfloat16) for w in _full()]
    part = ExpertPartition(full, rank, world)
    lo, hi = part.bounds[rank], part.bounds[rank + 1]
    flat = part.flatten([w.to(torch.float32) for w in full])
    assert part.master.dtype == torch.float32 and torch.equal(part.master, flat[:, lo:hi])
    summed = torch.zeros(E, P)
    for r in range(world):
        summed.index_add_(0, now[r * S:(r + 1) * S], _grads(r, S).to(torch.bfloat16).to(torch.float32))
    reduced = reduce_instances(_grads(rank, S).to(torch.bfloat16), now, groups)
    part.master.grad = collect(reduced, now, part, groups.group)
    whole = torch.nn.Parameter(flat.clone())
    whole.grad = summed
    for opt in (torch.optim.SGD([part.master], lr=0.1), torch.optim.SGD([whole], lr=0.1)):
        opt.step()
    torch.testing.assert_close(part.master, whole.detach()[:, lo:hi], rtol=1e-6, atol=1e-6)
    slots = distribute(part, after, groups.group, "cpu")
    torch.testing.assert_close(slots, whole.detach()[after[rank * S:(rank + 1) * S]], rtol=1e-6, atol=1e-6)
    got = part.unflatten(slots)
    for g, w in zip(got, full):
        assert g.dtype == torch.bfloat16 and g.shape == (S, *w.shape[1:]), (g.dtype, g.shape)
    assert torch.equal(part.flatten(got), slots.to(torch.bfloat16))  # the fp32 weights rounded


def _volume(now, after, rank, world, S, groups):
    """Bytes one step moves in each phase as the paper's Appendix A counts them (every rank, local and network):
    gradients into the optimizer (each expert's once: E x P elements) and weights into the slots (each slot its
    expert's: slots x P), whatever the placement."""
    expert_state.BYTES.clear()
    part = ExpertPartition(_full(), rank, world)
    part.master.grad = collect(reduce_instances(_grads(rank, S), now, groups), now, part, groups.group)
    distribute(part, after, groups.group, "cpu")
    moved = torch.tensor([sum(v for k, v in expert_state.BYTES.items() if k.startswith(phase))
                          for phase in ("collect", "distribute")], dtype=torch.float64)
    dist.all_reduce(moved)
    assert moved.tolist() == [E * P * 4, world * S * P * 4], moved
    return moved.tolist()


def _check_bytes(world, S, now, after, bounds):
    """Summed over the ranks: the collection moves each expert's gradient once (the parts other ranks keep over
    the network); the distribution each expert's weights once to each rank hosting it; the all-reduce of an
    expert hosted on several ranks takes its gradient from each (what the collective then sends depends on its
    algorithm: counted as its input)."""
    moved = torch.tensor([expert_state.BYTES[k] for k in ("collect", "collect.local", "distribute",
                                                          "distribute.local", "reduce")], dtype=torch.float64)
    dist.all_reduce(moved)
    part = [bounds[r + 1] - bounds[r] for r in range(world)]
    hosts_now = [hosting_ranks(now, e, S) for e in range(E)]
    hosts_after = [hosting_ranks(after, e, S) for e in range(E)]
    local = sum(part[d] for h in hosts_now for d in h) * 4
    assert moved[0] + moved[1] == E * P * 4 and moved[1] == local, moved
    pairs = sum(len(h) for h in hosts_after)
    assert moved[2] + moved[3] == pairs * P * 4, moved  # once to each hosting rank, then copied to its slots
    copies = torch.tensor(float(expert_state.BYTES["distribute.copy"]), dtype=torch.float64)
    dist.all_reduce(copies)
    assert moved[2] + moved[3] + copies == world * S * P * 4, (moved, copies)
    assert moved[3] == sum(part[d] for h in hosts_after for d in h) * 4, moved
    assert moved[4] == sum(len(h) for h in hosts_now if len(h) > 1) * P * 4, moved  # each host's all-reduce input


@pytest.mark.parametrize("world", [2, 4])
def test_host_optimizer_equals_one_process(world, tmp_path):
    spawn(_worker, args=(world, str(tmp_path)), nprocs=world)
