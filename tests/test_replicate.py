"""Adaptive expert replication end to end (moecompile.parallelize(..., replication=...) + ExpertOptimizer) on gloo,
against one process.

World 4 on a 2x2 ("node", "local") mesh and one rank (in the test process, a 1-D mesh): Mixtral with S = E/W + 1 slots
per rank trains three steps with replication="adaptive" (torch's AdamW, lr 1e-3, eps 1e-6, weight decay 0.01; and SGD,
lr 0.1, momentum 0.9, with the gradient norm clipped to 1 and a LambdaLR warm-up) and, on world 4, with "static"
(AdamW), each rank on its own batch, beside one process training the same model on all the batches together with the
same torch optimizer (and torch's clip_grad_norm_ and LambdaLR): each step's logits of each rank equal the one-process
logits of its batch, ExpertOptimizer.clip_grad_norm_ returns the one-process norm, every parameter group follows the
schedule, the state_dict after the steps (the replicated experts from the host master weights, made whole) equals the
one-process parameters, and adaptive's equals static's (fp32, 1e-5).

AdamW's eps: AdamW divides each element's update by that element's own gradient magnitude, so an element whose
gradient is near eps turns fp32 rounding differences into update differences of up to lr. Any change of summation
order does it: with torch's default eps 1e-8, the one-rank run's router weight (a dense parameter, which torch's
AdamW steps on both sides) ends 3.2e-5 from the one-process run's. eps 1e-6 (common in LLM training) keeps
that effect below 1e-6 here; the host optimizer is checked against torch's AdamW at its default eps, on the same
gradients, in test_expert_state.py.

Adaptive placements follow the routing (they differ from static's; with SGD, whose steps move the router, they change
from step to step, and a static one does not); each slot holds the expert its placement names. A state_dict round trip
leaves the slots as they are. Bad input (too few slots, options that do not go with replication, an ExpertOptimizer for
a model without replicated experts or with an optimizer that cannot step on the host; a step or clip while
``no_sync`` holds gradients) raises ValueError naming the fix.
With "adaptive" and SGD, a torch.distributed.checkpoint saved after step 1 and loaded into a fresh model, optimizer and
schedule continues bit for bit across the placement changes of steps 2 and 3 (the experts' lr as scheduled); world 2 (a
1-D mesh) loads world 4's. World 2 and one rank also train dbrx (flat [E x ffn, H] expert weights: its state_dict
entries whole, Mixtral's stacked ones DTensors over the ranks' hosts) adaptive with SGD, checkpoint and resume included.
One rank: a step after two micro-batches (gradient accumulation) places by both's routing; a state taken before
training changes nothing (tests/replicate_split.py). World 4 as a (2, 2)
("dp_replicate", "ep") mesh: each copy's 2 ranks replicate the experts (5 slots each) by their own routing (the copies'
placements differ), the master parts' gradients summed over the copies; adaptive with SGD trains as one process and
resumes from its checkpoint (every copy's placement kept) bit for bit; Mixtral built on meta and initialized in place,
each rank drawing other values, holds the first copy's first instance of each expert everywhere once ExpertOptimizer is
built (tests/replicate_split.py). So does a (2, 2) ("dp_shard", "ep") mesh, whose replicating layers keep their
slots whole on each copy and split each rank's master part and optimizer state in shares over "dp_shard" (each rank
half of its part, as explain() says; world 2 loads its checkpoint; built on meta and initialized in place, and loaded
from a transformers checkpoint read in shares: tests/hf_replicated.py); the hand-written ModuleList model too
(adaptive, AdamW), and with its first layer not replicating (a frozen expert weight) and split over "dp_shard" beside
the replicating second: ExpertOptimizer's clipped norm (the split pieces and shares counted over the copies), logits
and weights as one process, also after its checkpoint loads into a fresh ExpertOptimizer (tests/replicate_split.py).
"""

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from ranks import spawn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import moecompile
from moecompile.models.hf import tiny_model
from moecompile.runtime.placement.replicas import POPULARITY
from moecompile.runtime.placement.replication import schedule, uniform

