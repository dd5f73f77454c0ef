"""The planner's plans that gather experts (``moecompile/plan/cost.py``): expert domains and copies of the
expert-parallel group split over their ranks (``"dp_shard"``), each priced with its gathered weights kept for
backward or gathered again there: memory, the step's gathers and the bytes per link, and the run that lays it out;
and the copies kept whole with ZeRO-1 of their optimizer state (``zero1``)."""

import dataclasses
import math
import os

import pytest

from moecompile.plan import read_cluster, read_config
from moecompile.plan.cost import Plan, evaluate, stage_shape
from moecompile.plan.run import code, how_to_run
from moecompile.plan.search import plan

CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "models", "configs")


def test_split_copies_priced_with_their_pieces_and_gathers():
    """Copies of the expert-parallel group split over their ranks ("dp_shard", R = N / ep of them): a rank holds 1/R
    of its group's expert weights and gradients, and the copy gathered whole for the layers that hold it at once
    (every MoE layer's kept for backward, or two: gathered again there); each micro-batch gathers (R - 1) / R of them
    over the slowest level the copies span and reduce-scatters their gradients back, where the copies kept whole
    all-reduce the gradients once a step: the same bytes at one micro-batch a step, one more gather a layer gathering
    again; Adam's state: 1/R of a whole copy's; run names the dimension "dp_shard"; SSMB's copies split too."""
    cluster = read_cluster({"gpu": {"name": "H100", "bf16_tflops": 800, "hbm_TBps": 3.35, "memory_GB": 80},
                            "levels": [{"name": "node", "count": 4, "alpha_s": 1e-5, "GBps": 25},
                                       {"name": "local", "count": 8, "alpha_s": 3e-6, "GBps": 450}]})
    shape = read_config(os.path.join(CONFIGS, "qwen3_30b_a3b.json"))
    whole, kept, again = (evaluate(shape, cluster, Plan(8, 1, 32, shard_copies=split, reshard=r), 4096, 1)
                          for split, r in ((False, False), (True, False), (True, True)))
    R, L, GB = 4, shape.moe_layers, 1e9
    eb = shape.num_experts // 8 * shape.expert_params() * 2  # a rank's group share of the experts, bf16
    for split, gathered in ((kept, L * eb), (again, 2 * eb)):
        assert whole["memory_GB"]["grads"] - split["memory_GB"]["grads"] == pytest.approx(L * eb * (1 - 1 / R) / GB)
        assert split["memory_GB"]["weights"] - split["memory_GB"]["grads"] == pytest.approx(gathered / GB)
        # Adam's 12 bytes a parameter (6 a bf16 byte): whole on each copy kept whole (a plain optimizer on each;
        # ZeRO-1's zero1 plans below), 1/R of it on a split one
        assert whole["memory_GB"]["optimizer"] - split["memory_GB"]["optimizer"] == pytest.approx(
            6 * L * eb * (1 - 1 / R) / GB)
        assert split["layer_s"]["allgather"] > 0 == whole["layer_s"]["allgather"]
    node = {name: p["bytes_per_link"]["node"] for name, p in (("whole", whole), ("kept", kept), ("again", again))}
    assert whole["microbatches"] == 1 and node["kept"] == pytest.approx(node["whole"])
    assert node["again"] - node["kept"] == pytest.approx(L * (R - 1) / R * eb)
    assert how_to_run(Plan(8, 1, 32, shard_copies=True), cluster) == {
        "mesh_shape": [4, 8], "mesh_dim_names": ["dp_shard", "local"], "options": {}}
    assert how_to_run(Plan(8, 1, 32, shard_copies=True, reshard=True), cluster)["options"] == {
        "reshard_after_forward": True}
    split = {p["moe_tp"] for p in plan(shape, cluster, 4096)["plans"] if p["shard_copies"]}
    assert split == {"off", "ssmb", "ted"}, split  # (SSMB: the group's tp ranks split alike; TED: each tp slice)
    assert how_to_run(Plan(8, 2, 16, "ssmb", shard_copies=True), cluster) == {
        "mesh_shape": [4, 4, 2], "mesh_dim_names": ["dp_shard", "local", "tp"], "options": {"moe_tp": "ssmb"}}
    ted = [evaluate(shape, cluster, Plan(4, 2, 16, "ted", shard_copies=split), 4096, 1) for split in (False, True)]
    te = shape.num_experts // 4 * shape.expert_params() * 2 // 2  # a rank's TED share: 1/4 of the experts, half of I
    assert ted[0]["memory_GB"]["grads"] - ted[1]["memory_GB"]["grads"] == pytest.approx(L * te * (1 - 1 / R) / GB)
    assert how_to_run(Plan(4, 2, 16, "ted", shard_copies=True), cluster) == {  # (dp / ep = 4 copies, tp innermost)
        "mesh_shape": [4, 4, 2], "mesh_dim_names": ["dp_shard", "local", "tp"], "options": {"moe_tp": "ted"}}


