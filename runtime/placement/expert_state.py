"""The experts' optimizer, decoupled from where their instances live (adaptive replication; the paper's §3.3 and
§4.1-4.4): each rank keeps a fixed 1/W of every expert's parameters (``ExpertPartition``) as fp32 master weights
in host memory (pinned where CUDA is), stepped there by a torch optimizer of the user's class; it never moves.

One step of a layer, given this rank's slot gradients ``[S, P]`` (P: one expert's parameters, flattened):

    1 reduce_instances   sum an expert's instances on the rank, all-reduce over the consecutive ranks hosting it
    2 collect            each rank takes its part of every expert's gradient from one hosting rank (get_source)
    3 host step          the user's optimizer over the rank's [E, P_w] master part ("dp_shard": its share, the
                         part's gradient reduce-scattered over the copies first, ``ExpertPartition.scatter``)
    4 distribute         each rank sends its updated parts (from its shares: ``whole``) to the ranks hosting the
                         expert next; slots written

In both exchanges a rank sends one message to each other rank (every expert's parts stacked in expert order).
``BYTES`` counts what each phase moves (phase -> bytes, this rank; ``.local``: stayed on the rank;
``distribute.copy``: copies into further instances). Why those counts equal static placement's, and what the
network alone sees: ``docs/replication.md``.
"""

from __future__ import annotations

import math
from collections import defaultdict

import torch
import torch.distributed as dist

from ..layouts import contiguous_stride
from .replication import consecutive_groups, gradient_sources, hosting_ranks

Tensor = torch.Tensor

BYTES: dict[str, int] = defaultdict(int)  # phase ("reduce", "collect", "distribute") -> bytes this rank sent


