"""Experts replicated over a mesh's outermost ``"dp_replicate"`` dimension (an expert-parallel group smaller than
the world, as the planner's plans with ep below the GPU count run): world 4 as a (2, 2) ("dp_replicate", "ep")
mesh, each expert on 2 ranks. Mixtral (stacked experts) and a hand-written ModuleList model train three SGD steps,
each rank on its own batch, beside one process training on the four batches together: every step's logits and
the parameters and their momentum after the steps are equal (fp32, 1e-5); each rank holds the E / 2 experts of its index in its
group, and exchanges rows only inside its group. The state_dict gives each stacked expert weight as a DTensor
Replicate over "dp_replicate" and Shard(0) over "ep"; a torch.distributed.checkpoint saved by the 4 ranks loads in
one process exactly, and so does ``save_hf_checkpoint``'s (each of the 4 ranks writing layers in turn, the copy it
is in sending the experts). A (1, 2, 2) ("dp_replicate", "node", "local") mesh dedups over "node" inside its group the
same way, and a (2, 2) ("dp_replicate", "tp") mesh runs two copies of a sequence-sharded (SSMB) group, and of a
TED one (each rank every expert, cut over tp; the state_dict's Replicate over both dimensions). Expert
domains work inside each copy's group: Mixtral with {"ep": 2} trains as one process (each rank gathers its copy's
experts), and "auto" chooses per copy, every rank making every copy's candidate groups together. Expert swap
(swap_every=1) trains Mixtral as one process, every copy making the same swaps (chosen on every copy's routing).
ZeRO-1 of the experts over "dp_replicate" (moecompile.expert_zero_optimizer: torch's ZeroRedundancyOptimizer over
its group, each rank holding half of its experts' AdamW state) trains as one process; its state checkpointed with
moecompile.get_optimizer_state_dict and torch.distributed.checkpoint (each expert's state once, as a DTensor of the
whole weight) loads into a new ZeRO optimizer and into a plain one, each rank taking the state it steps, and in one
process equals the one-process AdamW state; torch's own consolidated state_dict loads back too; of the two stage
modules a rank holds under an interleaved schedule, it steps both as one process. A "dp_replicate" not outermost is
refused with ValueError, and so is ZeRO-1 of a model that swaps experts."""

import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from clipping import clip_as_one_process
from outer_groups import domains_per_group
from ranks import spawn
from ep_checkpoints import TOL, loads_in_one_process, save
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor, Replicate, Shard

import moecompile
from moecompile.runtime.comm.cost_model import LinkModel
from moecompile.models.handwritten import TinyMoELM
from moecompile.models.hf import tiny_model

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
STEPS, LR = 3, 0.1
SLOW = LinkModel({"flat": (2e-2, 2e-6)})  # (expert_domains="auto": the stream model prices each copy's links)


def _build(family):
    torch.manual_seed(0)
    return TinyMoELM(family) if family == "loop" else tiny_model(family)


