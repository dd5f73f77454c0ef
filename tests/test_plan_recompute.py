"""The planner's plans that recompute their layers (``moecompile/plan/cost.py``, ``recompute``): every decoder layer
activation-checkpointed, as transformers' ``model.activation_checkpointing_enable()`` does and the backend keeps
(``tests/test_checkpointing.py``), its MoE collectives run again in backward (``checkpoint_exchanges="recompute"``)
or their outputs kept for it (``"save"``): memory, the step's compute and exchanges, the bytes per link, the plans
considered and the run that sets it up."""

import dataclasses
import os

import pytest

from moecompile.plan import read_cluster, read_config
from moecompile.plan.cli import describe
from moecompile.plan.cost import Plan, evaluate
from moecompile.plan.run import code, how_to_run
from moecompile.plan.search import candidates, plan

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = os.path.join(ROOT, "models", "configs")
GB, T = 1e9, 4096


def _cluster():
    return read_cluster({"gpu": {"name": "H100", "bf16_tflops": 800, "hbm_TBps": 3.35, "memory_GB": 80},
                         "levels": [{"name": "node", "count": 4, "alpha_s": 1e-5, "GBps": 25},
                                    {"name": "local", "count": 8, "alpha_s": 3e-6, "GBps": 450}]})


def _three(shape, base):
    return [evaluate(shape, _cluster(), dataclasses.replace(base, recompute=r), T, 1, global_batch=64)
            for r in ("off", "recompute", "save")]


def test_recomputed_layers_keep_their_inputs_and_run_their_forward_again():
    """Full recomputation (Korthikanti et al.): a GPU keeps each decoder layer's input (T H bf16 values) and, in
    backward, one layer's activations again, where it kept every layer's; "save" keeps too each MoE layer's
    exchanged rows (those its experts received and those it got back: 2 K T H values under uniform routing, the
    "about 2 K x the layer's input" of checkpoint_exchanges="save"; under SSMB the tp gather's output besides). The
    step runs the layers' forward once more; "recompute" also each MoE layer's exchanges once more a micro-batch (a
    third time each way: their bytes 3/2 of the plan's), "save" none."""
    shape = read_config(os.path.join(CONFIGS, "qwen3_30b_a3b.json"))  # (48 layers, all MoE)
    H, K, L = shape.hidden, shape.top_k, shape.moe_layers
    off, again, kept = _three(shape, Plan(8, 1, 32))  # (ep 8: one node's GPUs, its exchanges over "local" only)
    moe = off["memory_GB"]["moe_layer_activations"] * GB
    assert again["memory_GB"]["activations"] == pytest.approx((L * T * H * 2 + T * H * (4 + 11) + moe) / GB)
    assert off["memory_GB"]["activations"] > 10 * again["memory_GB"]["activations"]
    assert kept["memory_GB"]["activations"] - again["memory_GB"]["activations"] == pytest.approx(
        L * 2 * K * T * H * 2 / GB)
    for p in (again, kept):  # the weights, gradients and optimizer state as they were
        assert all(p["memory_GB"][k] == off["memory_GB"][k] for k in ("weights", "grads", "optimizer"))
    M = off["microbatches"]
    layer = again["layer_s"]
    assert layer["rerun"] == layer["dispatch"] + layer["combine"] > 0 == kept["layer_s"]["rerun"]
    assert again["step_s"] - kept["step_s"] == pytest.approx(M * L * layer["rerun"], rel=1e-9)
    forward = (kept["step_s"] - off["step_s"]) / M  # the layers' forward compute, once more a micro-batch
    assert 0 < forward < (off["step_s"] / M - 2 * L * layer["rerun"]) / 3
    assert kept["bytes_per_link"] == off["bytes_per_link"]
    assert again["bytes_per_link"]["local"] == pytest.approx(1.5 * off["bytes_per_link"]["local"])
    ssmb = _three(shape, Plan(8, 2, 16, "ssmb"))  # (the rows over tp: T / 2 a rank; its output gathered, T H)
    assert ssmb[2]["memory_GB"]["activations"] - ssmb[1]["memory_GB"]["activations"] == pytest.approx(
        L * (2 * K * T / 2 * H * 2 + T * H * 2) / GB)


