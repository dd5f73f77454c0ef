"""Expert domains (HybridEP, hybridep.md §IV): ``parallelize(..., expert_domains={"node": 2})``.

The mesh's dimensions are the multilevel description (outermost first; each level's scaling factor its size), and
``expert_domains`` gives, per level, how many of its workers form one domain (1 where a level is not named). Each
rank still owns its E / W experts (their parameters, gradients and optimizer state, its state_dict shard); in each
forward it all-gathers the experts of its domain (``moe.domain_gather``: the ranks of the same domain at every
level) and computes its own tokens for them; tokens for other domains' experts go padding-free to the rank at the
same offset in the expert's domain (the ranks of equal offsets at every level: the exchange group, each of which
holds one domain's experts) and come back combined. Backward: each gathered copy's gradient summed back to the
owner; token gradients return the way the tokens came. Chained over the levels, Algorithm 1's all-gathers and
all-to-alls (``runtime/comm/hybrid.py``) reach exactly these two groups; the rows go in one exchange.

Within the exchange group, member j holds its domain's ranks' experts in rank order, which need not be the
experts' order (domains over an outer level only): each expert's slot in that order is a buffer of the module
(``DOMAIN_SLOTS``), by which the rows are sorted before they are sent (``moe.ep_to_slots``, as expert swap does).
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from moecompile.runtime.comm import hybrid, stream
from moecompile.runtime.comm.exchange import register_group_kind
from moecompile.runtime.comm.levels import kind

from .mesh import copies_split, ep_group, ep_groups, ep_shape, level_names


@dataclass
class Domains:
    """This rank's domain group (the ranks whose experts it gathers) and exchange group (the ranks it sends tokens
    to), their sizes per level, and each expert's slot (``slots(E)``)."""

    sizes: dict[str, int]
    domain_group: object
    exchange_group: object
    gather_ranks: list[int]
    exchange_ranks: list[int]
    mesh_shape: tuple[int, ...]  # the expert-parallel group's (the mesh's but "pp"), whose ranks the two lists count
    domain_sizes: tuple[int, ...]
    compress: float | None = None  # the fraction of residual entries sent (SR compression), or None: exact
    reshard: bool = False  # reshard_after_forward: the gathered copies freed after forward, gathered again in backward
    members: tuple[int, ...] = ()  # the expert-parallel group's global ranks (the world's, or a pipeline stage's)

    def slots(self, num_experts: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """Expert -> its slot in the exchange group's gathered order (every rank's the same)."""
        world = len(self.gather_ranks) * len(self.exchange_ranks)
        per_rank = num_experts // world
        order = []  # the owners, in the order the exchange group's members hold their domains' experts
        for member in self.exchange_ranks:
            order += hybrid.groups(member, self.mesh_shape, self.domain_sizes)[0]
        slot_of_rank = {owner: i for i, owner in enumerate(order)}
        expert = torch.arange(num_experts)
        slots = torch.tensor([slot_of_rank[int(e) // per_rank] for e in expert]) * per_rank + expert % per_rank
        return slots.to(device)  # beside the weights the ops read them with

    def describe(self) -> str:
        text = (f"expert domains {self.sizes}: the experts of ranks {[self.members[r] for r in self.gather_ranks]} "
                f"gathered here, tokens for other domains' experts exchanged with ranks "
                f"{[self.members[r] for r in self.exchange_ranks]}")
        if self.compress is not None:
            text += (f"; compress={self.compress:g}: the gathered experts are the shared (mean) expert plus each "
                     "one's largest residual entries, not exact (this changes the forward)")
        elif self.reshard:
            text += "; reshard_after_forward: the gathered experts freed after forward and gathered again in backward"
        else:
            text += "; the gathered experts kept for backward (reshard_after_forward=True gathers them again instead)"
        return text


def check(expert_domains, compress, reshard, mesh, link_model=None, **others) -> dict[str, int] | str | None:
    """The domain size of each mesh level (None: plain expert parallelism; "auto": each layer's, by the stream
    model, ``choose``), or ValueError naming the fix."""
    if not isinstance(reshard, bool):
        raise ValueError(f"reshard_after_forward={reshard!r}: give True (free the gathered experts after forward and "
                         "gather them again in backward) or False (keep them for backward)")
    if reshard and expert_domains is None and not copies_split(mesh):
        raise ValueError("reshard_after_forward=True frees the exact copies an expert domain (or a 'dp_shard' mesh "
                         "dimension's copies) gathers: give expert_domains or a 'dp_shard' dimension too")
    if reshard and compress is not None:
        raise ValueError("reshard_after_forward=True with compress is not built: compressed domains keep only the "
                         "residual pairs for backward and decode them again there; drop one of them")
    if compress is not None:
        if expert_domains is None:
            raise ValueError(f"compress={compress!r} compresses the experts an expert domain gathers: give "
                             "expert_domains too, or leave compress=None")
        if isinstance(compress, bool) or not isinstance(compress, (int, float)) or not 0 < compress <= 1:
            raise ValueError(f"compress={compress!r}: the fraction of residual entries kept must be in (0, 1], "
                             "e.g. 0.02 (hybridep.md keeps 1 in 50), or None for exact experts")
    if expert_domains is None:
        return None
    names = level_names(mesh)
    if expert_domains == "auto" and link_model is None:
        raise ValueError("expert_domains='auto' sizes each layer's domains by hybridep.md's stream model, which "
                         "prices the links: pass link_model= a LinkModel or the JSON file `torchrun --nproc-per-node "
                         "N -m moecompile calibrate --mesh NODESxLOCAL --out links.json` wrote, or give the domain "
                         "size of each level, e.g. expert_domains={" f"{names[0]!r}: 2" "}")
    if expert_domains != "auto" and (not isinstance(expert_domains, dict)
                                     or any(k not in names for k in expert_domains)):
        raise ValueError(f"expert_domains={expert_domains!r}: give a dict from this mesh's level names {list(names)} "
                         "to how many workers of that level form one domain, e.g. {" f"{names[0]!r}: 2" "}")
    asked = [name for name, on in others.items() if on]
    if asked:
        raise ValueError(f"expert_domains with {', '.join(asked)} is not built: drop {' and '.join(asked)} or "
                         "expert_domains")
    if expert_domains == "auto":
        return "auto"
    sizes = {n: expert_domains.get(n, 1) for n in names}
    hybrid.check(ep_shape(mesh), tuple(sizes.values()))  # each divides its level
    return sizes


def check_layer(rec, compress=None) -> None:
    """ValueError where a layer's experts cannot be compressed (flat [E * R, ...] weights or an ``nn.ModuleList``'s:
    the shared expert is the mean of stacked experts; identity experts)."""
    if compress is not None and rec.spec.experts.storage not in ("stacked", "modulelist"):
        raise ValueError(f"compress= works on stacked [E, ...] expert weights or nn.ModuleList experts; MoE layer "
                         f"{rec.path} stores them {rec.spec.experts.storage}: drop compress")
    if compress is not None and rec.spec.experts.identity_experts:
        raise ValueError(f"compress= does not take identity experts yet (MoE layer {rec.path}, "
                         f"{rec.spec.experts.identity_experts} of them): drop compress")


def view_args(domains, group, views: dict) -> tuple[str, dict]:
    """(the group the rows are exchanged over, the views' keyword arguments): with ``domains`` its exchange group and
    the domain's (compression and gathering again in backward too), else ``group`` and ``views`` as they are."""
    if domains is None:
        return group.group_name, views
    views = {**views, "domain_group": domains.domain_group.group_name}
    if domains.compress is not None:  # SR compression: the shared expert is the mean over every rank's
        views.update(compress=float(domains.compress), compress_group=group.group_name)
    if domains.reshard:  # the distribute pass has the gather computed again in backward
        views.update(reshard=True)
    return domains.exchange_group.group_name, views


_GROUPS: dict[tuple, tuple] = {}


def setup(mesh, sizes: dict[str, int], compress: float | None = None, reshard: bool = False) -> Domains:
    """This rank's domain and exchange groups (every rank makes all of them, in the same order, once per mesh
    and domain sizes: under ``"pp"`` each stage's too, of its ranks)."""
    from .mesh import _timeout

    shape, domain_sizes, stages = ep_shape(mesh), tuple(sizes.values()), ep_groups(mesh)
    members = next(g for g in stages if dist.get_rank() in g)
    rank = members.index(dist.get_rank())
    key = (tuple(mesh.mesh.shape), tuple(mesh.mesh_dim_names or ()), domain_sizes)
    if key not in _GROUPS or _GROUPS[key][0] is not dist.group.WORLD:
        made = []
        for which in (0, 1):
            every = sorted({tuple(hybrid.groups(m, shape, domain_sizes)[which]) for m in range(len(members))})
            mine, _ = dist.new_subgroups_by_enumeration([[g[r] for r in ranks] for g in stages for ranks in every],
                                                        timeout=_timeout())
            made.append(mine)
        _GROUPS[key] = (dist.group.WORLD, *made)
    gather, exchange = hybrid.groups(rank, shape, domain_sizes)
    names = level_names(mesh)
    for group, ranks in ((_GROUPS[key][1], gather), (_GROUPS[key][2], exchange)):  # emulate_links's kinds
        if len(ranks) > 1:
            register_group_kind(group.group_name, kind(names, stream.spanned(ranks, shape)))
    return Domains(sizes, _GROUPS[key][1], _GROUPS[key][2], gather, exchange, shape, domain_sizes, compress, reshard,
                   tuple(members))


def prepare(mesh, domains, compress: float | None = None, reshard: bool = False):
    """What ``check`` gave, at ``parallelize``'s start (every rank together): sizes -> their ``Domains``; None and
    "auto" as they are, with under ``"pp"`` the groups of every candidate's domains made for "auto" (each stage's
    layers choose their own sizes later, when the other stages' ranks make no group)."""
    if isinstance(domains, dict):
        return setup(mesh, domains, compress, reshard)
    if domains == "auto" and len(ep_groups(mesh)) > 1:
        for sizes in stream.candidates(ep_shape(mesh)):
            setup(mesh, dict(zip(level_names(mesh), sizes)))
    return domains


def choose(records, link, routing: dict, mesh, group, pre: dict[str, float] | None = None, training: bool = False,
           reshard: bool = False) -> None:
    """``expert_domains="auto"``: each layer's domain sizes (``rec.domain_sizes``), the least time the stream model
    (``runtime/comm/stream.py``) predicts for one forward of every rank's example routing (gathered, so every
    rank decides alike) on ``link``, over every candidate, and with ``training`` for its backward too (``reshard``:
    the gather again there); ``rec.domain_reason`` lists each candidate's predicted time and the chosen one's
    measured time (``time_hybrid``, one forward's communication on the example routing). ``pre``: each layer's
    pre-expert time PE (``pre_expert_seconds``), with which Eq. 7 credits min(PE, AG) of the all-gather started
    ahead; none given: 0."""
    pre = pre or {}
    every = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, {rec.path: routing.get(rec.path) for rec in records}, group=group)
    names, shape = level_names(mesh), ep_shape(mesh)
    W = math.prod(shape)
    for rec in records:
        ids = [mine[rec.path] for mine in every]
        rec.domain_sizes = dict.fromkeys(names, 1)
        if any(i is None for i in ids):
            rec.domain_reason = "expert domains auto: no routing was recorded on the example input, none taken"
            continue
        e = rec.spec.experts
        weight = next(iter(rec.expert_weights.values()))
        weight = weight[0] if isinstance(weight, list) else weight  # (a ModuleList: its first expert's)
        elem = weight.element_size()
        mats = 3 if e.gated else 2
        expert_bytes = mats * e.hidden * e.intermediate * (e.num_experts // W) * elem
        source = torch.cat([torch.full((len(i),), r) for r, i in enumerate(ids)])
        every_ids = torch.cat(ids)
        if e.identity_experts:  # their rows stay home: priced as rows to an expert of the token's own rank
            every_ids = torch.where(every_ids < e.num_experts, every_ids, (source * (e.num_experts // W))[:, None])
        rate = compute_rate(e.hidden, e.intermediate, max(1, every_ids.numel() // W), weight.dtype, group,
                            device=weight.device)
        pe = pre.get(rec.path, 0.0)
        predicted = [stream.predict(every_ids, source, shape, names, c, e.num_experts, e.hidden * elem,
                                    expert_bytes, link, mats * e.hidden * e.intermediate, rate, pre_s=pe,
                                    overlap=True, backward=training, reshard=reshard)
                     for c in stream.candidates(shape)]
        best = stream.choose(predicted)
        rec.domain_sizes = dict(zip(names, best.domain_sizes))
        measured = time_hybrid(every_ids, source, e.num_experts, mesh, e.hidden, rec.domain_sizes, expert_bytes,
                               device=weight.device)
        what = ("one training step's expert communication and compute (the expert weights require grad: "
                "hybridep.md Eq. 8's forward, and the backward's GEMMs, exchanges and reduce-scatter"
                + (", gathered again" if reshard else "") + ")") if training else \
            "one forward's expert communication and compute (hybridep.md Eq. 8)"
        rec.domain_reason = (
            f"expert domains auto -> {rec.domain_sizes}: least predicted time of {what} for the example routing "
            f"(pre-expert time PE {pe * 1e3:.3g} ms, measured eagerly on the example: the forward's all-gather "
            "overlaps it, Eq. 7): "
            + ", ".join(f"{dict(zip(names, p.domain_sizes))} {p.total * 1e3:.3g} ms" for p in predicted)
            + f"; measured {measured * 1e3:.3g} ms (one forward's communication)")


def pre_expert_seconds(model, paths: list[str], example_args, group, repeats: int = 2) -> dict[str, float]:
    """Eq. 2's PE of each MoE block at ``paths``: the time from the previous block's end (the model's start, for
    the first) to the block's start, over which the distribute pass runs the block's all-gather (item 4 starts it
    after the previous layer's experts): one eager forward of the example without gradients (the last of
    ``repeats``; random state kept), the least over the ranks so that Eq. 7's overlap is not overstated. The
    block's own router, inside it, is not counted. A block called more than once: its first call."""
    marks: dict[str, list[float]] = {}
    cuda = any(p.is_cuda for p in model.parameters())

    def now() -> float:
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    def mark(path: str, at: int):
        def hook(*_):
            marks.setdefault(path, [math.nan, math.nan])
            if math.isnan(marks[path][at]):
                marks[path][at] = now()
        return hook

    handles = [model.register_forward_pre_hook(mark("", 1))]
    for path in paths:
        module = model.get_submodule(path)
        handles += [module.register_forward_pre_hook(mark(path, 0)), module.register_forward_hook(mark(path, 1))]
    try:
        with torch.no_grad(), torch.random.fork_rng():
            for _ in range(repeats):
                marks.clear()
                model(*example_args)
    finally:
        for h in handles:
            h.remove()
    ends = sorted((t[1], p) for p, t in marks.items())
    pe = []
    for path in paths:
        start = marks.get(path, [math.nan])[0]
        before = [end for end, p in ends if end <= start and p != path]
        pe.append(start - before[-1] if before else 0.0)
    seconds = torch.tensor([x if x == x else 0.0 for x in pe], dtype=torch.float64,
                           device="cuda" if cuda else "cpu")  # NCCL reduces no CPU tensor
    dist.all_reduce(seconds, op=dist.ReduceOp.MIN, group=group)
    return dict(zip(paths, seconds.tolist()))


def compute_rate(hidden: int, intermediate: int, rows: int, dtype, group, repeats: int = 3, device="cpu") -> float:
    """Eq. 1's C: multiply-adds per second of a [rows, H] x [H, I] GEMM on ``device`` (the experts'), the
    slowest rank's."""
    device = torch.device(device)
    a = torch.randn(rows, hidden, dtype=dtype, device=device)
    b = torch.randn(hidden, intermediate, dtype=dtype, device=device)
    samples = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        a @ b
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        samples.append(time.perf_counter() - start)
    seconds = torch.tensor([max(statistics.median(samples[1:]), 1e-9)], dtype=torch.float64, device=device)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX, group=group)
    return rows * hidden * intermediate / float(seconds)


def time_hybrid(ids_TK: torch.Tensor, source_rank_T: torch.Tensor, num_experts: int, mesh, hidden: int,
                sizes: dict[str, int], expert_bytes: int, repeats: int = 3, layer: str = "calibrate",
                device="cpu") -> float:
    """Seconds of one forward's expert communication with these domain sizes (the domain's all-gather of
    ``expert_bytes`` per rank, the exchange of this routing's rows for other domains' experts and their outputs
    back, experts passing rows through): the median over ``repeats`` of the slowest rank. The result is checked
    (each token gets back its routing weights' sum times itself). ``device``: where the rows and the stand-in
    experts are (a CUDA model's GPU)."""
    import moecompile.runtime.comm.ops  # noqa: F401  (registers the ops)
    import moecompile.runtime.comm.domains  # noqa: F401

    from .calibrate import _slowest_median

    d = setup(mesh, sizes)
    group = ep_group(mesh)
    rank, E, ops = dist.get_rank(group), num_experts, torch.ops.moe
    device = torch.device(device)
    ids = d.slots(E)[ids_TK[source_rank_T == rank].cpu()].to(device)  # by slot: the exchange group's members
    T, K = ids.shape  # hold them in order
    gen = torch.Generator().manual_seed(rank)
    x, weights_TK = torch.randn(T, hidden, generator=gen).to(device), torch.rand(T, K, generator=gen).to(device)
    order = torch.argsort(ids.reshape(-1), stable=True)
    tok_B, counts_E, w_B = order // K, torch.bincount(ids.reshape(-1), minlength=E), weights_TK.reshape(-1)[order]
    mine = torch.zeros(max(1, expert_bytes // 4), device=device)  # fp32 stand-in for this rank's experts

    def once():
        if len(d.gather_ranks) > 1:
            ops.domain_gather(mine, d.domain_group.group_name, layer)
        if len(d.exchange_ranks) > 1:
            group = d.exchange_group.group_name
            r = ops.ep_dispatch(x, tok_B, counts_E, group, layer)
            y = ops.ep_combine(r[0][r[1]], r[1], counts_E, r[3], tok_B.numel(), group, layer)
        else:
            y = x[tok_B]
        return torch.zeros_like(x).index_add_(0, tok_B, y * w_B[:, None])

    seconds, out = _slowest_median(once, repeats, group, device)
    torch.testing.assert_close(out, x * weights_TK.sum(-1, keepdim=True), msg=lambda m: f"{sizes} exchange: {m}")
    return seconds