def test_hsdp_copies_split_inside_a_node_priced_and_laid_out():
    """HSDP (``shard_over``): a group of 4 ranks in a node of 8 leaves 2 copies in each node and 4 across nodes; split
    over the 2 inside the node, each layer gathers and reduce-scatters half a copy over the node's link alone, and
    the pieces' gradients are all-reduced over the 4 copies holding the same (a ring over the nodes' link, half the
    bytes of the copies kept whole); a rank holds half the group's experts, their gradients and optimizer state; the
    gathers over the node's fast link hide under the pre-expert compute, over all 8 copies they do not; run lays it
    out as ("dp_replicate", "dp_shard", "local"); the search prices it; 3 copies do not divide 8."""
    cluster = read_cluster({"gpu": {"name": "H100", "bf16_tflops": 800, "hbm_TBps": 3.35, "memory_GB": 80},
                            "levels": [{"name": "node", "count": 4, "alpha_s": 1e-5, "GBps": 25},
                                       {"name": "local", "count": 8, "alpha_s": 3e-6, "GBps": 450}]})
    shape = read_config(os.path.join(CONFIGS, "qwen3_30b_a3b.json"))
    whole, hsdp, every = (evaluate(shape, cluster, Plan(4, 1, 32, shard_copies=split, shard_over=over), 4096, 1)
                          for split, over in ((False, 0), (True, 2), (True, 0)))
    L, GB = shape.moe_layers, 1e9
    eb = shape.num_experts // 4 * shape.expert_params() * 2  # a rank's group share of the experts, bf16
    link = {n: hsdp["bytes_per_link"][n] - whole["bytes_per_link"][n] for n in ("node", "local")}
    assert link["local"] == pytest.approx(L * 2 * eb / 2)  # (gather, reduce-scatter: half a copy each)
    assert link["node"] == pytest.approx(2 * 3 / 4 * L * eb / 2 - 2 * 7 / 8 * L * eb)  # (ring of 4, of 8 before)
    for p, split in ((hsdp, 2), (every, 8)):
        assert whole["memory_GB"]["grads"] - p["memory_GB"]["grads"] == pytest.approx(L * eb * (1 - 1 / split) / GB)
    optimizer = [p["memory_GB"]["optimizer"] for p in (whole, hsdp, every)]
    for p, split in ((1, 2), (2, 8)):  # (12 bytes a parameter; the copies kept whole: each its state whole)
        assert optimizer[0] - optimizer[p] == pytest.approx(6 * L * eb * (1 - 1 / split) / GB)
    assert 0 == hsdp["layer_s"]["allgather"] < every["layer_s"]["allgather"]  # (hidden by the pre-expert compute)
    assert how_to_run(Plan(4, 1, 32, shard_copies=True, shard_over=2), cluster) == {
        "mesh_shape": [4, 2, 4], "mesh_dim_names": ["dp_replicate", "dp_shard", "local"], "options": {}}
    assert "invalid" in evaluate(shape, cluster, Plan(4, 1, 32, shard_copies=True, shard_over=3), 4096, 1)
    assert {p["shard_over"] for p in plan(shape, cluster, 4096)["plans"] if p["ep"] == 4} >= {0, 2, 4}


