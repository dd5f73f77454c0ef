"""Dedup at each level of a 3-level mesh (HierMoE's d levels), world 8 on gloo: a ("rack", "node", "local") mesh
of shape (2, 2, 2), one process group for every check.

- The hierarchical exchange at "rack" and at "node", and the flat one ("off"), each give every rank the one-process
  result of its tokens through per-expert functions, forward and backward (input and routing-weight gradients).
- Bytes: with dedup at a level, the rows that leave a group of that level are exactly the distinct (token, other
  group) pairs x H x 4 (at "rack": the rack link only; at "node": rack and node links), each way.
- Calibration under the link emulation recovers the betas of all five collective kinds; the cost model's time of
  each choice matches what the emulated links take; the choice of least predicted time is the level expected.
- A rank that dies makes the others raise within the process group's timeout: the level groups are made with it.
"""

import os
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from ranks import spawn
from torch.distributed.device_mesh import init_device_mesh

from moecompile.distributed.calibrate import calibrate, time_dispatch
from moecompile.distributed.mesh import setup_mesh
import moecompile.runtime.comm.ops  # noqa: F401  (registers the ops)
from moecompile.runtime.comm.cost_model import LinkModel, choose_dedup, dispatch_times
from moecompile.runtime.comm.plan import Placement
from moecompile.runtime.comm.exchange import emulate_links
from moecompile.runtime.comm.dedup import hierarchical_experts
from moecompile.runtime.comm.stats import COMM

NAMES, SHAPE, WORLD = ("rack", "node", "local"), (2, 2, 2), 8
E, K, T, H = 16, 4, 12, 8  # experts (2 per rank), per token, tokens per rank, hidden
TIMEOUT = 20  # seconds: the group's timeout, within which the survivors of a dead rank must raise


def _routing():
    gen = torch.Generator().manual_seed(0)
    ids = torch.rand(WORLD * T, E, generator=gen).argsort(-1)[:, :K]
    return ids, torch.rand(WORLD * T, K, generator=gen), torch.randn(WORLD * T, H, generator=gen)


def _exchange(x, w_TK, ids_TK, group, dedup, rank):
    """sum_k w[t, k] * f_e(x[t]) over the mesh, f_e(x) = x * (e + 1): the expert's identity shows in the result."""
    order = torch.argsort(ids_TK.reshape(-1), stable=True)
    tok_B, counts_E, w_B = order // K, torch.bincount(ids_TK.reshape(-1), minlength=E), w_TK.reshape(-1)[order]
    local = E // WORLD

    def run_experts(x_RH, perm_R, counts_L):  # this rank's experts on their rows, in expert order
        scale = torch.repeat_interleave(torch.arange(rank * local, (rank + 1) * local) + 1.0, counts_L)
        return x_RH[perm_R] * scale[:, None]

    if dedup != "off":
        return hierarchical_experts(x, tok_B, counts_E, w_B, run_experts, group.group_name, "levels", dedup)
    ops = torch.ops.moe
    d = ops.ep_dispatch(x, tok_B, counts_E, group.group_name, "levels")
    y = ops.ep_combine(run_experts(d[0], d[1], d[2]), d[1], counts_E, d[3], tok_B.numel(), group.group_name, "levels")
    return torch.zeros_like(x).index_add(0, tok_B, y * w_B[:, None])


