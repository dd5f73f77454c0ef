"""``python -m moecompile calibrate``: time all-to-alls of several sizes at each level of a device mesh and fit the
alpha-beta link model the ``dedup="auto"`` choice reads (``runtime/comm/cost_model.py``).

    torchrun --standalone --nproc-per-node 4 -m moecompile calibrate --mesh 2x2 --out links.json

Kinds timed: ``flat`` (every rank of the mesh), and on a mesh of several levels the two collectives of dedup at
each level (``runtime/comm/levels.py``): on ``("node", "local")`` ``node`` (the ranks of one local index, one per
node) and ``local`` (the ranks of one node); on ``--mesh 2x2x2`` (``("rack", "node", "local")``) also ``rack``,
``node+local`` and ``rack+node``. Each rank sends ``m`` bytes to every other rank
of the collective; the sample is (bytes a rank sends the others, seconds of the slowest rank), the median of
``repeats`` timings; the fit is least squares per kind, with r2. The collectives run through the expert-parallel
runtime's own all-to-all (``comm/exchange.py``), so a link emulation (``--emulate links.json``) is measured as
the layers would feel it.
"""

from __future__ import annotations

import statistics
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from moecompile.runtime.comm import exchange
from moecompile.runtime.comm.cost_model import LinkModel
from moecompile.runtime.comm.levels import LEVELS

from .mesh import device_of, level_groups, setup_mesh

DEFAULT_SIZES = (1 << 10, 1 << 13, 1 << 16, 1 << 18, 1 << 20)  # bytes each rank sends each other rank


def _slowest_median(run, repeats: int, group, device):
    """(median over ``repeats`` runs, after a warm-up, of the slowest rank's seconds of ``run()``; its last result).
    Every rank of ``group`` calls it together."""
    samples = []
    for i in range(repeats + 1):  # the first is a warm-up
        dist.barrier(group=group)
        start = time.perf_counter()
        result = run()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=device)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=group)  # the collective lasts its slowest rank
        if i:
            samples.append(float(elapsed))
    return statistics.median(samples), result


def _time_all_to_all(group, nbytes_per_peer: int, repeats: int, device) -> float:
    world = dist.get_world_size(group)
    rows = torch.zeros(world * max(1, nbytes_per_peer // 4), dtype=torch.float32, device=device)
    out = torch.empty_like(rows)
    return _slowest_median(lambda: exchange._all_to_all(out, rows, None, None, group), repeats, group, device)[0]


def calibrate(mesh, sizes=DEFAULT_SIZES, repeats: int = 5, progress: bool = True) -> LinkModel:
    """Time and fit every kind of ``mesh``; every rank returns the same ``LinkModel``."""
    if len(set(sizes)) < 2:
        raise ValueError(f"calibration needs two message sizes at least; got {list(sizes)}")
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1; got {repeats}")
    device = device_of(mesh)
    groups = level_groups(mesh)
    steps = [(kind, size) for kind in groups for size in sizes]
    if progress and dist.get_rank() == 0:
        from tqdm import tqdm

        steps = tqdm(steps, desc="calibrating links", unit="size")
    samples: dict[str, list[tuple[float, float]]] = {kind: [] for kind in groups}
    for kind, size in steps:
        group = groups[kind]
        seconds = _time_all_to_all(group, size, repeats, device)
        samples[kind].append(((dist.get_world_size(group) - 1) * size, seconds))
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, samples)  # the node and local groups differ per rank: take the slowest
    merged = {kind: [(b, max(s[kind][i][1] for s in everyone)) for i, (b, _) in enumerate(pairs)]
              for kind, pairs in samples.items()}
    return LinkModel.fit(merged)


def main(args) -> int:
    from torch.distributed.device_mesh import init_device_mesh

    shape = tuple(int(n) for n in args.mesh.lower().split("x"))
    device_type = "cuda" if torch.cuda.is_available() and not args.cpu else "cpu"
    if not dist.is_initialized():
        if device_type == "cuda":
            import os

            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl" if device_type == "cuda" else "gloo",
                                timeout=timedelta(seconds=args.timeout))
    try:
        if dist.get_world_size() != torch.Size(shape).numel():
            raise SystemExit(f"--mesh {args.mesh} has {torch.Size(shape).numel()} ranks but torchrun started "
                             f"{dist.get_world_size()}: give --nproc-per-node (x --nnodes) equal to the mesh size")
        names = tuple(args.names.split(",")) if args.names else LEVELS[-len(shape):] if len(shape) > 1 else ("ep",)
        if len(names) != len(shape):
            raise SystemExit(f"--names {args.names} names {len(names)} levels but --mesh {args.mesh} has {len(shape)}")
        mesh = init_device_mesh(device_type, shape, mesh_dim_names=names)
        sizes = [int(s) for s in args.sizes.split(",")] if args.sizes else DEFAULT_SIZES
        emulated = LinkModel.load(args.emulate) if args.emulate else None
        with exchange.emulate_links(emulated):
            model = calibrate(mesh, sizes, args.repeats)
        if dist.get_rank() == 0:
            for kind, (alpha, beta) in model.params.items():
                print(f"{kind:>10}: alpha {alpha * 1e6:9.2f} us  beta {beta * 1e9:9.4f} ns/B  "
                      f"({1 / beta / 1e9 if beta else float('inf'):.3g} GB/s)  r2 {model.r2[kind]:.4f}")
            model.save(args.out)
            print(f"wrote {args.out}")
    finally:
        dist.destroy_process_group()
    return 0


