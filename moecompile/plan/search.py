"""Every plan for a model on a cluster, priced by ``cost.py``, ranked by the time of a step of the same global batch
among those that fit. Considered: pipeline stages (``pp``, a power of two dividing the outermost level), and in one
stage's GPUs tensor-parallel sizes 1, 2, 4, 8 that divide the innermost level; every power-of-two expert-parallel
degree dividing the experts and the GPUs (under TED: the data-parallel ranks); for each, dedup off and at every level
its group spans with a level below it, ``moe_tp`` "ssmb", "ted" and "off" where tp > 1, expert domains of every size
its group allows per level (their copies kept for backward, or gathered again there; the group's copies split too),
and where the group has copies (tp 1, or SSMB) those split over their ranks ("dp_shard", or HSDP: gathered, kept or
again) or kept whole, their optimizer state whole on each or over them (ZeRO-1:
``moecompile.expert_zero_optimizer``); and replication over a group of every power-of-two size (every rank holds S
slots, each an instance of some expert: S the least that holds every expert once in the group, and twice that; copies
of the group over the rest). Dedup and replication are not combined with TED (``parallelize`` refuses them). Each
plan also with every decoder layer activation-checkpointed, its MoE collectives run again in backward or their
outputs kept (``recompute``; not beside gathers made again in backward, which recomputation makes already). With
pipeline stages, each rank holding one stage (1F1B) or two (interleaved).
"""

from __future__ import annotations

import dataclasses
import itertools
import math

from moecompile.runtime.comm import expected

from .cluster import Cluster
from .cost import Plan, copy_counts, evaluate, group_counts, stage_cluster, tile, xmoe_rule
from .run import how_to_run
from .shapes import MoEShape


VIRTUAL = (1, 2)  # stages a rank holds under pipeline stages (2: torch's ScheduleInterleaved1F1B; 4 not priced)


def candidates(shape: MoEShape, cluster: Cluster) -> list[Plan]:
    """Every plan: for each number of pipeline stages (a power of two dividing the outermost level, at most the
    layers; each rank holding 1 or 2 of pp x that many, at most the layers), the plans of one stage's GPUs."""
    out = []
    for pp in (1 << i for i in range(int(math.log2(cluster.counts[0])) + 1)):
        stage = stage_cluster(cluster, pp)
        if stage is not None and pp <= shape.layers:  # (and each rank holding several stages, interleaved)
            out += [dataclasses.replace(p, pp=pp, virtual=v) for v in VIRTUAL if v == 1 or 1 < pp and pp * v <=
                    shape.layers for p in _stage_candidates(shape, stage)]
    return out


