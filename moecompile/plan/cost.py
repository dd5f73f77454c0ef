"""One plan's time, bytes per link and memory per GPU (every formula here is also in docs/planner.md).

Ranks are laid out over the cluster's levels, innermost fastest; tensor parallelism takes the innermost ``tp``
ranks of the innermost level. The expert-parallel group is ``ep`` ranks, innermost first: consecutive ranks
(``moe_tp`` "off" and "ssmb", the tp ranks included), or, under "ted", ranks of one tp index (experts sharded over
the data-parallel ranks, each expert's intermediate size over tp). Experts are replicated over the ``N / ep``
(TED: ``dp / ep``) expert-parallel groups, whose gradients are averaged across them.

Per MoE layer and micro-batch (forward; backward counts twice the compute and once more each exchange):
    dispatch, combine   ``runtime/comm/expected.py``'s bytes per level, each phase lasting its slowest level's
                        alpha + bytes / bandwidth (the levels' links run at once)
    experts             roofline of the grouped GEMMs: max(FLOPs / peak, bytes read and written / HBM)
    allgather           expert domains: the domain's experts gathered, less the pre-expert compute it overlaps;
                        kept for backward (every MoE layer's copies in memory at the end of forward), or freed
                        after forward and gathered again in backward (``reshard``: two layers' copies at most, and
                        one more gather a layer, started ahead as in forward: less the pre-expert part's backward,
                        twice its forward compute, that it overlaps); split copies (``shard_copies``, a
                        ``"dp_shard"`` dimension): the group's experts gathered from the R = N / ep (TED: dp /
                        ep) copies' ranks (HSDP, ``shard_over``: from the innermost R of them), (R - 1) / R of them
                        over the slowest level those span, less the pre-expert compute, kept or gathered again
                        likewise; their gradients reduce-scattered back in each backward
The step: every layer's forward and backward, the language-model head, and the gradient all-reduce (a ring: 2 (n - 1) /
n of the bytes over the slowest level the replicas span; split copies' experts: none, reduce-scattered already, or under
HSDP their pieces over the copies holding the same). Memory: bf16 weights and gradients (split copies' experts: 1 / R,
and their gathered copies), Adam (fp32 master, m, v: 12 bytes a parameter): the dense layers' sharded over the
data-parallel replicas (ZeRO-1, as FSDP2 shards them), the experts' whole on each copy kept whole, or (``zero1``) over
them by ``moecompile.expert_zero_optimizer`` (``MoEShape.zero_share``; the updated weights broadcast once a step: (n -
1) / n of them), split copies' 1 / R; activations of every layer (attention ``T H (4 + 11 / tp)`` bytes and a dense
MLP's ``19 T H I / (4 H) / tp``, Korthikanti et al. with flash attention; a MoE layer's by ``moe_layer_activations``).
Recomputation (``recompute``: every decoder layer activation-checkpointed): each layer's input kept (T H), one layer's
activations again in backward, with "save" each MoE layer's exchanged rows too; the layers' forward runs once more, and
with "recompute" each MoE layer's collectives (replication's but once a step) and its gathers, two layers' copies held.
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass

from moecompile.runtime.comm import expected, hybrid, stream
from moecompile.runtime.comm.cost_model import LinkModel, price
from moecompile.runtime.comm.levels import kind

from .cluster import Cluster, copy_counts, group_counts, stage_cluster, tile  # (the groups over the levels)
from . import schedule
from .schedule import stage_shape  # (re-exported: the busiest rank's layers)
from .shapes import MoEShape

ELEM, ADAM_BYTES = 2, 12  # bf16; Adam's fp32 master, m and v


@dataclass(frozen=True)
class Plan:
    ep: int
    tp: int
    dp: int
    moe_tp: str = "off"
    dedup: str = "off"
    expert_domains: tuple | None = None  # ((level, size), ...)
    slots_per_rank: int = 0
    reshard: bool = False  # expert domains, split copies: the gathered weights freed after forward, gathered again
    pp: int = 1  # pipeline stages over the outermost level (ep, tp, dp: inside one stage's GPUs)
    virtual: int = 1  # stages a rank holds (interleaved 1F1B: the model cut into pp x virtual stages)
    shard_copies: bool = False  # the copies of the group (N / ep; TED: dp / ep) split over their ranks ("dp_shard")
    shard_over: int = 0  # with shard_copies: split over that many copies' ranks only, the innermost, whole over the
    # rest (HSDP: ("dp_replicate", "dp_shard", ...)); 0: over every copy
    zero1: bool = False  # the copies kept whole step their experts under moecompile.expert_zero_optimizer (ZeRO-1)
    recompute: str = "off"  # every decoder layer activation-checkpointed: "recompute" (its MoE collectives run again
    # in backward: checkpoint_exchanges="recompute") or "save" (their outputs kept for backward); "off": none

    def copies(self, gpus: int) -> int:  # the expert-parallel group's copies (TED's group: over the dp ranks)
        return (self.dp if self.moe_tp == "ted" else gpus) // self.ep

    def split(self, gpus: int) -> int:  # over how many ranks each weight of the group's experts is split (1: whole)
        return (self.shard_over or self.copies(gpus)) if self.shard_copies else 1

    def as_dict(self) -> dict:
        return {"pp": self.pp, "virtual_stages": self.virtual, "ep": self.ep, "tp": self.tp, "dp": self.dp,
                "moe_tp": self.moe_tp, "dedup": self.dedup,
                "expert_domains": dict(self.expert_domains) if self.expert_domains else None, "zero1": self.zero1,
                "reshard_after_forward": self.reshard, "shard_copies": self.shard_copies, "shard_over": self.shard_over,
                "replication": {"slots_per_rank": self.slots_per_rank} if self.slots_per_rank else None,
                "recompute": self.recompute}


def moe_layer_activations(shape: MoEShape, tokens: float, tp_rows: int = 1, tp_inter: int = 1,
                          capacity: float | None = None) -> float:
    """Bytes one MoE layer keeps for backward on a GPU, x-moe.md Table 4's quantity: the dispatched rows, the
    experts' intermediate activations and the combined rows of its ``tokens`` (uniform routing; padding-free, or
    with ``capacity`` factor c the padded buffers of c K T rows). ``tp_rows``: the rows divided over tp (SSMB);
    ``tp_inter``: the intermediate size divided over tp (TED)."""
    rows = tokens * shape.top_k * (capacity or 1.0) / tp_rows
    inter = shape.intermediate / tp_inter
    return rows * ELEM * (2 * shape.hidden + (shape.mats - 1) * inter + inter)


def evaluate(shape: MoEShape, cluster: Cluster, plan: Plan, seq: int, micro_batch: int, routing=None,
             global_batch: int | None = None) -> dict:
    """The plan's entry of plan.json (``layer_s``, ``step_s``, ``microbatches``, ``tokens_per_s``,
    ``bytes_per_link``, ``memory_GB``, ``fits``), or ``{"invalid": why}`` where the cluster cannot lay it out.
    ``routing``: a measured ``plan.routing.Routing`` (uniform routing where None): the exchanges' busiest rank and
    the experts' busiest rank's rows. A step is ``global_batch`` sequences (default: one micro-batch a GPU), each of
    the plan's ``dp`` pipelines (data-parallel ranks) running M micro-batches of ``micro_batch``: M after another
    (gradient accumulation), or under ``pp`` stages 1F1B's M + pp - 1 slots of its busiest stage (``virtual``
    stages a rank: the interleaved schedule's M + (pp - 1) / virtual, ``schedule.py``)."""
    whole, shape, cluster = cluster, stage_shape(shape, plan.pp), stage_cluster(cluster, plan.pp)
    if cluster is None:
        return {"invalid": f"{plan.pp} pipeline stages do not divide the outermost level ({whole.counts[0]})"}
    sequences = global_batch or whole.gpus * micro_batch
    if sequences % (plan.dp * micro_batch):
        return {"invalid": f"a global batch of {sequences} sequences is no whole number of micro-batches of "
                           f"{micro_batch} for each of {plan.dp} pipelines"}
    micro = sequences // (plan.dp * micro_batch)
    refused = schedule.runs(plan.pp, plan.virtual, micro)
    if refused:
        return {"invalid": refused}
    N, levels = cluster.gpus, cluster.levels
    ted = plan.moe_tp == "ted"
    ep_counts = group_counts(cluster, plan.ep, plan.tp if ted else 1)
    if ep_counts is None:
        return {"invalid": f"an expert-parallel group of {plan.ep} does not tile the levels {cluster.counts}"}
    T = seq * micro_batch
    H, I, E, K = shape.hidden, shape.intermediate, shape.num_experts, shape.top_k
    tp_rows = plan.tp if plan.moe_tp == "ssmb" else 1
    tp_inter = plan.tp if ted else 1
    rows = T * K / tp_rows
    row_bytes = H * ELEM
    expert_bytes = (E // plan.ep) * shape.expert_params() // tp_inter * ELEM  # (replication: its slots, below)
    sent = {what: [0.0] * len(levels) for what in ("exchange", "gather", "tp", "replication")}

    def phase(what: str, bytes_per_level) -> float:
        for j, b in enumerate(bytes_per_level):
            sent[what][j] += b
        return level_seconds(levels, bytes_per_level)

    pre = _roofline(cluster, (2 * T * shape.attention_params() + shape.attention_core_flops(T, seq)) / plan.tp,
                    T * H * ELEM * 4)
    allgather = regather = replication = domain_ag = 0.0  # (regather: the backward's gather again,
    # reshard_after_forward; domain_ag: expert domains' gather, before the compute that hides it)
    held = expert_bytes
    if plan.expert_domains:
        sizes = dict(plan.expert_domains)
        domain_counts = [sizes.get(lv.name, 1) for lv in levels]
        domains = plan.ep // math.prod(domain_counts)  # a token's rows go to one rank of each domain
        offrank = routing.offrank(domains) if routing is not None and domains > 1 else None
        gather, rows_out = expected.domain_bytes(rows, row_bytes, ep_counts, domain_counts, expert_bytes)
        if offrank is not None:  # the busiest rank's rows, not the mean's
            rows_out = [b * offrank / (1 - 1 / domains) for b in rows_out]
        for what, nbytes in (("gather", gather), ("exchange", rows_out), ("exchange", rows_out)):  # rows, outputs
            phase(what, nbytes)
        dispatch, combine, domain_ag = domain_times(levels, ep_counts, domain_counts, rows * row_bytes,
                                                    expert_bytes, 0.0, E // plan.ep, offrank)
        allgather = max(0.0, domain_ag - pre)
        held = expert_bytes * math.prod(domain_counts)
        # (the forward's gather less 2 pre: the backward's gather again, started ahead, beside the pre-expert
        # part's backward)
        regather = max(0.0, allgather - pre) if plan.reshard else 0.0
    else:
        dispatch, combine = exchange_times(levels, ep_counts, rows / K, K, E, row_bytes, plan.dedup, sent,
                                           routing, plan.slots_per_rank)
    # the busiest rank's rows over the mean (expert domains: a rank computes its domain's experts' rows of one rank
    # of each domain, so the domains' shares decide)
    busiest = 1.0 if routing is None else routing.imbalance(plan.ep // math.prod(domain_counts)) \
        if plan.expert_domains else routing.imbalance(plan.ep, plan.slots_per_rank)
    if plan.slots_per_rank:  # replication (adaptive-expert-replication.md's phases, per step): every slot's new
        # weights in (and, counted by the step's backward, its gradient out to the experts' host optimizers), over
        # the group's slowest link (S W_e / b_net) and the hosts' share over PCIe (S W_e / (R b_pcie), R = N S / E
        # instances a class)
        slow = min((j for j, c in enumerate(ep_counts) if c > 1), key=lambda j: levels[j].GBps)
        moved = plan.slots_per_rank * shape.expert_params() * ELEM
        slot = [0.0] * len(levels)
        slot[slow] = moved
        replicas = plan.ep * plan.slots_per_rank / E
        replication = phase("replication", slot) + moved / replicas / (cluster.pcie_GBps * 1e9)
        allgather += replication  # (shown with the layer's gather; once a step, not a micro-batch: below)
        held = plan.slots_per_rank * shape.expert_params() * ELEM
    if plan.shard_copies:  # "dp_shard": the layer's experts gathered from the copies' ranks (their gradients
        # reduce-scattered back in backward), started ahead as expert domains' are, less the pre-expert compute;
        # beside expert domains, before the domain's gather (which takes the gathered copy)
        split = plan.split(N)  # (HSDP: the innermost copies', inside the levels the group leaves)
        counts = tile(copy_counts(cluster, ep_counts, plan.tp if ted else 1), split)  # (None: they do not tile)
        if counts is None:
            return {"invalid": f"copies split over {split} of their {plan.copies(N)} ranks do not tile the levels"}
        slow = min((j for j, c in enumerate(counts) if c > 1), key=lambda j: levels[j].GBps, default=len(levels) - 1)
        piece = [0.0] * len(levels)
        piece[slow] = (split - 1) / split * expert_bytes
        allgather = max(0.0, phase("gather", piece) + domain_ag - pre)
        regather = max(0.0, allgather - pre) if plan.reshard else 0.0
    if plan.tp > 1 and plan.moe_tp != "off":  # SSMB: the output all-gathered; TED: the partial sums reduced
        tp_bytes = [0.0] * (len(levels) - 1) + [(plan.tp - 1) / plan.tp * T * H * ELEM * (2 if ted else 1)]
        combine += phase("tp", tp_bytes)
    inter = I / tp_inter
    flops = 2 * rows * busiest * shape.mats * H * inter
    experts = _roofline(cluster, flops, held + rows * busiest * ELEM * (2 * H + shape.mats * inter))
    # activation checkpointing: backward runs each layer's forward again, and with it (unless their outputs are
    # kept) the layer's collectives but replication's, once a step
    again = plan.recompute == "recompute"
    layer = {"dispatch": dispatch, "experts": experts, "combine": combine, "allgather": allgather,
             "total": dispatch + experts + combine + allgather, "regather": regather,
             "rerun": dispatch + combine + allgather - replication if again else 0.0}
    per_micro, reduce_s, grads_level = _step(shape, cluster, plan, T, seq, layer, pre, expert_bytes)
    per_step = 2 * shape.moe_layers * replication  # replication's weights in, gradients out: once a step
    hop = T * H * ELEM if plan.pp > 1 else 0.0  # a micro-batch's activations to the next stage (its gradient back),
    per_micro += 2 * plan.virtual * whole.levels[0].seconds(hop) - per_step  # from each of the rank's stages
    step = schedule.slots(plan.pp, plan.virtual, micro) * per_micro + per_step + reduce_s
    # per micro-batch: each MoE layer's exchange (its dispatch and combine) twice (forward, backward), its gather once
    # each way (the backward's reduce-scatter; reshard: and the gather again), the tp collective each way, the
    # stages' activations and gradients; per step: replication's phases, the gradient all-reduces
    bytes_per_link = {lv.name: micro * (shape.moe_layers * ((2 + plan.reshard + again) * g + (2 + again) * (x + t))
                                        + 2 * plan.virtual * hop * (j == 0))
                      + 2 * shape.moe_layers * rep + r for j, (lv, x, g, t, rep, r) in enumerate(zip(
                          levels, sent["exchange"], sent["gather"], sent["tp"], sent["replication"], grads_level))}
    # layers' gathered copies at once: kept, every layer's at the end of forward; freed, the running layer's and the
    # next one's, started ahead (so too where checkpointing keeps none: gathered again in the recomputed forward)
    copies = 2 if plan.reshard or again else max(2, shape.moe_layers)
    gathered = copies * (held if plan.shard_copies else held - expert_bytes)  # (a copy's whole experts; its
    # domain's with expert domains)
    # "save": a MoE layer's exchanges' outputs kept, the rows its experts received and those it got back (and the
    # tp collective's output)
    saved = ((1 + busiest) * rows * row_bytes * (math.prod(ep_counts) > 1) + T * H * ELEM * (plan.tp > 1 and
             plan.moe_tp != "off")) if plan.recompute == "save" else 0.0
    memory = _memory(shape, plan, N, T, expert_bytes, tp_rows, tp_inter, 0.0 if plan.slots_per_rank else gathered,
                     busiest, schedule.in_flight(plan.pp, plan.virtual, micro), saved)
    return {**plan.as_dict(), "microbatches": micro, "layer_s": layer, "step_s": step,
            "tokens_per_s": sequences * seq / step, "bytes_per_link": bytes_per_link, "memory_GB": memory,
            "fits": memory["total"] <= cluster.memory_GB}


def link_model(levels, counts) -> tuple[LinkModel, tuple[str, ...]]:
    """The link model (``runtime/comm/cost_model.py``: alpha, beta per collective kind) of an expert-parallel group
    of ``counts`` ranks per level, for every set of its levels a collective may span (levels of one rank left out),
    and those levels' names. A kind's ranks differ in some levels; of the bytes a rank sends to the others, the
    share that first differs at level j (in the group's ranks that differ in those levels) crosses j's link, and
    the links run at once: beta = the largest share x seconds per byte over those levels, alpha = their largest."""
    return _link_model(tuple(levels), tuple(counts))


@functools.lru_cache(maxsize=1024)
def _link_model(levels, counts) -> tuple[LinkModel, tuple[str, ...]]:
    used = [j for j, c in enumerate(counts) if c > 1]
    names = [levels[j].name for j in used]
    params = {}
    for n in range(1, len(used) + 1):
        for dims in itertools.combinations(range(len(used)), n):
            sub = [counts[used[d]] for d in dims]
            share = expected.offrank_shares(sub)
            lv = [levels[used[d]] for d in dims]
            params[kind(names, dims)] = (max(x.alpha_s for x in lv),
                                         max(f / (x.GBps * 1e9) for f, x in zip(share, lv)))
    return LinkModel(params), tuple(names)


def exchange_times(levels, counts, tokens, top_k, num_experts, row_bytes, dedup: str, sent=None, routing=None,
                   slots_per_rank: int = 0) -> tuple[float, float]:
    """(dispatch, combine) seconds of one layer's all-to-alls as the runtime runs them (``expected_messages``:
    the same collectives ``cost_model.messages`` counts on a measured routing; ``routing``: a measured one's
    statistics, ``slots_per_rank``: its rows over replication's instances), priced by ``link_model`` with the
    dedup choice's ``cost_model.price``; ``sent["exchange"]`` gains each level's bytes."""
    if math.prod(counts) == 1:
        return 0.0, 0.0
    link, names = link_model(levels, counts)
    sub = [c for c in counts if c > 1]
    if routing is not None:
        msgs = routing.messages(tokens, top_k, sub, names, row_bytes, slots_per_rank)[dedup]
    else:
        msgs = expected.expected_messages(tokens, top_k, num_experts, sub, names, row_bytes)[dedup]
    if sent is not None:
        by_name = {lv.name: j for j, lv in enumerate(levels)}
        for kind, n in msgs:
            dims = names if kind == "flat" else kind.split("+")
            part = [counts[by_name[d]] for d in dims]
            for d, f in zip(dims, expected.offrank_shares(part)):
                sent["exchange"][by_name[d]] += n * f
    dispatch, combine = expected.split_dispatch_combine(dedup, msgs)
    seconds = price({"dispatch": dispatch, "combine": combine}, link)
    return seconds["dispatch"], seconds["combine"]


def level_seconds(levels, bytes_per_level) -> float:
    """One collective phase: its slowest level's alpha + bytes / bandwidth (the levels' links run at once)."""
    return max(lv.seconds(b) for lv, b in zip(levels, bytes_per_level))


def domain_times(levels, counts, domain_counts, data_bytes: float, expert_bytes: float, pre: float,
                 experts_per_rank: int = 0, offrank: float | None = None) -> tuple[float, float, float]:
    """Expert domains (hybridep.md Eqs. 3-8) of ``domain_counts`` ranks per level in a group of ``counts``:
    (dispatch, combine, the all-gather's seconds left after the ``pre`` seconds of pre-expert compute it overlaps,
    Eq. 7). ``data_bytes``: a rank's rows (D), of which those for other domains' experts cross the exchange group
    (after its per-expert counts; ``offrank``: the busiest rank's share of D it sends or receives there, uniform
    routing's 1 - 1 / domains where None); ``expert_bytes``: its experts (P_E), gathered from the domain's others.
    Priced by ``stream.price``, as ``expert_domains="auto"`` prices a measured routing, on ``link_model``."""
    a2a, back, ag = _domain_times(tuple(levels), tuple(counts), tuple(domain_counts), data_bytes, expert_bytes,
                                  experts_per_rank, offrank)
    return a2a - back, back, max(0.0, ag - pre)


@functools.lru_cache(maxsize=4096)  # (the planner prices each domain's layer for several plans alike)
def _domain_times(levels, counts, domain_counts, data_bytes, expert_bytes, experts_per_rank, offrank):
    used = [j for j, c in enumerate(counts) if c > 1]
    if not used:
        return 0.0, 0.0, 0.0
    link, names = link_model(levels, counts)
    sizes, domains = [counts[j] for j in used], [domain_counts[j] for j in used]
    rows = data_bytes * (1 - math.prod(domains) / math.prod(sizes) if offrank is None else offrank)
    p = stream.price(link, names, sizes, domains, expert_bytes, rows, experts_per_rank)
    back = link.time(kind(names, stream.spanned(hybrid.groups(0, sizes, domains)[1], sizes)), rows) if p.a2a else 0.0
    return p.a2a, back, p.ag


def best_domain(levels, counts, data_bytes: float, expert_bytes: float, pre: float) -> tuple[list[int], float]:
    """The domain sizes per level (dividing ``counts``) of least Eq. 8 time, pre-expert compute plus the
    all-gather it does not hide plus the dispatch and combine of ``data_bytes`` (a GPU's rows, D) with
    ``expert_bytes`` (P_E) per GPU; and that time. What ``evaluate`` prices for each domain plan."""
    best = None
    for sizes in itertools.product(*[[d for d in range(1, c + 1) if c % d == 0] for c in counts]):
        dispatch, combine, allgather = domain_times(levels, counts, sizes, data_bytes, expert_bytes, pre)
        total = pre + allgather + dispatch + combine
        if best is None or total < best[1]:
            best = (list(sizes), total)
    return best


def xmoe_rule(k: int, h_ffn: int, c: float, S: int) -> str:
    """x-moe.md Appendix C: "ssmb" when r = k / H_FFN > 2 / (c S) (SSMB's activation saving, 4 c k S H, beats
    TED's model-state saving, 8 H_FFN H, under ZeRO-1), else "ted"."""
    return "ssmb" if k / h_ffn > 2 / (c * S) else "ted"


def _roofline(cluster: Cluster, flops: float, nbytes: float) -> float:
    return max(flops / (cluster.tflops * 1e12), nbytes / (cluster.hbm_TBps * 1e12))


def _step(shape, cluster, plan, T, seq, layer, pre, expert_bytes) -> tuple[float, float, list[float]]:
    """Seconds of one micro-batch's forward and backward on a data-parallel rank, of the gradient all-reduces once
    a step, and their bytes per level."""
    H = shape.hidden
    dense_mlp = _roofline(cluster, 2 * T * shape.mats * H * shape.dense_intermediate / plan.tp,
                          shape.mats * H * shape.dense_intermediate * ELEM / plan.tp)
    shared = _roofline(cluster, 2 * T * shape.mats * H * shape.shared_intermediate / plan.tp,
                       shape.mats * H * shape.shared_intermediate * ELEM / plan.tp)
    head = _roofline(cluster, 2 * T * shape.vocab * H / plan.tp, shape.vocab * H * ELEM / plan.tp)
    moe = layer["dispatch"] + layer["combine"] + layer["allgather"]
    layers = shape.layers * pre + (shape.layers - shape.moe_layers) * dense_mlp + shape.moe_layers * (
        shared + layer["experts"])  # (forward; backward twice that, and the layers' forward again when recomputed)
    compute = 3 * (layers + head) + layers * (plan.recompute != "off")
    micro = compute + 2 * shape.moe_layers * moe + shape.moe_layers * (layer["regather"] + layer["rerun"])
    reduce_s, grads = 0.0, [0.0] * len(cluster.levels)
    dense_bytes = shape.dense_params() / plan.tp * ELEM
    split = plan.split(cluster.gpus)  # (split copies: their pieces all-reduced over the copies holding the same)
    replicas, expert_bytes = plan.copies(cluster.gpus) // split, expert_bytes / split
    if plan.slots_per_rank:  # replication's copies sum each rank's fp32 master part, 1/ep of every expert
        expert_bytes = shape.num_experts * shape.expert_params() * 4 / plan.ep
    expert_stride = plan.ep * (plan.tp if plan.moe_tp == "ted" else 1) * split
    for nbytes, size, stride, times in ((dense_bytes, plan.dp, plan.tp, 2), (shape.moe_layers * expert_bytes, replicas,
                                                                             expert_stride, 2 + plan.zero1)):
        if size <= 1:
            continue
        counts = group_counts(cluster, size * stride) or list(cluster.counts)
        ring = times * (size - 1) / size * nbytes
        span = [j for j, c in enumerate(counts) if c > 1]
        slowest = min(span, key=lambda j: cluster.levels[j].GBps) if span else len(counts) - 1
        grads[slowest] += ring
        reduce_s += cluster.levels[slowest].seconds(ring)
    return micro, reduce_s, grads


def _memory(shape, plan, N, T, expert_bytes, tp_rows, tp_inter, gathered: float, busiest: float = 1.0,
            in_flight: int = 1, saved: float = 0.0) -> dict:
    """GB per GPU; ``gathered``: other ranks' expert bytes held at once (expert domains: every layer's kept for
    backward, or with reshard two, the running one's and the next one's), with the weights; ``busiest``: the busiest
    rank's routed rows over the mean; ``in_flight``: micro-batches' activations held (``schedule.in_flight``);
    ``saved``: a MoE layer's exchanges' outputs kept by activation checkpointing (``recompute="save"``)."""
    GB = 1e9
    dense = shape.dense_params() / plan.tp
    if plan.slots_per_rank:  # S expert instances a rank; their optimizer on the hosts
        experts, expert_optimizer = shape.moe_layers * plan.slots_per_rank * shape.expert_params(), 0.0
    else:  # whole on each copy kept whole, or under ZeRO-1 (expert_zero_optimizer) its share of whole tensors
        experts = shape.moe_layers * expert_bytes / ELEM
        expert_optimizer = experts * shape.zero_share(plan.copies(N) if plan.zero1 else 1)
        if plan.shard_copies:  # ("dp_shard": the weights and gradients too, their gathered copies apart; HSDP: the
            experts = expert_optimizer = experts / plan.split(N)  # optimizer of the pieces it holds)
    weights = (dense + experts) * ELEM + gathered
    optimizer = ADAM_BYTES * (dense / plan.dp + expert_optimizer)
    H = shape.hidden
    attention = T * H * (4 + 11 / plan.tp)
    mlp = 19 * T * shape.dense_intermediate / 4 / plan.tp
    moe_layer = moe_layer_activations(shape, T * busiest, tp_rows, tp_inter)
    if plan.recompute == "off":
        activations = in_flight * (shape.layers * attention + (shape.layers - shape.moe_layers) * mlp +
                                   shape.moe_layers * moe_layer)
    else:  # each decoder layer's input (and "save": a MoE layer's exchanges' outputs), and in backward the layer
        # recomputed whole (Korthikanti et al.'s full recomputation)
        activations = in_flight * (shape.layers * T * H * ELEM + shape.moe_layers * saved) + attention + max(
            moe_layer, mlp if shape.layers > shape.moe_layers else 0.0)
    out = {"weights": weights / GB, "grads": (weights - gathered) / GB, "optimizer": optimizer / GB,
           "activations": activations / GB, "moe_layer_activations": moe_layer / GB}
    out["total"] = out["weights"] + out["grads"] + out["optimizer"] + out["activations"]
    return out
