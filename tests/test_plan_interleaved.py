"""The planner's interleaved pipeline plans (``moecompile/plan/schedule.py``): each rank holding ``virtual`` of
``pp x virtual`` stages, run by torch's ``ScheduleInterleaved1F1B`` (``tests/test_pipeline.py`` trains one): the
busiest rank's layers as ``pipeline_stage`` cuts them, the bubble a ``virtual``-th of 1F1B's, the stage hops
``virtual`` times as many, the first rank's activations of torch's warm-up forwards, the micro-batch counts torch
refuses, and the run that cuts and parallelizes the rank's stages."""

import os

import pytest
from torch.distributed.pipelining.schedules import _get_warmup_ops

import moecompile
from moecompile.models.hf import tiny_model
from moecompile.plan import read_cluster, read_config
from moecompile.plan.cli import describe
from moecompile.plan.cost import Plan, evaluate
from moecompile.plan.run import code, how_to_run
from moecompile.plan.schedule import in_flight, runs, stage_shape
from moecompile.plan.search import candidates, plan

CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "models", "configs")
CLUSTER = {"gpu": {"name": "H100", "bf16_tflops": 800, "hbm_TBps": 3.35, "memory_GB": 80},
           "levels": [{"name": "node", "count": 4, "alpha_s": 1e-5, "GBps": 25},
                      {"name": "local", "count": 8, "alpha_s": 3e-6, "GBps": 450}]}


def test_the_busiest_rank_holds_the_layers_pipeline_stage_gives_it():
    """A model of 7 layers cut into 4 stages, 2 a rank (stages r and r + 2): rank 0 holds 4 layers, rank 1 3, as
    moecompile.pipeline_stage cuts it, as many as with 2 stages of one a rank: the planner prices ceil(L / pp)
    either way."""
    model = tiny_model("mixtral", num_hidden_layers=7)
    held = [sum(len(moecompile.pipeline_stage(model, r + 2 * i, 4).stage_layers) for i in range(2)) for r in range(2)]
    assert held == [4, 3]
    assert [len(moecompile.pipeline_stage(model, r, 2).stage_layers) for r in range(2)] == [4, 3]
    assert stage_shape(read_config(model.config.to_dict()), 2).layers == 4


def _per_micro_and_reduce(shape, cluster, p, pp, batches):
    """A plan's time per micro-batch slot and its once-a-step part, from its steps at two global batches."""
    (m1, s1), (m2, s2) = ((r["microbatches"], r["step_s"]) for r in
                          (evaluate(shape, cluster, p, 4096, 1, global_batch=b) for b in batches))
    slot = (s2 - s1) / (m2 - m1)
    return slot, s1 - (m1 + (pp - 1) / p.virtual) * slot


def test_interleaving_shrinks_the_bubble_and_sends_each_micro_batch_more_often():
    """Qwen3-30B-A3B's 48 layers in 4 stages, or 8 two a rank (each rank the same 12 layers): a step is M + (pp - 1)
    / virtual slots (1F1B: M + pp - 1), each slot one micro-batch's forward and backward on the rank and its stage
    hops, 2 x virtual activations (T H bf16) over the outermost level; the gradients' all-reduce once a step alike.
    The first rank holds torch's warm-up forwards and one more, over virtual, of its layers' activations (1F1B:
    min(pp, M))."""
    cluster, shape = read_cluster(CLUSTER), read_config(os.path.join(CONFIGS, "qwen3_30b_a3b.json"))
    one, two = Plan(8, 1, 8, pp=4), Plan(8, 1, 8, pp=4, virtual=2)
    slot1, reduce1 = _per_micro_and_reduce(shape, cluster, one, 4, (64, 128))
    slot2, reduce2 = _per_micro_and_reduce(shape, cluster, two, 4, (64, 128))
    hop = cluster.levels[0].seconds(4096 * shape.hidden * 2)
    assert slot2 - slot1 == pytest.approx(2 * hop, rel=1e-9) and reduce2 == pytest.approx(reduce1, rel=1e-9)
    assert reduce1 > 0
    for M in (8, 16, 12):
        a, b = (evaluate(shape, cluster, p, 4096, 1, global_batch=8 * M) for p in (one, two))
        assert a["microbatches"] == b["microbatches"] == M
        per_round = M // max(1, M // 4)
        warm = _get_warmup_ops(0, 2, per_round, 4, M) + 1  # torch's first rank: forwards before its first backward
        assert in_flight(4, 2, M) == warm / 2 and in_flight(4, 1, M) == min(4, M)
        assert b["memory_GB"]["activations"] == pytest.approx(a["memory_GB"]["activations"] * warm / 2 / min(4, M))
        assert b["bytes_per_link"]["node"] - a["bytes_per_link"]["node"] == pytest.approx(M * 2 * 4096 * shape.hidden
                                                                                          * 2)