def _stage_candidates(shape: MoEShape, cluster: Cluster) -> list[Plan]:
    N, inner = cluster.gpus, cluster.counts[-1]
    names = [lv.name for lv in cluster.levels]
    out = []
    for tp in (t for t in (1, 2, 4, 8) if inner % t == 0 and t <= inner):
        dp = N // tp
        for moe_tp in (("off",) if tp == 1 else ("ssmb", "ted", "off")):
            limit = dp if moe_tp == "ted" else N
            for ep in (1 << i for i in range(int(math.log2(limit)) + 1)):
                if shape.num_experts % ep or limit % ep:
                    continue
                counts = group_counts(cluster, ep, tp if moe_tp == "ted" else 1)
                if counts is None:
                    continue
                out.append(Plan(ep, tp, dp, moe_tp))
                copies = out[-1].copies(N)  # (TED's group: one tp index)
                per_level = copy_counts(cluster, counts, tp if moe_tp == "ted" else 1)  # (the copies' ranks)
                if copies > 1 and (tp == 1 or moe_tp != "off"):  # the copies split ("dp_shard"; over some, HSDP),
                    # their gathers kept or made again (tp's ranks inside the group under SSMB; TED: each tp slice)
                    for split in (d for d in range(2, copies + 1) if copies % d == 0):
                        over = 0 if split == copies else split
                        if tile(per_level, split) is not None:
                            out += [Plan(ep, tp, dp, moe_tp, shard_copies=True, shard_over=over, reshard=r)
                                    for r in (False, True)]
                if moe_tp == "ted":
                    continue
                for j, name in enumerate(names[:-1]):
                    if counts[j] > 1 and math.prod(counts[j + 1:]) > 1:
                        out.append(Plan(ep, tp, dp, moe_tp, dedup=name))
                split = copies > 1 and tile(per_level, copies) is not None
                for sizes in itertools.product(*[[d for d in range(1, c + 1) if c % d == 0] for c in counts]):
                    if math.prod(sizes) > 1:  # the gathered copies kept for backward, or gathered again there;
                        # and with the copies split over their ranks, gathered first
                        domains = tuple((n, s) for n, s in zip(names, sizes) if s > 1)
                        out += [Plan(ep, tp, dp, moe_tp, expert_domains=domains, reshard=r, shard_copies=c)
                                for r in (False, True) for c in (False, True)[:1 + split]]

            for ep in (1 << i for i in range(1, int(math.log2(N)) + 1)) if moe_tp != "ted" else ():
                # replication: S slots on every rank of a group of ep (each a class's instance), copies of the
                # group over the rest; any ep (a group of fewer ranks than experts holds several a rank)
                if N % ep or group_counts(cluster, ep, 1) is None:
                    continue
                least = max(1, -(-shape.num_experts // ep))  # at least one instance a class
                out += [Plan(ep, tp, dp, moe_tp, slots_per_rank=s) for s in (least, 2 * least)]
    # and each with copies kept whole once more, its experts' optimizer state over the copies (ZeRO-1)
    out += [dataclasses.replace(p, zero1=True) for p in out
            if not (p.shard_copies or p.slots_per_rank) and p.copies(N) > 1]
    # and each with its decoder layers recomputed in backward, the collectives again or their outputs kept (where it
    # has any)
    return out + [dataclasses.replace(p, recompute=r) for p in out if not p.reshard for r in ("recompute", "save")
                  if r == "recompute" or p.ep > 1 or p.moe_tp != "off" or p.shard_copies]


def duplication(shape: MoEShape, cluster: Cluster, routing=None) -> dict[str, float]:
    """At each level but the innermost: hiermoe.md Table II's duplication rate, the experts spread over every
    GPU (groups of that level: the product of the counts down to it, at most E); of ``routing`` where given."""
    out = {}
    for j, level in enumerate(cluster.levels[:-1]):
        groups = min(math.prod(cluster.counts[:j + 1]), shape.num_experts)
        if shape.num_experts % groups == 0:
            out[level.name] = expected.duplication_rate(shape.num_experts, shape.top_k, groups) if routing is None \
                else routing.duplication_rate(groups)
    return out


def plan(shape: MoEShape, cluster: Cluster, seq: int, micro_batch: int = 1, routing=None,
         global_batch: int | None = None) -> dict:
    """plan.json's object: ``model``, ``moe_tp_rule`` (x-moe.md App. C at this sequence length, dropless: c = 1),
    ``routing`` (None: uniform; a measured ``routing.Routing``: its layers and tokens), ``duplication``, ``plans``
    (each with ``run``: the mesh and ``parallelize`` options that run it, ``run.py``; ranked: fitting ones by step
    time first, then
    the rest by their memory), ``chosen`` (0 where the first fits, else None) and ``shortfall_GB`` (the least
    memory over the GPU's of any plan, where none fits)."""
    if seq < 1 or micro_batch < 1:
        raise ValueError(f"--seq and --micro-batch must be >= 1, got {seq} and {micro_batch}")
    global_batch = global_batch or cluster.gpus * micro_batch  # (one micro-batch a GPU)
    if global_batch < 1:
        raise ValueError(f"--global-batch must be >= 1 sequences, got {global_batch}")
    if routing is not None and routing.top_k != shape.top_k:
        raise ValueError(f"the routing file's tokens chose {routing.top_k} experts each; the config's top-k is "
                         f"{shape.top_k}: record the routing on the model the config describes")
    plans = []
    for candidate in candidates(shape, cluster):
        priced = evaluate(shape, cluster, candidate, seq, micro_batch, routing, global_batch)
        if "invalid" not in priced:
            run = how_to_run(candidate, cluster)
            if candidate.pp > 1 and "not_runnable" not in run:  # (torch's schedule of the micro-batches priced;
                # its 1F1B refuses fewer than the stages, where GPipe's takes the same slots and memory)
                M = priced["microbatches"]
                run["schedule"] = {"class": "ScheduleInterleaved1F1B" if candidate.virtual > 1 else "Schedule1F1B"
                                   if M >= candidate.pp else "ScheduleGPipe", "n_microbatches": M}
            plans.append({**priced, "run": run})
    if not plans:
        raise ValueError(f"no expert-parallel degree of {shape.num_experts} experts tiles {cluster.gpus} GPUs "
                         f"laid out as {cluster.counts} with a global batch of {global_batch} sequences in "
                         f"micro-batches of {micro_batch}: give a global batch that a data-parallel degree divides")
    plans.sort(key=lambda p: (not p["fits"], p["step_s"] if p["fits"] else p["memory_GB"]["total"]))
    fits = plans[0]["fits"]
    rule = {"r": shape.top_k / shape.intermediate, "bound": 2 / seq,
            "choice": xmoe_rule(shape.top_k, shape.intermediate, 1.0, seq)}
    out = {"model": shape.as_dict(), "moe_tp_rule": rule, "cluster": {"gpu": cluster.gpu_name, "gpus": cluster.gpus,
                                                  "levels": [lv.name for lv in cluster.levels]},
           "seq": seq, "micro_batch": micro_batch, "global_batch": global_batch,
           "duplication": duplication(shape, cluster, routing),
           "routing": None if routing is None else routing.summary(), "plans": plans,
           "chosen": 0 if fits else None}
    if not fits:
        out["shortfall_GB"] = plans[0]["memory_GB"]["total"] - cluster.memory_GB
    return out