def bounds(numel: int, world: int) -> list[int]:
    """Where each rank's part of ``numel`` rows begins (and, last, where they end): ``torch.chunk``'s parts
    (ceil(numel / world) each, the last ones shorter or empty), so a part is a DTensor ``Shard`` piece."""
    size = -(-numel // world)
    return [min(r * size, numel) for r in range(world + 1)]


class ExpertPartition:
    """This rank's part of every expert of one layer: ``master`` ``[E, P_w]`` fp32 (host). Each weight, ``[E, R,
    ...]`` per expert, is cut along R (``torch.chunk`` parts over the ranks), so the rank's part of a weight is
    its DTensor ``Shard(1)`` piece; ``P_w`` holds the rank's rows of every weight, weight after weight.

    The layer's ``[n, P]`` rows (``flatten``: n experts' weights, P elements each) are in rank order: rank 0's
    part of every weight, then rank 1's...; ``bounds[r]`` is where rank r's begins, so ``master`` is the rank's
    columns of ``flatten(weights)``, or, where copies of the group split it (``split``: ``"dp_shard"``), the
    rank's share of those columns: of each weight, its ``torch.chunk`` share of the part's rows (its DTensor piece
    nested under the part's, ``host_placements``)."""

    def __init__(self, full: list[Tensor], rank: int, world: int, split: tuple | None = None):
        """``full``: the layer's expert weights, each ``[E, R, ...]``, the same on every rank. ``split``: (this
        rank's index, their count, their group) among the ranks holding the same part in the copies that split it
        (``"dp_shard"``): each keeps, as ``master``, its ``torch.chunk`` share of the part's rows of each weight
        (``share``; ``whole`` and ``scatter`` move between the part and the shares over the group)."""
        self.shapes = [tuple(w.shape[1:]) for w in full]
        self.dtypes = [w.dtype for w in full]
        self.rank, self.world = rank, world
        row = [math.prod(shape[1:]) for shape in self.shapes]  # elements of one row of each weight
        self.rows = [bounds(shape[0], world) for shape in self.shapes]  # each weight's rows of each rank
        self.numel = sum(math.prod(shape) for shape in self.shapes)
        # per rank, per weight: the elements of one expert's weight in the rank's rows (a run: no index tensor,
        # which for one DeepSeek-V3 expert would be 44 M int64 elements a layer)
        self.runs = [[(cut[r] * size, cut[r + 1] * size) for cut, size in zip(self.rows, row)] for r in range(world)]
        self.bounds = [0]
        for runs in self.runs:
            self.bounds.append(self.bounds[-1] + sum(hi - lo for lo, hi in runs))
        self.index, self.count, self.split_group = split or (0, 1, None)
        self.own = []  # per weight: the rows this rank keeps (its part's, or its share of them)
        self.shares = [[] for _ in range(self.count)]  # per share: its runs of columns of the rank's [E, P_w] part
        at = 0
        for cut, size in zip(self.rows, row):
            n = cut[rank + 1] - cut[rank]
            sub = bounds(n, self.count)
            for d, runs in enumerate(self.shares):
                runs.append((at + sub[d] * size, at + sub[d + 1] * size))
            self.own.append((cut[rank] + sub[self.index], cut[rank] + sub[self.index + 1]))
            at += n * size
        self.width = [sum(hi - lo for lo, hi in runs) for runs in self.shares]  # each share's columns
        part = self.part_of(full)  # (a new tensor of the rank's columns alone: no weight flattened whole)
        if torch.cuda.is_available():
            part = part.pin_memory()
        self.master = torch.nn.Parameter(part)

    def flatten(self, weights: list[Tensor]) -> Tensor:
        """``n`` experts' weights (each ``[n, ...]``, its elements per expert in the weight's order) as ``[n, P]``
        rows in rank order."""
        n = weights[0].shape[0]
        flat = [w.detach().reshape(n, -1) for w in weights]
        return torch.cat([w[:, lo:hi] for runs in self.runs for w, (lo, hi) in zip(flat, runs)], 1)

    def unflatten(self, rows: Tensor) -> list[Tensor]:
        """``[n, P]`` rows (rank order) as the layer's weights, each ``[n, ...]`` in its dtype."""
        pieces, at = [[] for _ in self.shapes], 0  # per weight, its run of each rank's columns
        for runs in self.runs:
            for i, (lo, hi) in enumerate(runs):
                pieces[i].append(rows[:, at:at + hi - lo])
                at += hi - lo
        return [torch.cat(p, 1).reshape(rows.shape[0], *shape).to(dtype)
                for p, shape, dtype in zip(pieces, self.shapes, self.dtypes)]

    def pieces(self, part: Tensor) -> list[Tensor]:
        """This rank's ``[E, P_w]`` part (``master``, or optimizer state shaped like it) as its piece of each
        weight, ``[E, its rows, ...]``."""
        out, at = [], 0
        for shape, (lo, hi) in zip(self.shapes, self.own):
            n = hi - lo
            size = n * math.prod(shape[1:])
            out.append(part[:, at:at + size].reshape(part.shape[0], n, *shape[1:]))
            at += size
        return out

    def dtensors(self, part: Tensor, mesh) -> list:
        """``pieces(part)`` as DTensors of each whole weight ``[E, R, ...]`` over ``mesh`` (the hosts: every rank
        of the group, in order; with shares, ``host_placements``), ``Shard(1)``."""
        from torch.distributed.tensor import DTensor

        out = []
        for piece, shape in zip(self.pieces(part), self.shapes):
            whole = (part.shape[0], *shape)
            out.append(DTensor.from_local(piece.contiguous(), mesh, host_placements(mesh, 1), run_check=False,
                                          shape=whole, stride=contiguous_stride(whole)))
        return out

    def part_of(self, values: list, mesh=None) -> Tensor:
        """This rank's ``[E, P_w]`` part (or its share) of the weights ``values`` (each whole ``[E, R, ...]``, or a
        DTensor of one: on ``mesh``, as ``dtensors`` made it, its local piece; else gathered first), fp32 on the
        host."""
        from torch.distributed.tensor import DTensor

        out = []
        for value, shape, (lo, hi) in zip(values, self.shapes, self.own):
            if isinstance(value, DTensor):
                if value.device_mesh == mesh and tuple(value.placements) == tuple(host_placements(mesh, 1)):
                    piece = value.to_local()
                else:
                    value = value.full_tensor()
            if not isinstance(value, DTensor):
                piece = value.reshape(-1, *shape)[:, lo:hi]  # (a flat weight too)
            out.append(piece.detach().reshape(piece.shape[0], -1).to("cpu", torch.float32))
        return torch.cat(out, 1)

    def share(self, part: Tensor, index: int | None = None) -> Tensor:
        """This rank's share (``index``: that share) of its ``[E, P_w]`` part (the part itself without shares)."""
        if self.count == 1:
            return part
        return torch.cat([part[:, lo:hi] for lo, hi in self.shares[self.index if index is None else index]], 1)

    def scatter(self, part: Tensor) -> Tensor:
        """This rank's share of ``part`` (``[E, P_w]``) summed over the ranks splitting it (every one calls it
        together; without shares, ``part``): one reduce-scatter, each share padded to the widest."""
        if self.count == 1:
            return part
        wide = max(self.width)
        stacked = part.new_zeros(self.count, part.shape[0], wide)
        for d in range(self.count):
            stacked[d, :, :self.width[d]] = self.share(part, d)
        out = part.new_empty(part.shape[0], wide)
        dist.reduce_scatter_single(out, stacked.view(-1, wide), group=self.split_group)
        BYTES["share"] += stacked.numel() * stacked.element_size()
        return out[:, :self.width[self.index]].contiguous()

    def whole(self) -> Tensor:
        """This rank's ``[E, P_w]`` part of ``master`` (detached), gathered from every share (one all-gather; every
        rank splitting it calls it together; without shares, ``master`` itself)."""
        mine = self.master.detach()
        if self.count == 1:
            return mine
        padded = mine.new_zeros(mine.shape[0], max(self.width))
        padded[:, :mine.shape[1]] = mine
        every = mine.new_empty(self.count, *padded.shape)
        dist.all_gather_single(every.view(-1, padded.shape[1]), padded, group=self.split_group)
        BYTES["share"] += every.numel() * every.element_size()
        out = mine.new_empty(mine.shape[0], self.bounds[self.rank + 1] - self.bounds[self.rank])
        for d, runs in enumerate(self.shares):
            at = 0
            for lo, hi in runs:
                out[:, lo:hi] = every[d, :, at:at + hi - lo]
                at += hi - lo
        return out


def host_placements(mesh, dim: int) -> list:
    """The placements of a replicating layer's weights over its hosts' ``mesh`` (``dim``: the rows, 1 in ``[E, R,
    ...]``, 0 in one expert's ``[R, ...]``): ``Shard(dim)`` over the expert-parallel ranks and, nested, over
    ``"dp_shard"`` (each its share of a part), ``Replicate()`` over ``"dp_replicate"``."""
    from torch.distributed.tensor import Replicate, Shard

    return [Replicate() if name == "dp_replicate" else Shard(dim) for name in mesh.mesh_dim_names or ("ep",)]


class Groups:
    """The process groups of every run of consecutive ranks of ``group``, made once (every rank calls it
    together), each with ``timeout`` (pass the default group's: torch's default for a new gloo group is 30
    minutes, for which a dead rank would hang the others). ``every``: the global ranks of each group like
    ``group`` (``group``'s among them: the expert-parallel group of each pipeline stage), whose runs are made too,
    on every rank in the same order as ``new_group`` requires; None: ``group`` alone."""

    def __init__(self, group, timeout=None, every: list[list[int]] | None = None):
        self.group = group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        ranks = dist.get_process_group_ranks(group)
        self.by_run = {}
        for run in consecutive_groups(self.world):
            for members in every or [ranks]:
                made = dist.new_group([members[r] for r in range(run[0], run[1] + 1)], timeout=timeout)
                if members == ranks:
                    self.by_run[run] = made


def reduce_instances(grads_SP: Tensor, placement_N: Tensor, groups: Groups) -> dict[int, Tensor]:
    """Each expert hosted here -> its gradient summed over every instance on every rank (fp32)."""
    rank, S = groups.rank, grads_SP.shape[0]
    mine = placement_N[rank * S:(rank + 1) * S].cpu()
    out = {}
    for e in torch.unique(placement_N).tolist():
        hosts = hosting_ranks(placement_N, e, S)
        if rank not in hosts:
            continue
        total = grads_SP[mine == e].to(torch.float32).sum(0)
        if len(hosts) > 1:
            dist.all_reduce(total, group=groups.by_run[(hosts[0], hosts[-1])])
            BYTES["reduce"] += total.numel() * total.element_size()
        out[e] = total
    return out


def collect(reduced: dict[int, Tensor], placement_N: Tensor, part: ExpertPartition, group) -> Tensor:
    """This rank's ``[E, P_w]`` part of every expert's reduced gradient, each part from its gradient source: one
    message to each other rank, its parts of every expert this rank is the source of (experts in order)."""
    rank, world = part.rank, part.world
    S = placement_N.numel() // world
    out = torch.empty(part.master.shape[0], part.bounds[rank + 1] - part.bounds[rank], dtype=torch.float32,
                      device=next(iter(reduced.values())).device if reduced else "cpu")
    sends, recvs = defaultdict(list), defaultdict(list)  # other rank -> the experts going to it, from it
    for e in range(part.master.shape[0]):
        for dest, source in enumerate(gradient_sources(placement_N, e, world, S)):
            if source == rank and dest == rank:
                out[e] = reduced[e][part.bounds[rank]:part.bounds[rank + 1]]
                BYTES["collect.local"] += out[e].numel() * out.element_size()
            elif source == rank:
                sends[dest].append(e)
            elif dest == rank:
                recvs[source].append(e)
    ops, ranks = [], dist.get_process_group_ranks(group)
    for dest, experts in sends.items():
        lo, hi = part.bounds[dest], part.bounds[dest + 1]
        if hi > lo:
            rows = torch.stack([reduced[e][lo:hi] for e in experts])
            ops.append(dist.P2POp(dist.isend, rows, ranks[dest], group))
            BYTES["collect"] += rows.numel() * rows.element_size()
    inbox = {source: out.new_empty(len(experts), out.shape[1]) for source, experts in recvs.items() if out.shape[1]}
    ops += [dist.P2POp(dist.irecv, rows, ranks[source], group) for source, rows in inbox.items()]
    _run(ops)
    for source, rows in inbox.items():
        out[recvs[source]] = rows
    if not out.is_cuda:
        return out.cpu()
    host = torch.empty(out.shape, dtype=out.dtype, pin_memory=True)  # the device-to-host copy at full speed
    host.copy_(out, non_blocking=True)
    torch.cuda.current_stream(out.device).synchronize()  # before the host step reads it
    return host


def distribute(part: ExpertPartition, placement_N: Tensor, group, device) -> Tensor:
    """This rank's slots ``[S, P]`` (fp32, on ``device``) holding the experts ``placement_N`` names, every part
    from the rank keeping it: one message to each other rank, this rank's parts of every expert it hosts next
    (experts in order)."""
    rank, world = part.rank, part.world
    S = placement_N.numel() // world
    full = torch.empty(S, part.numel, dtype=torch.float32, device=device)
    mine = placement_N[rank * S:(rank + 1) * S].cpu()
    hosted = torch.unique(mine).tolist()  # in order
    assembled = torch.empty(len(hosted), part.numel, dtype=torch.float32, device=device)
    master = part.whole().to(device)  # this rank's parts (from its shares), on the device once (on the host: none)
    lo, hi = part.bounds[rank], part.bounds[rank + 1]
    assembled[:, lo:hi] = master[hosted]
    BYTES["distribute.local"] += len(hosted) * (hi - lo) * 4
    ops, ranks = [], dist.get_process_group_ranks(group)
    for dest in range(world):
        if dest == rank or hi == lo:
            continue
        rows = master[torch.unique(placement_N[dest * S:(dest + 1) * S]).tolist()]  # the experts dest hosts next
        ops.append(dist.P2POp(dist.isend, rows, ranks[dest], group))
        BYTES["distribute"] += rows.numel() * rows.element_size()
    inbox = {source: assembled.new_empty(len(hosted), part.bounds[source + 1] - part.bounds[source])
             for source in range(world) if source != rank and part.bounds[source + 1] > part.bounds[source]}
    ops += [dist.P2POp(dist.irecv, rows, ranks[source], group) for source, rows in inbox.items()]
    _run(ops)
    for source, rows in inbox.items():
        assembled[:, part.bounds[source]:part.bounds[source + 1]] = rows
    for i, e in enumerate(hosted):
        at = mine == e
        full[at] = assembled[i]
        BYTES["distribute.copy"] += (int(at.sum()) - 1) * part.numel * 4  # the rank's further instances of e
    return full


def _run(ops) -> None:
    """Run the point-to-point ``ops``. Over gloo, CUDA rows go through host copies: gloo's send and receive read
    and write host memory (several ranks sharing one GPU are checked with gloo, benchmarks/gpu_ep.py)."""
    if not ops:
        return
    staged = []  # (a CUDA tensor to receive into, its host buffer)
    if any(op.tensor.is_cuda for op in ops) and dist.get_backend(ops[0].group) == "gloo":
        hosted = []
        for op in ops:
            host = op.tensor.cpu() if op.op is dist.isend else torch.empty(op.tensor.shape, dtype=op.tensor.dtype)
            if op.op is not dist.isend:
                staged.append((op.tensor, host))
            hosted.append(dist.P2POp(op.op, host, op.peer, op.group, op.tag))
        ops = hosted
    for request in dist.batch_isend_irecv(ops):
        request.wait()
    for tensor, host in staged:
        tensor.copy_(host)