def test_expert_domains_priced_with_their_copies_kept_or_gathered_again():
    """Each expert-domain plan twice: its gathered copies kept for backward (every MoE layer's at the end of
    forward) or freed after forward (two layers' at most: the running one's and the next one's, started ahead) and
    gathered again in backward (one more gather a layer: its bytes, and its time less the pre-expert part's
    backward, twice the forward's, that it runs beside: what the forward's gather leaves unhidden, less once more the
    pre-expert time, which is never 0); run says which."""
    cluster = read_cluster({"gpu": {"name": "H100", "bf16_tflops": 800, "hbm_TBps": 3.35, "memory_GB": 80},
                            "levels": [{"name": "node", "count": 4, "alpha_s": 1e-5, "GBps": 25},
                                       {"name": "local", "count": 8, "alpha_s": 3e-6, "GBps": 450}]})
    shape = read_config(os.path.join(CONFIGS, "qwen3_30b_a3b.json"))
    plans = [p for p in plan(shape, cluster, 4096)["plans"]  # (recomputed: test_plan_recompute; split: below)
             if p["recompute"] == "off" and not p["shard_copies"]]
    key = lambda p: (p["pp"], p["virtual_stages"], p["ep"], p["tp"], p["moe_tp"],  # noqa: E731
                     str(p["expert_domains"]), p["zero1"])
    kept = {key(p): p for p in plans if p["expert_domains"] and not p["reshard_after_forward"]}
    again = {key(p): p for p in plans if p["expert_domains"] and p["reshard_after_forward"]}
    assert kept and set(kept) == set(again)
    assert any(p["layer_s"]["regather"] > 0 for p in again.values())  # (not every gather again hidden here)
    for k, a in again.items():
        b = kept[k]
        own = shape.num_experts // b["ep"] * shape.expert_params() * 2  # a rank's experts of a layer, bf16 bytes
        others = own * (math.prod(b["expert_domains"].values()) - 1)  # a layer's gathered copies of the others'
        saved = b["memory_GB"]["weights"] - a["memory_GB"]["weights"]
        stage = stage_shape(shape, a["pp"])  # (the busiest stage's layers; every micro-batch regathers)
        assert saved == pytest.approx((stage.moe_layers - 2) * others / 1e9, rel=1e-6), (k, saved)
        slots = a["microbatches"] + (a["pp"] - 1) / a["virtual_stages"]  # (1F1B; interleaved: test_plan_interleaved)
        assert a["step_s"] - b["step_s"] == pytest.approx(slots * stage.moe_layers * a["layer_s"]["regather"],
                                                          rel=1e-6)
        gather, regather = a["layer_s"]["allgather"], a["layer_s"]["regather"]
        assert gather == b["layer_s"]["allgather"] and b["layer_s"]["regather"] == 0
        assert (regather < gather) if gather else regather == 0, (k, regather, gather)
        assert sum(a["bytes_per_link"].values()) > sum(b["bytes_per_link"].values())
        if "not_runnable" not in a["run"]:
            assert a["run"]["options"]["reshard_after_forward"] is True
            assert "reshard_after_forward" not in b["run"]["options"]


