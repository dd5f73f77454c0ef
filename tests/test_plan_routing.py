"""``python -m moecompile plan --routing`` (issue 26 item 1: dedup priced by the expected distinct (token, group)
pairs "under the routing, uniform unless a measured routing is given"): a routing recorded on a model
(``moecompile.record_routing``) replaces uniform routing in the planner's all-to-alls (checked against
``cost_model.messages``, the dedup model the passes use, on the same routing), its experts' busiest rank, and
replication's balance. No processes: the planner is arithmetic."""

import json
import os
import subprocess
import sys

import pytest
import torch

from moecompile.plan import read_cluster, read_config
from moecompile.plan.routing import Routing, read_routing, record_routing
from moecompile.plan.search import plan
from moecompile.runtime.comm import expected
from moecompile.runtime.comm.cost_model import messages
from moecompile.runtime.comm.plan import Placement

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = os.path.join(ROOT, "models", "configs")
SMALL = {"gpu": {"name": "H100", "bf16_tflops": 800, "hbm_TBps": 3.35, "memory_GB": 80},
         "levels": [{"name": "node", "count": 4, "alpha_s": 1e-5, "GBps": 25},
                    {"name": "local", "count": 8, "alpha_s": 3e-6, "GBps": 450}]}


def _routing(E, K, tokens, skew, seed=0):
    """``tokens`` tokens each choosing K distinct experts, expert e drawn with weight 1 / (e + 1) ** skew (0:
    uniform), the experts' ids shuffled so the popular ones are spread."""
    gen = torch.Generator().manual_seed(seed)
    weight = (1.0 / torch.arange(1, E + 1, dtype=torch.float64) ** skew)[torch.randperm(E, generator=gen)]
    return torch.multinomial(weight.expand(tokens, E), K, replacement=False, generator=gen)


