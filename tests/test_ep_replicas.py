"""Routed rows to expert instances (runtime/placement/replicas.py) on gloo, world 2 and 4: a layer whose experts have
several instances (the placement of skewed routing, S slots per rank) gives each rank the output one process
computes for its tokens, forward and backward (float64), dropless and with a capacity per instance (the rows
past what an expert's instances hold, in global order, give nothing); the popularity and the dropped rows are
counted. Each rank's slot weights are gathered from the experts' weights, so autograd sums the instances'
gradients: all-reduced over the ranks they equal one process's."""

import math
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from ranks import spawn

import moecompile.runtime.comm.ops  # noqa: F401  (registers moe::ep_dispatch, moe::ep_combine)
from moecompile.runtime.placement.replicas import DROPPED, POPULARITY, forget
from moecompile.runtime.reference import expert_mlp_ref
from moecompile.runtime.placement.replication import route_to_instances, schedule

E, K, H, I, T = 8, 2, 4, 6, 12
POP = torch.tensor([8.0, 4, 2, 1, 1, 0.5, 0.5, 0.25])  # expert 0 hot


def _routing(rank):
    gen = torch.Generator().manual_seed(50 + rank)
    x = torch.randn(T, H, generator=gen, dtype=torch.float64)
    ids = torch.stack([torch.multinomial(POP, K, generator=gen) for _ in range(T)])
    w = torch.rand(T, K, generator=gen, dtype=torch.float64)
    return x, ids, w


def _weights():
    gen = torch.Generator().manual_seed(9)
    return [torch.randn(E, I, H, generator=gen, dtype=torch.float64) * 0.3 for _ in range(2)] + \
        [torch.randn(E, H, I, generator=gen, dtype=torch.float64) * 0.3]


def _sorted_rows(ids, w):
    flat = ids.flatten()
    order = torch.argsort(flat, stable=True)
    return order // K, torch.bincount(flat, minlength=E), w.flatten()[order]


def _one_process(xs, weights, capacity, placement):
    """Every rank's outputs from all tokens at once, row by row: expert e's rows in global order (rank 0's first,
    each rank's sorted by expert), those past r_e x capacity dropped."""
    gate, up, down = weights
    outs, seen = [], torch.zeros(E, dtype=torch.int64)
    r = torch.bincount(placement, minlength=E)
    for rank, x in enumerate(xs):
        _, ids, w = _routing(rank)
        tok, counts, cw = _sorted_rows(ids, w)
        expert = torch.repeat_interleave(torch.arange(E), counts)
        out = torch.zeros(T, H, dtype=torch.float64)
        for b in range(tok.numel()):
            e = int(expert[b])
            seen[e] += 1
            if capacity >= 0 and int(seen[e]) > int(r[e]) * capacity:
                continue
            y = expert_mlp_ref(x[tok[b:b + 1]], torch.zeros(1, dtype=torch.long), torch.tensor([1]), gate[e:e + 1],
                               up[e:e + 1], down[e:e + 1])
            out[tok[b]] += cw[b] * y[0]
        outs.append(out)
    return outs


def _worker(rank, world, tmp):
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    try:
        group = dist.group.WORLD.group_name
        S = E // world + 1  # slots per rank: room for more than one instance of the hot experts
        counts_all = sum(torch.bincount(_routing(r)[1].flatten(), minlength=E) for r in range(world))
        placement = schedule(counts_all, world, S)
        assert int(torch.bincount(placement, minlength=E)[0]) > world * S // E  # the hot expert got more
        for factor in (0.0, 0.75):  # dropless; below capacity factor 1
            forget(["l"])  # (the counts add up over forwards until an optimizer step uses them)
            capacity = math.ceil(factor * T * K * world / (world * S)) if factor else -1
            weights = [t.clone().requires_grad_(True) for t in _weights()]
            ref_weights = [t.clone().requires_grad_(True) for t in _weights()]
            x, ids, w = _routing(rank)
            x = x.requires_grad_(True)
            tok, counts, cw = _sorted_rows(ids, w)
            tok_K, counts_N, order_K = torch.ops.moe.ep_to_instances(tok, counts, placement, factor, group, "l")
            local = [t[placement[rank * S:(rank + 1) * S]] for t in weights]  # this rank's slots
            d = torch.ops.moe.ep_dispatch(x, tok_K, counts_N, group, "l")
            every = torch.stack([torch.bincount(_routing(r)[1].flatten(), minlength=E) for r in range(world)])
            rows = route_to_instances(every, placement, None if capacity < 0 else capacity)
            assert torch.equal(d[2], rows.sum(0)[rank * S:(rank + 1) * S]), (d[2], rows)  # each slot its share
            y = expert_mlp_ref(d[0], d[1], d[2], *local)
            y_K = torch.ops.moe.ep_combine(y, d[1], counts_N, d[3], tok_K.numel(), group, "l")
            y_B = y_K.new_zeros(tok.numel(), H).index_copy(0, order_K, y_K)
            out = torch.zeros(T, H, dtype=torch.float64).index_add(0, tok, y_B * cw[:, None])
            xs = [_routing(r)[0].requires_grad_(True) for r in range(world)]
            want = _one_process(xs, ref_weights, capacity, placement)
            torch.testing.assert_close(out, want[rank], rtol=1e-12, atol=1e-12)
            assert torch.equal(POPULARITY["l"], counts_all)
            dropped = 0 if capacity < 0 else int((counts_all - torch.bincount(placement, minlength=E) * capacity)
                                                  .clamp(min=0).sum())
            assert DROPPED["l"] == dropped and (capacity < 0 or dropped > 0), (DROPPED, dropped)
            gen = torch.Generator().manual_seed(7)
            grads = [torch.randn(T, H, generator=gen, dtype=torch.float64) for _ in range(world)]
            (out * grads[rank]).sum().backward()
            sum((o * g).sum() for o, g in zip(want, grads)).backward()
            for t, ref in zip(weights, ref_weights):
                dist.all_reduce(t.grad)
                torch.testing.assert_close(t.grad, ref.grad, rtol=1e-10, atol=1e-12)
            ref_grad = xs[rank].grad if xs[rank].grad is not None else torch.zeros_like(x)  # all its rows dropped
            torch.testing.assert_close(x.grad, ref_grad, rtol=1e-10, atol=1e-12)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 4])
def test_rows_reach_instances_and_train_as_one_process(world, tmp_path):
    spawn(_worker, args=(world, str(tmp_path)), nprocs=world)