def _remote_pairs(ids_TK, rank, per_group_experts, ranks_per_group):
    """Distinct (token, group) pairs whose group is not this rank's, for groups of ``per_group_experts`` experts."""
    groups = ids_TK // per_group_experts
    return sum(len(set(row.tolist()) - {rank // ranks_per_group}) for row in groups)


def _exchanges_equal_one_process(group, rank):
    ids, w, x = _routing()
    mine = slice(rank * T, (rank + 1) * T)
    grad_out = torch.randn(WORLD * T, H, generator=torch.Generator().manual_seed(1))
    x_ref, w_ref = x.clone().requires_grad_(), w.clone().requires_grad_()
    ref = x_ref * (w_ref * (ids + 1.0)).sum(-1, keepdim=True)
    (ref * grad_out).sum().backward()
    row = H * 4
    for dedup in ("off", "rack", "node"):
        COMM.reset()
        x_mine, w_mine = x[mine].clone().requires_grad_(), w[mine].clone().requires_grad_()
        out = _exchange(x_mine, w_mine, ids[mine], group, dedup, rank)
        torch.testing.assert_close(out, ref[mine].detach(), msg=lambda m: f"{dedup} forward: {m}")
        (out * grad_out[mine]).sum().backward()
        torch.testing.assert_close(x_mine.grad, x_ref.grad[mine], msg=lambda m: f"{dedup} input grad: {m}")
        torch.testing.assert_close(w_mine.grad, w_ref.grad[mine], msg=lambda m: f"{dedup} weight grad: {m}")
        s = COMM.snapshot()["levels"]
        if dedup == "off":  # every assignment once; those to another rack over the rack link
            assert sum(s.get(f"dispatch.{link}", 0) for link in COMM.links()) == T * K * row, s
            assert s.get("dispatch.rack", 0) == int((ids[mine] // (E // 2) != rank // 4).sum()) * row, s
            continue
        per_group, ranks = (E // 2, 4) if dedup == "rack" else (E // 4, 2)
        crossed = s.get("dispatch.rack", 0) + (s.get("dispatch.node", 0) if dedup == "node" else 0)
        assert crossed == _remote_pairs(ids[mine], rank, per_group, ranks) * row, (dedup, s)
        assert s["dedup.remote_pairs"] * row == crossed and s["dedup.remote_pairs"] < s["dedup.remote_assignments"]
        back = torch.tensor([crossed, s.get("combine.rack", 0) + (s.get("combine.node", 0) if dedup == "node" else 0)])
        dist.all_reduce(back)
        assert back[0] == back[1], (dedup, back)  # the sums come back once per pair


def _links_and_choice(mesh, rank):
    emulated = LinkModel({"flat": (3e-3, 2e-7), "rack": (3e-3, 4e-7), "node+local": (2e-3, 1e-7),
                          "rack+node": (3e-3, 3e-7), "local": (1e-3, 1e-8)})
    with emulate_links(emulated):
        fitted = calibrate(mesh, sizes=(1 << 12, 1 << 15, 1 << 17), repeats=2, progress=False)
        assert set(fitted.params) == set(emulated.params), fitted
        for kind, (_, beta) in emulated.params.items():
            if beta >= 1e-7:  # the loopback's own time per byte is ~1e-9 s: a smaller beta is not resolved
                assert fitted.params[kind][1] == pytest.approx(beta, rel=0.3), (kind, fitted)
        gen = torch.Generator().manual_seed(2)
        tokens, hidden = 64, 256
        ids = torch.rand(WORLD * tokens, E, generator=gen).argsort(-1)[:, :K]
        source = torch.arange(WORLD).repeat_interleave(tokens)
        predicted = dispatch_times(ids, Placement.contiguous(E, SHAPE), source, hidden, 4, emulated, names=NAMES)
        assert set(predicted) == {"off", "rack", "node"}
        for dedup in predicted:
            measured = time_dispatch(ids, source, E, mesh, hidden, dedup, repeats=5)  # median: robust to 2 late wakes
            assert 0.8 * predicted[dedup] < measured < 1.5 * predicted[dedup] + 0.03, (dedup, measured, predicted)
    rack_slow = LinkModel({"flat": (0, 1e-6), "rack": (0, 1e-6), "node+local": (0, 1e-9), "rack+node": (0, 1e-6),
                           "local": (0, 1e-9)})
    node_slow = LinkModel({"flat": (0, 1e-6), "rack": (0, 1e-6), "node+local": (0, 1e-6), "rack+node": (0, 1e-6),
                           "local": (0, 1e-9)})
    for link, want in ((rack_slow, "rack"), (node_slow, "node")):
        times = dispatch_times(ids, Placement.contiguous(E, SHAPE), source, hidden, 4, link, names=NAMES)
        assert choose_dedup(times) == want, (want, times)


def _levels(rank, world, tmp):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=world,
                            timeout=timedelta(seconds=TIMEOUT))
    mesh = init_device_mesh("cpu", SHAPE, mesh_dim_names=NAMES)
    group = setup_mesh(mesh)
    _exchanges_equal_one_process(group, rank)
    _links_and_choice(mesh, rank)
    dist.barrier()
    if rank == world - 1:
        os._exit(0)  # dies without a word: the others' next exchange must fail, not hang
    ids, w, x = _routing()
    start = time.monotonic()
    with pytest.raises(Exception):
        _exchange(x[:T], w[:T], ids[:T], group, "node", rank)
    assert time.monotonic() - start < TIMEOUT + 15
    os._exit(0)  # the group is broken: leave without tearing it down (which could wait on the dead rank)


def test_dedup_at_every_level_of_a_three_level_mesh(tmp_path):
    spawn(_levels, args=(WORLD, str(tmp_path)), nprocs=WORLD)