@pytest.mark.parametrize("skew", [0.0, 1.0])
def test_messages_on_a_measured_routing_are_the_dedup_models(skew):
    """On one sampled routing (8 ranks x 2048 tokens, uniform and skewed), every collective's busiest rank in
    ``cost_model.messages`` is within 3% of what the planner computes from the
    routing's per-rank shares and per-group hits."""
    E, K, T, row, shape, names = 32, 4, 2048, 128, (2, 4), ("node", "local")
    ids = _routing(E, K, 8 * T, skew)
    source = torch.arange(8).repeat_interleave(T)  # T tokens a rank (the tokens are drawn independently)
    sampled = messages(ids, Placement(torch.arange(E) // 4, shape), source, row, names=names)
    want = Routing({"layer": ids}, E).messages(T, K, shape, names, row)
    for mode in want:
        for (kind, got), (_, exp) in zip(sampled[mode], want[mode]):
            print(f"skew {skew} {mode} {kind}: sampled {got:.0f} B, from the routing {exp:.0f} B")
            assert 0.99 * exp <= got <= 1.03 * exp, (mode, kind, got, exp)
    if skew == 0:  # a uniform sample: the uniform expectation
        for mode, msgs in expected.expected_messages(T, K, E, shape, names, row).items():
            assert all(abs(a[1] - b[1]) <= 0.02 * b[1] for a, b in zip(want[mode], msgs)), mode


def test_skewed_routing_prices_the_busiest_rank_and_replication_balances_it():
    """A skewed routing: the busiest of 32 ranks gets several times the mean rows (1 for a uniform sample, within
    sampling), replication's instances (placed by ``replication.schedule`` for the load) bring it near 1 as slots
    grow, and the planner's experts' time grows by that factor against uniform routing while dedup's duplication
    is measured."""
    E, K = 64, 4
    skewed = Routing({f"l{i}": _routing(E, K, 8192, 1.2, seed=i) for i in range(2)}, E)
    even = Routing({"l": _routing(E, K, 8192, 0.0)}, E)
    assert even.imbalance(32) < 1.25 and skewed.imbalance(32) > 2.5, (even.imbalance(32), skewed.imbalance(32))
    assert skewed.imbalance(32, slots_per_rank=2) == skewed.imbalance(32)  # 64 slots: one instance each
    assert skewed.imbalance(32, slots_per_rank=4) < skewed.imbalance(32) / 3  # 6.6 -> 1.5
    assert skewed.imbalance(32, slots_per_rank=8) < 1.2, skewed.imbalance(32, 8)
    shape = read_config(os.path.join(CONFIGS, "qwen3_30b_a3b.json"))  # 128 experts, top-8
    routing = Routing({f"l{i}": _routing(128, 8, 8192, 1.2, seed=i) for i in range(2)}, 128)
    cluster = read_cluster(SMALL)
    uniform, measured = plan(shape, cluster, 4096), plan(shape, cluster, 4096, routing=routing)
    assert measured["routing"]["layers"] == 2 and measured["routing"]["busiest_expert"] > 3
    key = lambda p: (p["pp"], p["ep"], p["tp"], p["moe_tp"], p["dedup"], str(p["expert_domains"]),  # noqa: E731
                     str(p["replication"]))
    u = {key(p): p for p in uniform["plans"]}
    for p in measured["plans"]:
        if p["ep"] == 32 and p["dedup"] == "off" and not p["expert_domains"] and not p["replication"]:
            ratio = p["layer_s"]["experts"] / u[key(p)]["layer_s"]["experts"]
            assert ratio == pytest.approx(routing.imbalance(32), rel=1e-6), ratio
    assert measured["duplication"]["node"] > uniform["duplication"]["node"]  # popular experts share groups


def test_record_routing_and_the_cli(tmp_path):
    """record_routing on a tiny Mixtral writes each MoE layer's [tokens, top_k] ids; plan --routing reads it with
    the model's config and says so in its table and plan.json."""
    from moecompile.models.hf import tiny_model

    model = tiny_model("mixtral")
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    path = tmp_path / "routing.pt"
    layers = record_routing(model, ids, path=str(path))
    K, E = model.config.num_experts_per_tok, model.config.num_local_experts
    assert len(layers) == model.config.num_hidden_layers
    assert all(v.shape == (32, K) for v in layers.values())
    model.config.to_json_file(str(tmp_path / "config.json"))
    (tmp_path / "cluster.json").write_text(json.dumps(
        {"gpu": SMALL["gpu"], "levels": [{"name": "node", "count": 2, "alpha_s": 1e-5, "GBps": 25},
                                         {"name": "local", "count": 2, "alpha_s": 3e-6, "GBps": 450}]}))
    run = subprocess.run([sys.executable, "-m", "moecompile", "plan", str(tmp_path / "config.json"), "--cluster",
                          str(tmp_path / "cluster.json"), "--seq", "64", "--routing", str(path), "--json",
                          str(tmp_path / "plan.json")], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert run.returncode == 0, run.stdout + run.stderr
    assert f"measured routing: {len(layers)} layers, {32 * len(layers)} tokens" in run.stdout, run.stdout
    assert json.loads((tmp_path / "plan.json").read_text())["routing"]["layers"] == len(layers)
    assert read_routing(str(path), E).top_k == K


def test_bad_routing_input_names_the_fix(tmp_path):
    ids = _routing(8, 2, 64, 0.0)
    torch.save({"layers": {"l": ids}, "num_experts": {"l": 8}}, tmp_path / "r.pt")
    with pytest.raises(ValueError, match="records layers of \\[8\\] experts; the config has 16"):
        read_routing(str(tmp_path / "r.pt"), 16)
    with pytest.raises(ValueError, match="not found: write it with moecompile.record_routing"):
        read_routing(str(tmp_path / "missing.pt"), 8)
    torch.save({"l": ids}, tmp_path / "bare.pt")
    with pytest.raises(ValueError, match="is not a routing file"):
        read_routing(str(tmp_path / "bare.pt"), 8)
    with pytest.raises(ValueError, match="names expert 7, outside the model's 4 experts"):
        Routing({"l": ids.clamp(max=7)}, 4)
    with pytest.raises(ValueError, match="expected \\[tokens, top_k\\] integer expert ids"):
        Routing({"l": ids.float()}, 8)
    with pytest.raises(ValueError, match="records no MoE layer"):
        Routing({}, 8)
    shape = read_config(os.path.join(CONFIGS, "mixtral_8x7b.json"))  # top-2
    with pytest.raises(ValueError, match="tokens chose 3 experts each; the config's top-k is 2"):
        plan(shape, read_cluster(SMALL), 4096, routing=Routing({"l": _routing(8, 3, 64, 0.0)}, 8))