from hf_replicated import in_shares
from replicate_split import beside_split_layers, initialized_on_meta, state_before_training
from test_parallelize import LR, TOL, _batches, _build, _init

E = 8  # tiny Mixtral's experts
OPTIMIZERS = {"adamw": (torch.optim.AdamW, {"lr": 1e-3, "eps": 1e-6, "weight_decay": 0.01}),  # eps: the docstring
              "sgd": (torch.optim.SGD, {"lr": LR, "momentum": 0.9})}
MAX_NORM = 1.0  # SGD runs clip the gradient norm (above this at every step) and warm the lr up linearly


def _warmup(step):
    return 1.0 + step


def _schedule(opt):
    return torch.optim.lr_scheduler.LambdaLR(opt, _warmup)


def _whole(value):
    """A state_dict value whole (a replicated stacked weight is a DTensor over the ranks' hosts)."""
    return value.full_tensor() if isinstance(value, DTensor) else value


class _DeviceOnly(torch.optim.SGD):
    """An optimizer that refuses host tensors (as a CUDA-only fused one does)."""

    def step(self, closure=None):
        if any(p.device.type == "cpu" for g in self.param_groups for p in g["params"]):
            raise RuntimeError("this optimizer runs on CUDA tensors only")
        return super().step(closure)


def _bad_input(mesh, world):
    ids = torch.zeros(1, 4, dtype=torch.long)
    with pytest.raises(ValueError, match=r"cannot hold one instance of each of 8 experts: use slots_per_rank >= "):
        moecompile.parallelize(tiny_model("mixtral"), mesh, ids, replication="adaptive", slots_per_rank=1)
    with pytest.raises(ValueError, match="needs slots_per_rank=S"):
        moecompile.parallelize(tiny_model("mixtral"), mesh, ids, replication="adaptive")
    with pytest.raises(ValueError, match="choose one of"):
        moecompile.parallelize(tiny_model("mixtral"), mesh, ids, replication="sometimes", slots_per_rank=4)
    with pytest.raises(ValueError, match="use dedup='off' and swap_every=0"):
        moecompile.parallelize(tiny_model("mixtral"), mesh, ids, replication="static", slots_per_rank=4, swap_every=1)
    with pytest.raises(ValueError, match="pass replication='adaptive'"):
        moecompile.parallelize(tiny_model("mixtral"), mesh, ids, slots_per_rank=4)
    plain = moecompile.parallelize(tiny_model("mixtral"), mesh, ids)
    with pytest.raises(ValueError, match="has none: parallelize it so"):
        moecompile.ExpertOptimizer(plain, torch.optim.AdamW, lr=1e-3)
    replicated = moecompile.parallelize(tiny_model("mixtral"), mesh, ids, replication="adaptive",
                                        slots_per_rank=E // world + 1)
    with pytest.raises(ValueError, match="cannot step on the host.*CUDA tensors only"):
        moecompile.ExpertOptimizer(replicated, _DeviceOnly, lr=1e-3)
    with pytest.raises(ValueError, match="must be a torch.optim.Optimizer class"):
        moecompile.ExpertOptimizer(replicated, "AdamW", lr=1e-3)
    with pytest.raises(ValueError, match="train the model with moecompile.ExpertOptimizer"):
        torch.optim.SGD(replicated.parameters(), lr=0.1).step()
    with pytest.raises(ValueError, match="place_every must be a whole number of steps >= 1"):
        moecompile.ExpertOptimizer(replicated, torch.optim.AdamW, lr=1e-3, place_every=0)
    opt = moecompile.ExpertOptimizer(replicated, torch.optim.AdamW, lr=1e-3)
    held = replicated._moe_parallel.sync.replicated
    held.held[0] = torch.zeros(1)  # (as a backward inside moecompile.no_sync leaves it: tests/test_no_sync.py)
    for call in (opt.step, lambda: opt.clip_grad_norm_(1.0)):
        with pytest.raises(ValueError, match="ExpertOptimizer.(step|clip_grad_norm_): gradients held by "
                                             "moecompile.no_sync are not reduced yet"):
            call()
    held.held.clear()
    replicated._apply(lambda t: t.clone())  # as a move to another device does: each buffer replaced by a copy
    with pytest.raises(RuntimeError, match="moved after moecompile.parallelize .*'moe_slot_experts'"):
        opt.step()  # else it would re-place the slots by a placement the graph no longer reads


def _replicated(mesh, mine, world, mode, optimizer="adamw", family="mixtral"):
    model = moecompile.parallelize(_build(family).train(), mesh, mine, replication=mode,
                                   slots_per_rank=E // world + 1)
    compiled = torch.compile(model, backend="moe", options={"inner": "aot_eager", "strict": True})
    cls, kwargs = OPTIMIZERS[optimizer]
    return model, compiled, moecompile.ExpertOptimizer(model, cls, **kwargs)


def _train(mesh, rank, world, mode, tmp, optimizer="adamw", family="mixtral", copies=1, explain=False):
    """Three steps against one process with the same torch optimizer; with "adaptive" and SGD, a checkpoint after
    the first (placements change after every step) from which ``_resume`` continues. Returns the state_dict after
    the steps. ``copies``: the mesh's "dp_replicate" size (each copy's group of world / copies ranks replicates
    the experts in its slots, placed by its own routing). ``explain``: also check the report in explain() (a trace
    of its own: a few runs check it)."""
    ref = _build(family).train()
    batches = _batches(ref, world)
    mine, together = batches[rank], batches.flatten(0, 1)
    group = world // copies  # (the expert-parallel group: this rank's copy's)
    S, ep_rank = E // group + 1, rank % group
    model, compiled, opt = _replicated(mesh, mine, group, mode, optimizer, family)
    checkpoint = mode == "adaptive" and optimizer == "sgd"
    what = f"{family} {mode} {optimizer} {copies} copies"
    ckpt = f"{tmp}/ckpt{world}{family}" + (f"_{copies}{mesh.mesh_dim_names[0]}" if copies > 1 else "")
    info = model._moe_parallel
    assert len(info.replicas) == len(info.report.layers) and not info.left, str(info)
    split = "dp_shard" in (mesh.mesh_dim_names or ())  # (replicating layers' slots whole on each copy: said)
    assert not split or all("master part and its optimizer state split over them (1/2 each" in r.sharding
                            for r in info.report.layers), str(info)
    assert not split or "a replicating layer's slots whole on" in str(info), str(info)
    for layer in info.replicas if split else []:  # (each rank of a copy keeps half of its master part)
        part = layer.part
        assert part.master.shape[1] == part.width[part.index] < part.bounds[ep_rank + 1] - part.bounds[ep_rank]
        assert sum(part.width) == part.bounds[ep_rank + 1] - part.bounds[ep_rank], part.width
    slots = {n: p for n, p in model.named_parameters() if getattr(p, "_moe_replicated", False)}
    assert slots and all(p.shape[0] == S * _rows(ref, n) // E for n, p in slots.items())
    cls, kwargs = OPTIMIZERS[optimizer]
    ref_opt = cls(ref.parameters(), **kwargs)
    rows = slice(rank * mine.shape[0], (rank + 1) * mine.shape[0])
    clip = optimizer == "sgd"
    sched, ref_sched = (_schedule(opt), _schedule(ref_opt)) if clip else (None, None)
    logits = []
    for step in range(3):
        out, ref_out = compiled(mine, labels=mine), ref(together, labels=together)
        torch.testing.assert_close(out.logits, ref_out.logits[rows], rtol=TOL, atol=TOL,
                                   msg=lambda m: f"{what} step {step}: {m}")
        logits.append(out.logits.detach())
        out.loss.backward(), ref_out.loss.backward()
        if clip:
            ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM)
            assert ref_norm > MAX_NORM, ref_norm  # (clipping does something)
            torch.testing.assert_close(opt.clip_grad_norm_(MAX_NORM), ref_norm, rtol=TOL, atol=TOL)
            assert [g["lr"] for g in opt.param_groups] == [LR * (1 + step)] * len(opt.param_groups)
        opt.step(), ref_opt.step(), opt.zero_grad(), ref_opt.zero_grad()
        if clip:
            sched.step(), ref_sched.step()
        if step == 0 and checkpoint:
            dcp.save({"model": model.state_dict(), "optim": opt.state_dict()}, checkpoint_id=ckpt)
            saved_sched = sched.state_dict()
    state = model.state_dict()
    for name, p in ref.named_parameters():
        torch.testing.assert_close(_whole(state[name]), p.detach(), rtol=TOL, atol=TOL,
                                   msg=lambda m: f"{what} {name}: {m}")
    placements = [[tuple(h[layer.path]["instances"]) for h in opt.history] for layer in info.replicas]
    _check_stats(model, opt, group, S, mine.numel(), explain)
    for layer, placed in zip(info.replicas, placements):
        assert all(min(p) >= 1 and sum(p) == S * group for p in placed), placed
        if mode == "static":
            assert len(set(placed)) == 1, placed
        else:  # placed by the routing of each step: not the static placement
            static = tuple(torch.bincount(uniform(E, group, S), minlength=E).tolist())
            assert any(p != static for p in placed), placed
        here = layer.placement[ep_rank * S:(ep_rank + 1) * S]  # each slot holds the expert its placement names
        for k, slot in enumerate(layer.slot_parameters()):
            name = next(n for n, p in model.named_parameters() if p is slot)
            whole = _whole(state[name]) if layer.experts is None else torch.stack(  # (a ModuleList's: per expert)
                [_whole(state[f"{name.rpartition('.')[0]}.{rel}"]) for rel in layer.experts[k]])
            want = whole.reshape(E, -1)[here].reshape(slot.shape)
            torch.testing.assert_close(slot.detach(), want, rtol=TOL, atol=TOL, msg=lambda m: f"slots of {name}: {m}")
    if mode == "adaptive" and optimizer == "sgd" and family != "loop":  # and not the same every step, in some
        # layer (AdamW's lr moves the router too little in three steps, and SGD the hand-written model's)
        assert any(len(set(placed)) > 1 for placed in placements), placements
    if copies > 1:  # each copy placed by its own routing; their parts' gradients summed over the copies
        every = [None] * world
        dist.all_gather_object(every, placements)
        assert every[0] != every[group] and every[0] == every[1], every
        moved = "share" if split else "copies"  # ("dp_shard": the shares' reduce-scatter and all-gather)
        assert all(h["bytes"][moved] > 0 for step in opt.history for h in step.values()), opt.history
    held = {n: p.detach().clone() for n, p in model.named_parameters()}
    model.load_state_dict(state)
    assert all(torch.equal(p, held[n]) for n, p in model.named_parameters())
    if checkpoint:
        _resume(mesh, mine, group, ckpt, saved_sched, logits[1:], held, opt, family)
    return state


def _rows(ref, name) -> int:
    """The global dim 0 of a slot weight ``name``: its weight's in ``ref``, or E for a ModuleList's slots
    (``<list>.moe_slots_<weight>``: each expert's weight stacked)."""
    return E if ".moe_slots_" in name else ref.get_parameter(name).shape[0]


def _check_stats(model, opt, world, S, tokens, explain):
    """Each step's history: every rank's routed rows (top-2 of each token), each received by one instance, none
    dropped, the bytes of each phase; the replication report says the same, and with ``explain`` explain() too."""
    for step in opt.history:
        for path, h in step.items():
            assert sum(h["popularity"]) == world * tokens * 2 == sum(h["rows_per_slot"]), h
            assert len(h["rows_per_slot"]) == S * world and h["dropped"] == 0, h
            moved = h["bytes"]  # one rank sends nothing over the network: only the local parts
            assert moved.get("collect", 0) + moved["collect.local"] > 0 and moved["distribute.local"] > 0, h
    text = moecompile.replication_report(model)
    for layer in model._moe_parallel.replicas:
        assert f"{layer.path}: " in text and "rows per instance max" in text and "distribute.local" in text, text
    assert not explain or text in moecompile.explain(model, torch.zeros(1, 4, dtype=torch.long)).parallel


def _resume(mesh, mine, world, ckpt, saved_sched, logits, held, trained_opt, family):
    """A fresh model, ExpertOptimizer and lr schedule load the checkpoint saved after step 1 and run steps 2 and 3
    (clipped): the same logits, parameters, placements and master weights as the uninterrupted run, bit for bit."""
    model, compiled, opt = _replicated(mesh, mine, world, "adaptive", "sgd", family)
    sched = _schedule(opt)
    state = {"model": model.state_dict(), "optim": opt.state_dict()}
    dcp.load(state, checkpoint_id=ckpt)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optim"])
    sched.load_state_dict(saved_sched)
    for step, want in enumerate(logits):
        assert [g["lr"] for g in opt.param_groups] == [LR * (2 + step)] * len(opt.param_groups)
        out = compiled(mine, labels=mine)
        assert torch.equal(out.logits, want), f"resumed step {step + 2}: logits differ"
        out.loss.backward()
        opt.clip_grad_norm_(MAX_NORM)
        opt.step(), opt.zero_grad(), sched.step()
    bad = [n for n, p in model.named_parameters() if not torch.equal(p, held[n])]
    assert not bad, f"resumed parameters differ: {bad}"
    for mine_, theirs in zip(opt.layers, trained_opt.layers):
        assert torch.equal(mine_.placement, theirs.placement) and torch.equal(mine_.part.master, theirs.part.master)


def _worker(rank, world, tmp):
    _init(rank, world, tmp, timeout=60)
    try:
        mesh = (init_device_mesh("cpu", (2, 2), mesh_dim_names=("node", "local")) if world == 4
                else init_device_mesh("cpu", (world,)))
        if world == 4:
            _bad_input(mesh, world)
            adaptive = _train(mesh, rank, world, "adaptive", tmp, explain=True)
            static = _train(mesh, rank, world, "static", tmp)
            for name, value in adaptive.items():  # adaptive against static, directly
                torch.testing.assert_close(_whole(value), _whole(static[name]), rtol=TOL, atol=TOL,
                                           msg=lambda m: f"{name}: {m}")
            _train(mesh, rank, world, "adaptive", tmp, "sgd")
            copies = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "ep"))
            _train(copies, rank, world, "adaptive", tmp, "sgd", copies=2, explain=True)  # each copy's 2 ranks replicate
            initialized_on_meta(copies, rank, world)
            split = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "ep"))  # (its replicating layers
            # whole on each copy, as under "dp_replicate")
            _train(split, rank, world, "adaptive", tmp, "sgd", copies=2)
            _train(split, rank, world, "adaptive", tmp, "adamw", "loop", copies=2)
            beside_split_layers(split, rank, world, tmp)
            in_shares(split, rank, tmp)  # (a transformers checkpoint read in shares)
            initialized_on_meta(split, rank, world)  # (the first copy's instances, into shares)
        else:  # (Mixtral's runs above on a 1-D mesh: test_one_rank_replication)
            _load_saved_on_4(mesh, rank, world, tmp)
            _load_saved_on_4(mesh, rank, world, tmp, "ckpt4mixtral_2dp_shard")  # (saved in shares)
            _train(mesh, rank, world, "adaptive", tmp, "sgd", "dbrx")  # flat [E x ffn, H] expert weights
            _train(mesh, rank, world, "adaptive", tmp, "sgd", "loop", explain=True)  # an nn.ModuleList of experts
            _module_list(mesh, rank, world)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _module_list(mesh, rank, world):
    """A replicated ModuleList layer keeps the model's names in its state_dict (each expert's weight, a DTensor of its
    rows over the ranks' hosts; one process's state_dict loads into it); eagerly each expert's weight reads as a
    meta tensor of its own shape, and its experts refuse to run, naming the fix."""
    ref = _build("loop")
    model, compiled, opt = _replicated(mesh, _batches(ref, world)[rank], world, "adaptive", "sgd", "loop")
    state = model.state_dict()
    assert state.keys() == ref.state_dict().keys(), sorted(set(state) ^ set(ref.state_dict()))[:4]
    piece = state["blocks.0.experts.3.w1.weight"]
    assert isinstance(piece, DTensor) and piece.to_local().shape[0] == piece.shape[0] // world, piece.placements
    with torch.no_grad():
        for p in ref.parameters():
            p.mul_(2)
    model.load_state_dict(ref.state_dict())
    for name, value in model.state_dict().items():
        torch.testing.assert_close(_whole(value), ref.state_dict()[name], rtol=0, atol=0, msg=name)
    for name, p in ref.named_parameters():  # read eagerly, each expert's weight has its own shape (no value)
        if ".experts." in name:
            assert model.get_submodule(name.rpartition(".")[0]).weight.shape == p.shape, name
    with pytest.raises(RuntimeError, match="only run in a graph the moe backend rewrote"):
        model(torch.zeros(1, 4, dtype=torch.long))