def test_micro_batch_counts_torch_refuses_and_the_run():
    """torch's interleaved schedule runs M micro-batches in max(1, M // pp) rounds, which must divide M (its
    docstring: pp 4 runs 10 and 3); a plan that would not is not priced. The run cuts pp x virtual stages, rank r
    parallelizing r, r + pp, ...; ZeRO-1 of the experts, one optimizer over the list of the rank's stages; torch's
    schedule of the micro-batches priced (GPipe's where fewer than the stages: torch's 1F1B refuses them)."""
    assert runs(4, 2, 10) is None and runs(4, 2, 3) is None and runs(4, 1, 9) is None
    assert "do not divide" in runs(4, 2, 9)
    cluster, shape = read_cluster(CLUSTER), read_config(os.path.join(CONFIGS, "qwen3_30b_a3b.json"))
    assert "invalid" in evaluate(shape, cluster, Plan(8, 1, 8, pp=4, virtual=2), 4096, 1, global_batch=72)
    run = how_to_run(Plan(8, 1, 8, pp=4, virtual=2), cluster)
    assert run == {"mesh_shape": [4, 8], "mesh_dim_names": ["pp", "local"], "options": {}, "virtual_stages": 2}
    assert code(run).endswith("stages = [moecompile.parallelize(moecompile.pipeline_stage(model, "
                              "mesh.get_local_rank('pp') + 4 * i, 8), mesh, example_stage_input[i]) for i in range(2)]")
    zero = code(how_to_run(Plan(4, 1, 8, pp=4, virtual=2, zero1=True), cluster))  # (2 copies of each expert)
    assert zero.endswith("; experts_opt = moecompile.expert_zero_optimizer(stages, torch.optim.AdamW)"), zero
    assert describe(evaluate(shape, cluster, Plan(8, 1, 8, pp=4, virtual=2), 4096, 1)).startswith("pp 4x2 ep 8")
    plans = candidates(shape, cluster)
    assert {p.virtual for p in plans if p.pp > 1} == {1, 2} and {p.virtual for p in plans if p.pp == 1} == {1}
    two = next(p for p in plan(shape, cluster, 4096)["plans"] if p["virtual_stages"] == 2 and "not_runnable" not in
               p["run"])  # (the micro-batches priced, under torch's interleaved schedule of the rank's stages)
    assert two["run"]["schedule"] == {"class": "ScheduleInterleaved1F1B", "n_microbatches": two["microbatches"]}
    few = [p for p in plan(shape, cluster, 4096, global_batch=16)["plans"] if p["pp"] > p["microbatches"]
           and p["virtual_stages"] == 1 and "not_runnable" not in p["run"]]  # (torch's 1F1B refuses M < pp)
    assert few and all(p["run"]["schedule"]["class"] == "ScheduleGPipe" for p in few)
    assert f"ScheduleInterleaved1F1B([moecompile.PipelineStage(torch.compile(s, backend='moe'), mesh.get_local_rank(" \
           f"'pp') + {two['pp']} * i, {2 * two['pp']}, device, group=mesh.get_group('pp')) for i, s in enumerate(" \
           f"stages)], n_microbatches={two['microbatches']}" in code(two["run"])
