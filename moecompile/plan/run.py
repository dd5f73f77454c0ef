"""How to run a plan with ``moecompile.parallelize``: the ``DeviceMesh`` that lays the ranks out as the planner
priced them, and the options, or why it cannot run yet.

The planner's layout: ranks innermost first over the cluster's levels; tensor parallelism the innermost ``tp``
ranks; the expert-parallel group ``ep`` consecutive ranks (``moe_tp`` "off" and "ssmb": the tp ranks included) or
the ranks of one tp index (TED), repeated over the rest. As a mesh: an outermost ``"dp_replicate"`` dimension for
the copies of the group (``N / ep``; none where ep spans every rank; ``"dp_shard"`` where they split the experts),
then the group's levels of more than one
rank, innermost ``"local"`` and outward ``"node"``, ``"rack"``, ``"pod"`` (the names ``parallelize`` knows; a
single level keeps the cluster's name), then ``"tp"``; pipeline stages: ``"pp"`` before all, each stage's ranks
laid out so (``moecompile.pipeline_stage`` cuts the model, each stage module parallelized on the mesh). A ``zero1``
plan's experts step under ``moecompile.expert_zero_optimizer`` (``run["expert_optimizer"]``). A ``recompute`` plan
checkpoints every decoder layer (``run["activation_checkpointing"]``: transformers'
``model.activation_checkpointing_enable()``), with ``"save"`` compiled with ``checkpoint_exchanges="save"``
(``run["compile_options"]``). Several stages a rank (``virtual``): ``run["virtual_stages"]``, the model cut into
``pp x virtual`` stages, rank r's r, r + pp, ... (``ScheduleInterleaved1F1B``'s order).
"""

from __future__ import annotations

import dataclasses

from moecompile.runtime.comm.levels import LEVELS

from .cluster import Cluster
from .cost import Plan, group_counts, stage_cluster