def time_dispatch(ids_TK: torch.Tensor, source_rank_T: torch.Tensor, num_experts: int, mesh, hidden: int,
                  dedup: str, repeats: int = 3, layer: str = "calibrate", device="cpu") -> float:
    """Seconds of one dispatch and combine of this routing (the tokens of every rank; this rank runs its own,
    ``source_rank_T == rank``) through the expert-parallel ops, experts passing their rows through: the median
    over ``repeats`` of the slowest rank. The result is checked (each token gets back its routing weights' sum
    times itself), so a timing is never of a wrong exchange. ``device``: where the rows are (a CUDA model's GPU;
    NCCL exchanges no CPU tensor)."""
    import moecompile.runtime.comm.ops  # noqa: F401  (registers the ops)
    from moecompile.runtime.comm.dedup import hierarchical_experts

    group = setup_mesh(mesh)
    rank, E = dist.get_rank(group), num_experts
    device = torch.device(device)
    ids = ids_TK[source_rank_T == rank].to(device)
    T, K = ids.shape
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(T, hidden, generator=gen).to(device)
    weights_TK = torch.rand(T, K, generator=gen).to(device)
    order = torch.argsort(ids.reshape(-1), stable=True)
    tok_B, counts_E, w_B = order // K, torch.bincount(ids.reshape(-1), minlength=E), weights_TK.reshape(-1)[order]
    ops = torch.ops.moe

    def run_experts(x_RH, perm_R, counts_L):  # the experts' rows, in expert order
        return x_RH[perm_R]

    def once():
        if dedup != "off":
            return hierarchical_experts(x, tok_B, counts_E, w_B, run_experts, group.group_name, layer, dedup)
        d = ops.ep_dispatch(x, tok_B, counts_E, group.group_name, layer)
        y = ops.ep_combine(run_experts(d[0], d[1], d[2]), d[1], counts_E, d[3], tok_B.numel(), group.group_name,
                           layer)
        return torch.zeros_like(x).index_add_(0, tok_B, y * w_B[:, None])

    seconds, out = _slowest_median(once, repeats, group, device)
    torch.testing.assert_close(out, x * weights_TK.sum(-1, keepdim=True), msg=lambda m: f"{dedup} exchange: {m}")
    return seconds