def test_recomputed_layers_gather_their_experts_again():
    """Expert domains and split copies: the gathered copies are kept by no checkpoint, so the recomputed forward
    gathers them again (two layers' at once, as gathering again in backward does), where "save" keeps every layer's
    (the gathers are among the exchanges it keeps). Gathering again in backward is not priced beside recomputation,
    which gathers again already."""
    shape = read_config(os.path.join(CONFIGS, "qwen3_30b_a3b.json"))
    L = shape.moe_layers
    for base in (Plan(32, 1, 32, expert_domains=(("node", 2),)),  # (gathering a domain's other rank's experts)
                 Plan(8, 1, 32, shard_copies=True)):  # (the copy's whole, its pieces gathered over "node")
        others = shape.num_experts // base.ep * shape.expert_params() * 2  # a rank's experts of a layer, bf16 bytes
        off, again, kept = _three(shape, base)
        held = {name: p["memory_GB"]["weights"] - p["memory_GB"]["grads"] for name, p in
                (("off", off), ("again", again), ("kept", kept))}
        assert held["off"] == pytest.approx(L * others / GB), base  # (every layer's kept for backward)
        assert held["again"] == pytest.approx(2 * others / GB) and held["kept"] == pytest.approx(held["off"]), base
        layer = again["layer_s"]
        assert layer["allgather"] > 0 and layer["rerun"] == pytest.approx(
            layer["dispatch"] + layer["combine"] + layer["allgather"]), base
        assert again["step_s"] - kept["step_s"] == pytest.approx(off["microbatches"] * L * layer["rerun"], rel=1e-9)
        assert sum(again["bytes_per_link"].values()) > sum(kept["bytes_per_link"].values())
    considered = candidates(shape, _cluster())
    assert not any(p.recompute != "off" and p.reshard for p in considered)
    plain = {dataclasses.replace(p, recompute="off") for p in considered if p.recompute != "off"}
    assert plain == {p for p in considered if p.recompute == "off" and not p.reshard}
    # "save" where a layer has collectives to keep: not with ep 1 and the experts whole on each rank
    assert not any(p.recompute == "save" and p.ep == 1 and p.moe_tp == "off" and not p.shard_copies
                   for p in considered)


def test_a_recomputing_plan_says_how_to_run_it():
    """run: ``activation_checkpointing`` (transformers' ``model.activation_checkpointing_enable()``, before the
    model is cut into stages and parallelized) and, with "save", the compile options; the printed lines say so."""
    cluster = _cluster()
    plain = how_to_run(Plan(8, 1, 32), cluster)
    again = how_to_run(Plan(8, 1, 32, recompute="recompute"), cluster)
    kept = how_to_run(Plan(8, 1, 32, recompute="save"), cluster)
    assert again == {**plain, "activation_checkpointing": True}
    assert kept == {**again, "compile_options": {"checkpoint_exchanges": "save"}}
    assert code(again).startswith("model.activation_checkpointing_enable(); mesh = init_device_mesh(")
    assert code(kept).endswith("; compiled = torch.compile(model, backend='moe', "
                               "options={'checkpoint_exchanges': 'save'})")
    staged = code({**how_to_run(Plan(8, 1, 8, recompute="save", pp=4), cluster),
                   "schedule": {"class": "Schedule1F1B", "n_microbatches": 8}})
    assert staged.startswith("model.activation_checkpointing_enable(); mesh = ") and "stage = moecompile" in staged
    assert "PipelineStage(torch.compile(stage, backend='moe', options={'checkpoint_exchanges': 'save'})" in staged
    assert describe({**evaluate(read_config(os.path.join(CONFIGS, "qwen3_30b_a3b.json")), cluster,
                                Plan(8, 1, 32, recompute="save"), T, 1)}).endswith("recompute save")


def test_deepseek_v3_at_16k_tokens_fits_only_by_recomputing():
    """DeepSeek-V3 on 128 x 8 H100s at 16384 tokens a sequence: without recomputation no plan fits (the least
    needs about 87 GB, as the planner said before it priced recomputation); with it the chosen plan fits."""
    shape = read_config(os.path.join(CONFIGS, "deepseek_v3.json"))
    result = plan(shape, read_cluster(os.path.join(ROOT, "models", "clusters", "h100_128x8.json")), 16384)
    chosen = result["plans"][result["chosen"]]
    assert chosen["fits"] and chosen["recompute"] != "off" and chosen["run"]["activation_checkpointing"] is True
    assert not any(p["fits"] for p in result["plans"] if p["recompute"] == "off")