def how_to_run(plan: Plan, cluster: Cluster) -> dict:
    """``{"mesh_shape": [...], "mesh_dim_names": [...], "options": {...}}`` (``parallelize``'s keyword arguments),
    or ``{"not_runnable": why}``. Pipeline stages: an outermost ``"pp"`` dimension, each stage's mesh after it."""
    if plan.pp > 1:
        run = how_to_run(dataclasses.replace(plan, pp=1, virtual=1), stage_cluster(cluster, plan.pp))
        return run if "not_runnable" in run else {**run, "mesh_shape": [plan.pp, *run["mesh_shape"]],
                                                  "mesh_dim_names": ["pp", *run["mesh_dim_names"]],
                                                  **({"virtual_stages": plan.virtual} if plan.virtual > 1 else {})}
    N, tp, ted = cluster.gpus, plan.tp, plan.moe_tp == "ted"
    copies = plan.copies(N)
    if plan.expert_domains and tp > 1:
        return {"not_runnable": "expert domains beside tensor parallelism are not built"}
    if plan.ep == 1 and tp == 1:
        return {"not_runnable": "ep 1 shards no expert: train the model data-parallel as it is"}
    if not ted and plan.ep % tp:
        return {"not_runnable": f"an expert-parallel group of {plan.ep} ranks inside a tp group of {tp}: "
                                "parallelize puts the tp ranks in the group"}
    counts = group_counts(cluster, plan.ep, tp if ted else 1)
    counts[-1] //= 1 if ted else tp  # the group's ranks over the levels, tp's left out
    used = [(lv.name, c) for lv, c in zip(cluster.levels, counts) if c > 1]
    if len(used) > len(LEVELS):
        return {"not_runnable": f"{len(used)} levels: parallelize names at most {len(LEVELS)} ({LEVELS})"}
    rename = {name: name if len(used) == 1 else LEVELS[len(LEVELS) - len(used) + i]
              for i, (name, _) in enumerate(used)}
    if plan.dedup != "off" and plan.dedup not in rename:
        return {"not_runnable": f"dedup at {plan.dedup!r}, a level the expert-parallel group does not span"}
    if plan.zero1 and (copies == 1 or plan.shard_copies or plan.slots_per_rank):
        return {"not_runnable": "ZeRO-1 of the experts needs copies of a group kept whole, without replication"}
    if plan.shard_copies and (copies == 1 or plan.slots_per_rank):
        return {"not_runnable": "split copies need copies of a group; beside replication the planner does not price "
                "them (parallelize runs both)"}
    split = plan.split(N)
    if copies % split:
        return {"not_runnable": f"copies split over {split} ranks: {split} does not divide the {copies} copies"}
    outer = [("dp_replicate", copies // split)] * (copies > split) + [("dp_shard", split)] * (split > 1)
    dims = outer + [(rename[n], c) for n, c in used] + ([("tp", tp)] if tp > 1 else [])
    options = {}
    if tp > 1:
        options["moe_tp"] = plan.moe_tp
    if plan.dedup != "off":
        options["dedup"] = rename[plan.dedup]
    if plan.expert_domains:
        options["expert_domains"] = {rename[n]: s for n, s in plan.expert_domains}
    if plan.reshard:
        options["reshard_after_forward"] = True
    if plan.slots_per_rank:
        options.update(replication="adaptive", slots_per_rank=plan.slots_per_rank)
    run = {"mesh_shape": [c for _, c in dims], "mesh_dim_names": [n for n, _ in dims], "options": options}
    if plan.recompute != "off":
        run["activation_checkpointing"] = True
    if plan.recompute == "save":
        run["compile_options"] = {"checkpoint_exchanges": "save"}
    return {**run, "expert_optimizer": "moecompile.expert_zero_optimizer"} if plan.zero1 else run


def code(run: dict, device: str = "cuda") -> str:
    """The lines of Python ``run`` (``how_to_run``'s) stands for: the mesh, ``parallelize``, and with
    ``expert_optimizer`` the experts' optimizer; with ``activation_checkpointing`` transformers' checkpointing of the
    decoder layers first, with ``compile_options`` the ``torch.compile`` call; under pipeline stages, with
    ``schedule`` (``search.plan``'s), the stages' ``moecompile.PipelineStage`` and torch's schedule."""
    if "not_runnable" in run:
        return f"not runnable with moecompile yet: {run['not_runnable']}"
    args = "".join(f", {k}={v!r}" for k, v in run["options"].items())
    mesh = (f"mesh = init_device_mesh({device!r}, {tuple(run['mesh_shape'])}, "
            f"mesh_dim_names={tuple(run['mesh_dim_names'])}); ")
    if run.get("activation_checkpointing"):
        mesh = "model.activation_checkpointing_enable(); " + mesh
    options = f", options={run['compile_options']!r}" if run.get("compile_options") else ""

    def zero(held: str) -> str:  # (ZeRO-1 of the experts over "dp_replicate")
        return f"; experts_opt = moecompile.expert_zero_optimizer({held}, torch.optim.AdamW)" if run.get(
            "expert_optimizer") else ""

    if run["mesh_dim_names"][0] != "pp":
        return (mesh + f"moecompile.parallelize(model, mesh, example_ids{args})" + zero("model")
                + (f"; compiled = torch.compile(model, backend='moe'{options})" if options else ""))
    virtual, pp = run.get("virtual_stages", 1), run["mesh_shape"][0]  # (docs/expert-parallelism.md, Pipeline stages)
    schedule = run.get("schedule")

    def stage(module: str, index: str) -> str:
        return (f"moecompile.PipelineStage(torch.compile({module}, backend='moe'{options}), {index}, {pp * virtual}, "
                "device, group=mesh.get_group('pp'))")

    if virtual > 1:  # (rank r's stages r, r + pp, ...: torch's ScheduleInterleaved1F1B's order)
        out = (mesh + f"stages = [moecompile.parallelize(moecompile.pipeline_stage(model, mesh.get_local_rank('pp') + "
               f"{pp} * i, {pp * virtual}), mesh, example_stage_input[i]{args}) for i in range({virtual})]"
               + zero("stages"))
        runs = "[" + stage("s", f"mesh.get_local_rank('pp') + {pp} * i") + " for i, s in enumerate(stages)]"
    else:
        out = (mesh + f"stage = moecompile.pipeline_stage(model, mesh.get_local_rank('pp'), {pp}); "
               f"moecompile.parallelize(stage, mesh, example_stage_input{args})" + zero("stage"))
        runs = stage("stage", "mesh.get_local_rank('pp')")
    if schedule:
        out += f"; schedule = {schedule['class']}({runs}, n_microbatches={schedule['n_microbatches']}, loss_fn=loss_fn)"
    return out