def _train(family, mesh, rank, world, dedup="off", moe_tp="off", tp=1, domains=None, link_model=None, swap_every=0):
    """Three steps with the experts over ``mesh`` and in one process; returns (sharded model, one-process model).
    ``tp``: the ranks of one tp group (consecutive) hold the same batch (7 tokens: uneven SSMB slices);
    ``domains``: ``expert_domains`` inside each copy's group; ``swap_every``: experts swap ranks inside each copy's
    group (the same swaps in every copy; the weights then compared in expert order)."""
    ref, model = _build(family).train(), _build(family).train()
    vocab = model.config.vocab_size if hasattr(model, "config") else model.embed.num_embeddings
    batches = torch.randint(0, vocab, (world // tp, 2, 6 if tp == 1 else 7), generator=torch.Generator().manual_seed(7))
    mine, together = batches[rank // tp], batches.flatten(0, 1)
    moecompile.parallelize(model, mesh, mine, dedup=dedup, moe_tp=moe_tp, expert_domains=domains,
                           link_model=link_model, swap_every=swap_every)
    info = model._moe_parallel
    group_size, copies = info.world, info.copies
    assert group_size * copies == world and not info.left, str(info)
    ep_rank = dist.get_rank(info.group)
    assert ep_rank == rank % group_size and (copies == 1 or "each expert on 2 ranks" in str(info)), str(info)
    every = dict(ref.named_parameters())
    for name, p in model.named_parameters() if moe_tp != "ted" else ():  # this rank's E / group experts: its index in
        # the group's (TED: each its experts over the copy's data-parallel ranks, their intermediate size cut)
        if getattr(p, "_moe_sharded", False):
            n = p.shape[0]
            assert n * group_size == every[name].shape[0] and torch.equal(p, every[name][ep_rank * n:(ep_rank + 1) * n])
        elif ".experts." in name:  # a ModuleList's expert: one of this rank's
            assert int(name.split(".experts.")[1].split(".")[0]) // (8 // group_size) == ep_rank, name
    compiled = torch.compile(model, backend="moe", options={"inner": "aot_eager", "strict": True})
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=LR, momentum=0.9) for m in (model, ref))
    rows = slice(rank // tp * mine.shape[0], (rank // tp + 1) * mine.shape[0])
    moecompile.comm_stats(reset=True)
    for step in range(STEPS):
        out, ref_out = compiled(mine, labels=mine), ref(together, labels=together)
        torch.testing.assert_close(out.logits, ref_out.logits[rows], rtol=TOL, atol=TOL,
                                   msg=lambda m: f"{family} step {step}: {m}")
        out.loss.backward()
        ref_out.loss.backward()
        clip_as_one_process(model, ref, step)
        opt.step(), ref_opt.step(), opt.zero_grad(), ref_opt.zero_grad()
    whole = swap_every or moe_tp == "ted"  # (the weights compared whole, in expert order)
    for name, p in model.named_parameters() if not whole else ():
        want = every[name].detach()
        if getattr(p, "_moe_sharded", False):
            want = want[ep_rank * p.shape[0]:(ep_rank + 1) * p.shape[0]]
        torch.testing.assert_close(p.detach(), want, rtol=TOL, atol=TOL, msg=lambda m: f"{family} {name}: {m}")
    for name, value in moecompile.full_state_dict(model).items() if whole else ():
        torch.testing.assert_close(value, every[name].detach(), rtol=TOL, atol=TOL, msg=lambda m: f"{name}: {m}")
    momentum = moecompile.get_optimizer_state_dict(model, opt)["state"]  # stacked experts': DTensors, whole
    for name, p in model.named_parameters():
        got = momentum[name]["momentum_buffer"]
        got = got.full_tensor() if getattr(p, "_moe_sharded", False) else got
        torch.testing.assert_close(got, ref_opt.state[every[name]]["momentum_buffer"], rtol=TOL, atol=TOL,
                                   msg=lambda m: f"{family} momentum of {name}: {m}")
    return model, ref


def _stacked(model) -> list[str]:
    """The names of the sharded expert weights held as one tensor (stacked or flat; a ModuleList's are not)."""
    return [n for n, p in model.named_parameters() if getattr(p, "_moe_sharded", False)]


def _bad_input(mesh, rank):
    ids = torch.zeros(1, 4, dtype=torch.long)
    inner = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ep", "dp_replicate"))
    with pytest.raises(ValueError, match="'dp_replicate' must come first"):
        moecompile.parallelize(tiny_model("mixtral"), inner, ids)


def _planner_plans_run(rank, world):
    """Every plan ``python -m moecompile plan`` prices for a tiny Mixtral on 2 nodes x 2 GPUs and says runs
    (``plan.json``'s ``run``: mesh and options) is accepted by parallelize and shards as priced: the plan's
    copies of each expert (N / ep; TED: N / (ep tp)) over ``"dp_replicate"``, the rest its exchange group. Two
    copies of a group over "tp" with moe_tp "off" (trained nowhere else) train a step."""
    from moecompile.plan import read_cluster, read_config
    from moecompile.plan.search import plan

    cluster = read_cluster({"gpu": {"name": "cpu", "bf16_tflops": 1, "hbm_TBps": 1, "memory_GB": 80},
                            "levels": [{"name": "node", "count": 2, "alpha_s": 1e-5, "GBps": 1},
                                       {"name": "local", "count": 2, "alpha_s": 1e-6, "GBps": 10}]})
    ids = torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(rank))
    seen, ran, copied = set(), set(), set()  # every runnable layout; those trained a step here; options with copies
    for p in plan(read_config(tiny_model("mixtral").config.to_dict()), cluster, 6)["plans"]:
        run = p["run"]
        key = repr((run.get("mesh_shape"), run.get("mesh_dim_names"), run.get("options")))
        if "not_runnable" in run or key in seen or p["pp"] > 1:  # (pipeline stages' meshes: tests/test_plan.py,
            continue  # tests/test_pipeline.py)
        seen.add(key)
        mesh = init_device_mesh("cpu", tuple(run["mesh_shape"]), mesh_dim_names=tuple(run["mesh_dim_names"]))
        model = moecompile.parallelize(tiny_model("mixtral").train(), mesh, ids, **run["options"])
        info = model._moe_parallel
        copies = world // (p["ep"] * (p["tp"] if p["moe_tp"] == "ted" else 1))  # (TED: ep over one tp index)
        assert (info.copies, info.world) == (copies, world // copies), (run, info.world, info.copies)
        assert not info.left and all(r.sharding for r in info.report.layers), (run, str(info))
        if copies > 1:
            copied |= {k for k, on in (("ted", run["options"].get("moe_tp") == "ted"),
                                       ("domains", "expert_domains" in run["options"]),
                                       ("replication", "replication" in run["options"])) if on}
        if run["mesh_dim_names"] == ["dp_replicate", "tp"] and run["options"] == {"moe_tp": "off"}:
            ran.add(key)  # (the others train in _world4 or tests/test_parallelize.py, test_moe_tp.py, ...)
            compiled = torch.compile(model, backend="moe", options={"inner": "aot_eager", "strict": True})
            loss = compiled(ids, labels=ids).loss
            loss.backward()
            assert torch.isfinite(loss), run
    assert len(seen) >= 15 and ran, seen  # off, dedup, SSMB, TED, domains, replication, with and without copies
    assert copied == {"ted", "domains", "replication"}, seen  # (with copies: not_runnable or not priced before)
    assert any("dp_shard" in k and "expert_domains" in k for k in seen), seen  # (split copies beside domains)


ZERO_KW = {"lr": 1e-2, "weight_decay": 0.01, "eps": 1e-6}


def _zero_batches(vocab, world):
    return torch.randint(0, vocab, (world, 2, 6), generator=torch.Generator().manual_seed(7))


def _zero_redundancy(mesh, rank, world, tmp):
    """ZeRO-1 of the experts over "dp_replicate": ``moecompile.expert_zero_optimizer``, torch's
    ZeroRedundancyOptimizer over the group of the copies: each expert weight, the same on both copies, stepped on
    one copy's rank (its AdamW state there only), then broadcast. Three steps equal one process's AdamW; each rank
    holds half its experts' state. Checkpointed with ``moecompile.get_optimizer_state_dict`` (its lr changed first,
    as a schedule would) and torch.distributed.checkpoint, it loads into a new ZeRO optimizer and into a plain
    AdamW, each rank's own state exactly, the lr with it (``_zero_in_one_process`` loads it whole); torch's own
    state_dict consolidated on a copy's rank loads too. A model not parallelized, without "dp_replicate", or
    swapping experts is refused naming the fix."""
    with pytest.raises(ValueError, match="call it after moecompile.parallelize"):
        moecompile.expert_zero_optimizer(_build("mixtral"), torch.optim.AdamW)
    ids = torch.zeros(1, 4, dtype=torch.long)
    flat = moecompile.parallelize(_build("mixtral"), init_device_mesh("cpu", (world,)), ids)  # (one copy: "ep" only)
    with pytest.raises(ValueError, match="add an outermost 'dp_replicate' dimension, or use a plain optimizer"):
        moecompile.expert_zero_optimizer(flat, torch.optim.AdamW)
    swapping = moecompile.parallelize(_build("mixtral"), mesh, ids, swap_every=1)
    with pytest.raises(ValueError, match="use swap_every=0, or a plain optimizer"):
        moecompile.expert_zero_optimizer(swapping, torch.optim.AdamW)
    ref, model = _build("mixtral").train(), _build("mixtral").train()
    batches = _zero_batches(model.config.vocab_size, world)
    mine, together = batches[rank], batches.flatten(0, 1)
    moecompile.parallelize(model, mesh, mine)
    compiled = torch.compile(model, backend="moe", options={"inner": "aot_eager", "strict": True})
    experts, group = moecompile.expert_parameters(model), mesh["dp_replicate"].get_group()
    kw = ZERO_KW
    dense = torch.optim.AdamW([p for p in model.parameters() if p not in experts], **kw)
    zero = moecompile.expert_zero_optimizer(compiled, torch.optim.AdamW, **kw)  # (its model's experts, in order)
    stepped = [p for p in model.parameters() if p in experts]
    assert isinstance(zero, ZeroRedundancyOptimizer) and zero.process_group == group
    assert [id(p) for g in zero.param_groups for p in g["params"]] == [id(p) for p in stepped]
    ref_opt = torch.optim.AdamW(ref.parameters(), **kw)
    for step in range(STEPS):
        out, ref_out = compiled(mine, labels=mine), ref(together, labels=together)
        torch.testing.assert_close(out.logits, ref_out.logits[rank * 2:rank * 2 + 2], rtol=TOL, atol=TOL,
                                   msg=lambda m: f"ZeRO step {step}: {m}")
        out.loss.backward(), ref_out.loss.backward()
        for opt in (dense, zero, ref_opt):
            opt.step(), opt.zero_grad()
    every = dict(ref.named_parameters())
    for name, value in moecompile.full_state_dict(model).items():
        torch.testing.assert_close(value, every[name].detach(), rtol=TOL, atol=TOL, msg=lambda m: f"ZeRO {name}: {m}")
    mine_state = {p: s for p, s in zero.optim.state.items() if s}
    assert 2 * sum(p.numel() for p in mine_state) == sum(p.numel() for p in experts), len(mine_state)
    zero.consolidate_state_dict(to=0)  # (the copy's first rank; every rank of the group calls it)
    saved = [zero.state_dict() if dist.get_rank(group) == 0 else None]
    dist.broadcast_object_list(saved, group=group, group_src=0)
    again = ZeroRedundancyOptimizer(stepped, torch.optim.AdamW, process_group=group, **kw)
    again.load_state_dict(saved[0])
    assert {p for p, s in again.optim.state.items() if s} == set(mine_state)
    assert all(torch.equal(again.optim.state[p]["exp_avg_sq"], s["exp_avg_sq"]) for p, s in mine_state.items())
    zero.param_groups[0]["lr"] = 5e-3  # (as an LR schedule sets it)
    state = moecompile.get_optimizer_state_dict(model, zero)
    names = {p: n for n, p in model.named_parameters()}
    assert set(state["state"]) == {names[p] for p in mine_state}  # (each expert's state on one rank of its copies)
    whole = {n: v.shape for n, v in model.state_dict().items()}  # (every rank calls it)
    assert all(isinstance(v, DTensor) and v.shape == whole[n] for n, s in state["state"].items()
               for k, v in s.items() if k != "step"), {n: list(s) for n, s in state["state"].items()}
    dcp.save({"experts_opt": state, "dense_opt": moecompile.get_optimizer_state_dict(model, dense)},
             checkpoint_id=f"{tmp}/zero")
    fresh = moecompile.expert_zero_optimizer(model, torch.optim.AdamW, **kw)
    plain = torch.optim.AdamW(stepped, **kw)  # (every expert's state on every copy, as without ZeRO)
    new_dense = torch.optim.AdamW([p for p in model.parameters() if p not in experts], **kw)
    for opt, own in ((fresh, fresh.optim), (plain, plain)):
        template = {"experts_opt": moecompile.get_optimizer_state_dict(model, opt),
                    "dense_opt": moecompile.get_optimizer_state_dict(model, new_dense)}
        dcp.load(template, checkpoint_id=f"{tmp}/zero")
        moecompile.set_optimizer_state_dict(model, opt, template["experts_opt"])
        moecompile.set_optimizer_state_dict(model, new_dense, template["dense_opt"])
        assert [g["lr"] for g in opt.param_groups] == [g["lr"] for g in own.param_groups] == [5e-3]
        for p, s in mine_state.items():
            assert all(torch.equal(own.state[p][k], v) for k, v in s.items()), (type(opt).__name__, names[p])
        assert all(torch.equal(new_dense.state[p][k], v) for p, s in dense.state.items() for k, v in s.items())
    assert {p for p, s in fresh.optim.state.items() if s} == set(mine_state)


def _zero_of_stages(mesh, rank, world):
    """ZeRO-1 of two stage modules a rank holds (an interleaved schedule's: the planner's zero1 plans with two stages
    a rank): one ``expert_zero_optimizer`` of the list steps both stages' experts, in order, each on one copy's rank.
    The stages run one after the other on this rank's batch; an AdamW step equals one process's on every batch, and
    the optimizer's state dict of the list names each expert state this rank holds by its model name."""
    ref, model = _build("mixtral").train(), _build("mixtral").train()
    mine, together = (lambda b: (b[rank], b.flatten(0, 1)))(_zero_batches(ref.config.vocab_size, world))
    cut = [moecompile.pipeline_stage(model, i, 2) for i in range(2)]
    hidden = torch.randn(*mine.shape, ref.config.hidden_size)
    stages = [moecompile.parallelize(s, mesh, x) for s, x in zip(cut, (mine, hidden))]
    compiled = [torch.compile(s, backend="moe", options={"inner": "aot_eager", "strict": True}) for s in stages]
    zero = moecompile.expert_zero_optimizer(compiled, torch.optim.AdamW, **ZERO_KW)
    experts = set().union(*map(moecompile.expert_parameters, stages))
    assert [id(p) for g in zero.param_groups for p in g["params"]] == [id(p) for s in stages for p in s.parameters()
                                                                      if p in experts]
    dense = torch.optim.AdamW([p for s in stages for p in s.parameters() if p not in experts], **ZERO_KW)
    ref_opt = torch.optim.AdamW(ref.parameters(), **ZERO_KW)

    def loss(logits, ids):
        return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())

    loss(compiled[1](compiled[0](mine)), mine).backward()
    loss(ref(together).logits, together).backward()
    for opt in (zero, dense, ref_opt):
        opt.step()
    every = dict(ref.named_parameters())
    for name, value in (kv for s in stages for kv in moecompile.full_state_dict(s).items()):
        torch.testing.assert_close(value, every[name].detach(), rtol=TOL, atol=TOL, msg=lambda m: f"{name}: {m}")
    state = moecompile.get_optimizer_state_dict(stages, zero)["state"]
    names = {p: n for s in stages for n, p in s.named_parameters()}
    assert set(state) == {names[p] for p, s in zero.optim.state.items() if s} and state, sorted(state)


def _zero_in_one_process(tmp, world):
    """The ranks' ZeRO-1 checkpoint (``_zero_redundancy``) in one process with no group: torch's
    set_optimizer_state_dict of an AdamW over the experts of a model trained the same steps in one process takes
    its state whole, equal to that AdamW's own."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    ref = _build("mixtral").train()
    together = _zero_batches(ref.config.vocab_size, world).flatten(0, 1)
    ref_opt = torch.optim.AdamW(ref.parameters(), **ZERO_KW)
    for _ in range(STEPS):
        ref(together, labels=together).loss.backward()
        ref_opt.step(), ref_opt.zero_grad()
    experts = [p for n, p in ref.named_parameters() if ".experts." in n]
    loaded = torch.optim.AdamW(experts, **ZERO_KW)
    template = {"experts_opt": get_optimizer_state_dict(ref, loaded)}
    dcp.load(template, checkpoint_id=f"{tmp}/zero")
    set_optimizer_state_dict(ref, loaded, template["experts_opt"])
    assert loaded.param_groups[0]["lr"] == 5e-3 and len(experts) == 4
    for p in experts:
        for k, v in ref_opt.state[p].items():
            torch.testing.assert_close(loaded.state[p][k], v, rtol=TOL, atol=TOL)


def _world4(rank, world, tmp):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rdv", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    try:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "ep"))
        _bad_input(mesh, rank)
        _planner_plans_run(rank, world)
        _zero_redundancy(mesh, rank, world, tmp)
        _zero_of_stages(mesh, rank, world)
        domains_per_group(mesh, rank, "dp_replicate")
        model, _ = _train("mixtral", mesh, rank, world, swap_every=1)  # the same swaps in every copy
        swaps = [None] * world
        dist.all_gather_object(swaps, model._moe_parallel.swap.history)
        assert swaps[0] and all(s == swaps[0] for s in swaps), swaps
        model, _ = _train("mixtral", mesh, rank, world, domains={"ep": 2})  # expert domains in each copy's group
        info, stats = model._moe_parallel, moecompile.comm_stats()
        gathered = f"the experts of ranks {[rank // 2 * 2, rank // 2 * 2 + 1]} gathered"
        assert all(gathered in r.sharding for r in info.report.layers), str(info)
        assert all(s["calls.domain_gather"] == s["calls.domain_reduce"] == 2 * STEPS  # (its 2 weights)
                   for s in stats.values()), stats
        model = moecompile.parallelize(_build("mixtral"), mesh, torch.randint(0, 64, (2, 6)), expert_domains="auto",
                                       link_model=SLOW)  # each copy chooses on its own ranks' routing and links
        info = model._moe_parallel
        assert all("expert domains auto ->" in r.sharding for r in info.report.layers), str(info)
        for family in ("mixtral", "loop"):
            model, _ = _train(family, mesh, rank, world)
            stats = moecompile.comm_stats()[model._moe_parallel.report.layers[0].path]
            assert stats["calls.dispatch"] == STEPS, stats
            state = model.state_dict()
            stacked = _stacked(model)
            for name in stacked:
                assert state[name].placements == (Replicate(), Shard(0)), (name, state[name].placements)
            assert bool(stacked) == (family == "mixtral")
            save(model, tmp, rank, family)
            moecompile.save_hf_checkpoint(model, f"{tmp}/hf_{family}", max_shard_size=1 << 14)  # (writers: all 4)
        levels = init_device_mesh("cpu", (1, 2, 2), mesh_dim_names=("dp_replicate", "node", "local"))
        model, _ = _train("mixtral", levels, rank, world, dedup="node")
        stats = moecompile.comm_stats()[model._moe_parallel.report.layers[0].path]
        assert stats["dedup.remote_pairs"] < stats["dedup.remote_assignments"], stats
        # two copies of a sequence-sharded expert-parallel group over "tp" (its ranks hold the same tokens)
        tp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "tp"))
        model, _ = _train("mixtral", tp, rank, world, moe_tp="ssmb", tp=2)
        assert all("sequence-sharded" in r.sharding for r in model._moe_parallel.report.layers)
        model, _ = _train("mixtral", tp, rank, world, moe_tp="ted", tp=2)  # and of TED: every expert, I over tp
        assert all("8 of 8 experts on each of 1 data-parallel ranks" in r.sharding and "moe_tp='ted'" in r.sharding
                   for r in model._moe_parallel.report.layers), str(model._moe_parallel)
        state = model.state_dict()  # (whole along I: Replicate over both dimensions, saved once)
        assert all(state[n].placements == (Replicate(), Replicate()) for n in _stacked(model)), state.keys()
    finally:
        dist.destroy_process_group()


def test_experts_replicated_over_dp_replicate_train_as_one_process(tmp_path):
    tmp = str(tmp_path)
    spawn(_world4, args=(4, tmp), nprocs=4)
    _zero_in_one_process(tmp, 4)
    for family in ("mixtral", "loop"):  # the 4 ranks' checkpoint, in one process with no group
        loads_in_one_process(_build(family), tmp, f"ckpt_{family}", f"saved_{family}.pt")
        one = _build(family)  # and save_hf_checkpoint's files (the layers written by the 4 ranks in turn)
        moecompile.load_hf_checkpoint(one, f"{tmp}/hf_{family}")
        whole = torch.load(f"{tmp}/saved_{family}.pt")
        assert all(torch.equal(p, whole[name]) for name, p in one.named_parameters()), family
        assert len({f.split("-")[1] for f in os.listdir(f"{tmp}/hf_{family}") if f.endswith(".safetensors")}) == 4