def test_split_copies_beside_expert_domains():
    """Expert domains with the group's copies split over their ranks: a rank keeps 1/R of its experts, each layer
    gathers its copy's pieces first and then the domain's experts from those (the domain's whole experts held, every
    MoE layer's kept for backward or two gathered again), the pieces' and the domain's bytes both; the run lays out
    "dp_shard" beside the domains, as parallelize runs them."""
    cluster = read_cluster({"gpu": {"name": "H100", "bf16_tflops": 800, "hbm_TBps": 3.35, "memory_GB": 80},
                            "levels": [{"name": "node", "count": 4, "alpha_s": 1e-5, "GBps": 25},
                                       {"name": "local", "count": 8, "alpha_s": 3e-6, "GBps": 450}]})
    shape = read_config(os.path.join(CONFIGS, "qwen3_30b_a3b.json"))
    L, R, GB, domains = shape.moe_layers, 4, 1e9, (("local", 2),)
    eb = shape.num_experts // 8 * shape.expert_params() * 2  # a rank's group share of the experts, bf16
    for r in (False, True):
        plain, split, dom, both = (evaluate(shape, cluster, Plan(8, 1, 32, expert_domains=d, shard_copies=c,
                                                                 reshard=r), 4096, 1)
                                   for d, c in ((None, False), (None, True), (domains, False), (domains, True)))
        assert both["memory_GB"]["grads"] == pytest.approx(dom["memory_GB"]["grads"] - L * eb * (1 - 1 / R) / GB)
        held = both["memory_GB"]["weights"] - both["memory_GB"]["grads"]
        assert held == pytest.approx((2 if r else L) * 2 * eb / GB)  # (the domain's two ranks' experts a layer)
        assert both["memory_GB"]["optimizer"] == pytest.approx(split["memory_GB"]["optimizer"])
        for level in ("node", "local"):  # the pieces' bytes and the domain's, its exchange's as the domain's
            assert both["bytes_per_link"][level] == pytest.approx(
                split["bytes_per_link"][level] + dom["bytes_per_link"][level] - plain["bytes_per_link"][level])
        assert both["layer_s"]["allgather"] >= max(split["layer_s"]["allgather"], dom["layer_s"]["allgather"])
        assert both["layer_s"]["dispatch"] == dom["layer_s"]["dispatch"]
    run = how_to_run(Plan(8, 1, 32, expert_domains=domains, shard_copies=True), cluster)
    assert run == {"mesh_shape": [4, 8], "mesh_dim_names": ["dp_shard", "local"],
                   "options": {"expert_domains": {"local": 2}}}
    assert any(p["shard_copies"] and p["expert_domains"] for p in plan(shape, cluster, 4096)["plans"])


def test_zero1_prices_the_busiest_copys_share_and_a_broadcast():
    """ZeRO-1 of the experts over the copies kept whole (``zero1``: ``moecompile.expert_zero_optimizer``, torch's
    ZeroRedundancyOptimizer): Adam's state of the busiest copy's share of whole tensors (each MoE layer's gate_up,
    twice its down, the largest first to the rank holding least), the updated experts broadcast once a step
    ((R - 1) / R of them over the slowest level the copies span); run names the optimizer, the printed code calls
    it; the search prices the copies kept whole both ways, never split or replicated ones; one copy: not runnable."""
    cluster = read_cluster({"gpu": {"name": "H100", "bf16_tflops": 800, "hbm_TBps": 3.35, "memory_GB": 80},
                            "levels": [{"name": "node", "count": 4, "alpha_s": 1e-5, "GBps": 25},
                                       {"name": "local", "count": 8, "alpha_s": 3e-6, "GBps": 450}]})
    shape = read_config(os.path.join(CONFIGS, "qwen3_30b_a3b.json"))
    assert [dataclasses.replace(shape, moe_layers=n).zero_share(r) for n, r in ((1, 2), (4, 8), (48, 4))] == [
        2 / 3, 2 / 12, 1 / 4]  # (one layer: gate_up alone on a rank; 8 tensors on 8 ranks: a gate_up each busiest)
    whole, zero = (evaluate(shape, cluster, Plan(8, 1, 32, zero1=z), 4096, 1) for z in (False, True))
    R, L, GB = 4, shape.moe_layers, 1e9
    eb = shape.num_experts // 8 * shape.expert_params() * 2  # a rank's group share of the experts, bf16
    assert whole["memory_GB"]["optimizer"] - zero["memory_GB"]["optimizer"] == pytest.approx(6 * L * eb * 3 / 4 / GB)
    assert zero["bytes_per_link"]["node"] - whole["bytes_per_link"]["node"] == pytest.approx((R - 1) / R * L * eb)
    assert zero["bytes_per_link"]["local"] == whole["bytes_per_link"]["local"] and zero["step_s"] > whole["step_s"]
    run = how_to_run(Plan(8, 1, 32, zero1=True), cluster)
    assert run == {**how_to_run(Plan(8, 1, 32), cluster), "expert_optimizer": "moecompile.expert_zero_optimizer"}
    assert code(run).endswith("; experts_opt = moecompile.expert_zero_optimizer(model, torch.optim.AdamW)")
    assert "not_runnable" in how_to_run(Plan(32, 1, 32, zero1=True), cluster)
    plans = plan(shape, cluster, 4096)["plans"]
    assert {p["zero1"] for p in plans} == {False, True}
    assert not any(p["zero1"] and (p["shard_copies"] or p["replication"] or p["ep"] == 32) for p in plans)