def _load_saved_on_4(mesh, rank, world, tmp, saved="ckpt4mixtral"):
    """The checkpoint saved on 4 ranks (3 slots each) loads on 2 (5 slots each): the master weights and momenta
    whole as saved, the experts evenly placed, and training goes on. ``saved="ckpt4mixtral_2dp_shard"``: the one
    saved on (2, 2) ("dp_shard", "ep"), its master parts split in shares over "dp_shard" (5 slots each: the first
    copy's placement taken)."""
    mine = _batches(_build("mixtral"), world)[rank]
    model, compiled, opt = _replicated(mesh, mine, world, "adaptive", "sgd")
    state = {"model": model.state_dict(), "optim": opt.state_dict()}
    dcp.load(state, checkpoint_id=f"{tmp}/{saved}")
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optim"])
    now = model.state_dict()
    for name, value in state["model"].items():
        assert torch.equal(_whole(now[name]), _whole(value)), f"{name} not as saved on 4 ranks"
    mine_now = opt.state_dict()["experts"]
    for path, entry in state["optim"]["experts"].items():
        for key in ("master", "momentum_buffer"):
            for attr, value in entry[key].items():  # per weight
                assert torch.equal(mine_now[path][key][attr].full_tensor(), value.full_tensor()), (path, key, attr)
    for layer in opt.layers:
        want = state["optim"]["placement"][layer.path][0] if "dp_shard" in saved else uniform(E, world, E // world + 1)
        assert torch.equal(layer.placement, torch.as_tensor(want)), (saved, layer.placement)
    out = compiled(mine, labels=mine)
    out.loss.backward()
    opt.step(), opt.zero_grad()


def test_replicated_training_equals_one_process(tmp_path):
    for world in (4, 2):  # world 2 loads world 4's checkpoint
        spawn(_worker, args=(world, str(tmp_path)), nprocs=world)


def test_one_rank_replication(tmp_path):
    """A one-rank mesh runs the same path (what one GPU can check): all instances on the rank, no group."""
    tmp = str(tmp_path)
    _init(0, 1, tmp, timeout=60)
    try:
        mesh = init_device_mesh("cpu", (1,))
        for optimizer in OPTIMIZERS:
            _train(mesh, 0, 1, "adaptive", tmp, optimizer, explain=optimizer == "adamw")
        _train(mesh, 0, 1, "adaptive", tmp, "sgd", "dbrx")  # flat [E x ffn, H] expert weights
        _accumulate(mesh)
        state_before_training(mesh, tmp)
    finally:
        dist.destroy_process_group()


def _accumulate(mesh):
    """Gradient accumulation: a step after two micro-batches places the experts by the routing of both (each
    one's counts, seen alone first, added), then starts the counts anew; zero_grad starts them anew too."""
    batches = _batches(_build("mixtral"), 2)
    model, compiled, opt = _replicated(mesh, batches[0], 1, "adaptive", "sgd")
    alone = []
    for batch in batches:  # each micro-batch's counts alone (no step between: the same routing below)
        compiled(batch, labels=batch).loss.backward()
        alone.append({layer.path: POPULARITY[layer.path].clone() for layer in opt.layers})
        opt.zero_grad()
        assert not any(layer.path in POPULARITY for layer in opt.layers)
    for batch in batches:
        compiled(batch, labels=batch).loss.backward()
    opt.step()
    for layer in opt.layers:
        both = alone[0][layer.path] + alone[1][layer.path]
        assert opt.history[-1][layer.path]["popularity"] == both.tolist()
        assert torch.equal(layer.placement, schedule(both, 1, E + 1)), (layer.placement, both)
        assert layer.path not in POPULARITY
