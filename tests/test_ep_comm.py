"""The padding-free row exchange (runtime/comm/exchange.py) on gloo, world 2 and 4: each rank's rows reach the ranks
they name with exact uneven splits (a rank with no rows, a rank that receives none), come back in their order,
and gradients flow back through both exchanges; every rank checks against what one process computes from all
ranks' inputs. A failing rank fails the test (the others are stopped; the group has a timeout)."""

import socket
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from ranks import spawn

from moecompile.runtime.comm.exchange import combine_rows, dispatch_rows

H = 3


def _inputs(rank, world):
    """Rank ``rank``'s rows and destinations, the same on every process: rank 1 has none, nothing goes to the
    last rank."""
    gen = torch.Generator().manual_seed(100 + rank)
    R = 0 if rank == 1 else 5 + 2 * rank
    rows = torch.randn(R, H, generator=gen, dtype=torch.float64)
    dest = torch.randint(0, world - 1, (R,), generator=gen)
    return rows, dest


def _worker(rank, world, port):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    try:
        rows, dest = _inputs(rank, world)
        x = rows.clone().requires_grad_(True)
        got, plan = dispatch_rows(x, dest)
        want = torch.cat([r[d == rank] for r, d in (_inputs(s, world) for s in range(world))])
        assert torch.equal(got, want), (rank, got, want)
        assert plan.recv_counts == [int((d == rank).sum()) for _, d in (_inputs(s, world) for s in range(world))]
        out = combine_rows(got.sin() * (rank + 1), plan)  # each rank "computes" its rows, then sends them back
        scale = (dest + 1).to(rows.dtype)[:, None]
        torch.testing.assert_close(out, rows.sin() * scale, rtol=0, atol=0)
        weights = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)
        (out * weights).sum().backward()
        torch.testing.assert_close(x.grad, weights * rows.cos() * scale, rtol=1e-12, atol=1e-12)
        with pytest.raises(ValueError, match=r"outside \[0, "):  # refused before any collective, on every rank
            dispatch_rows(torch.zeros(1, H), torch.tensor([world]))
    finally:
        dist.destroy_process_group()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("world", [2, 4])
def test_rows_reach_their_ranks_and_come_back_with_gradients(world):
    spawn(_worker, args=(world, _free_port()), nprocs=world)


def test_counts_added_as_tensors_are_summed_where_they_live_and_read_at_a_snapshot():
    """dedup's pair counts are device tensors: COMM sums them without reading them back (on CUDA a wait for the
    GPU at every layer), and a snapshot gives ints."""
    import torch

    from moecompile.runtime.comm.stats import CommCounter

    counter = CommCounter()
    counter.add("layer", "dedup.remote_pairs", torch.tensor(3))
    counter.add("layer", "dedup.remote_pairs", torch.tensor(4))
    counter.add("layer", "calls.dispatch", 1)
    assert counter.snapshot()["layer"] == {"dedup.remote_pairs": 7, "calls.dispatch": 1}
    unread = CommCounter()  # a meta tensor raises when read: adding it twice reads nothing
    for _ in range(2):
        unread.add("layer", "dedup.remote_pairs", torch.empty((), dtype=torch.int64, device="meta"))
    assert all(type(v) is int for v in counter.snapshot()["layer"].values())
