"""What tests/test_replicate.py runs beside its own: replication beside layers split over "dp_shard", a model built on
meta replicating in two copies of the experts, initialized in place (world 4), and a state taken before training
(one rank)."""

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import moecompile

from test_parallelize import LR, TOL, _batches, _build

MAX_NORM = 0.25  # (the hand-written model's one-process norm is above it at every step)


def beside_split_layers(mesh, rank, world, tmp):
    """On (2, 2) ("dp_shard", "ep"), the ModuleList model's first layer with a frozen expert weight (sharded without
    replication, its weights split over "dp_shard") and its second replicating (whole on each copy): ExpertOptimizer
    with SGD and clip_grad_norm_ trains four steps as one process does (the norm counts the split pieces once), the
    last by a fresh ExpertOptimizer that loaded the first's torch.distributed.checkpoint (momentum of both kinds)."""
    def built():
        model = _build("loop").train()
        model.blocks[0].experts[1].w3.weight.requires_grad_(False)
        return model

    ref, model = built(), built()
    batches = _batches(ref, world)
    mine, together = batches[rank], batches.flatten(0, 1)
    moecompile.parallelize(model, mesh, mine, replication="adaptive", slots_per_rank=5)
    info = model._moe_parallel
    first, second = info.report.layers
    assert "not replicated" in first.sharding and "split over 2 ranks ('dp_shard'" in first.sharding, str(info)
    assert "slots whole" in second.sharding and "split over them (1/2" in second.sharding, str(info)
    assert "1/4 of each expert on each rank's host" in second.sharding and len(info.replicas) == 1, str(info)
    compiled = torch.compile(model, backend="moe", options={"inner": "aot_eager", "strict": True})
    opt = moecompile.ExpertOptimizer(model, torch.optim.SGD, lr=LR, momentum=0.9)
    ref_opt = torch.optim.SGD([p for p in ref.parameters() if p.requires_grad], lr=LR, momentum=0.9)
    rows = slice(rank * mine.shape[0], (rank + 1) * mine.shape[0])
    for step in range(4):
        if step == 3:  # (a fresh optimizer, its state from the checkpoint)
            dcp.save({"optim": opt.state_dict()}, checkpoint_id=f"{tmp}/split_optim")
            opt = moecompile.ExpertOptimizer(model, torch.optim.SGD, lr=LR, momentum=0.9)
            state = {"optim": opt.state_dict()}
            dcp.load(state, checkpoint_id=f"{tmp}/split_optim")
            opt.load_state_dict(state["optim"])
        out, ref_out = compiled(mine, labels=mine), ref(together, labels=together)
        torch.testing.assert_close(out.logits, ref_out.logits[rows], rtol=TOL, atol=TOL, msg=lambda m: f"{step}: {m}")
        out.loss.backward(), ref_out.loss.backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM)
        assert ref_norm > MAX_NORM, ref_norm  # (clipping does something)
        torch.testing.assert_close(opt.clip_grad_norm_(MAX_NORM), ref_norm, rtol=TOL, atol=TOL)
        opt.step(), ref_opt.step(), opt.zero_grad(), ref_opt.zero_grad()
    state = moecompile.full_state_dict(model)  # (the sharded layer's experts: each rank's own in its state_dict)
    for name, p in ref.named_parameters():
        torch.testing.assert_close(state[name], p.detach(), rtol=TOL, atol=TOL, msg=lambda m: f"{name}: {m}")


def initialized_on_meta(mesh, rank, world):
    """On (2, 2) ("dp_replicate", "ep") or ("dp_shard", "ep") (the master parts in shares): Mixtral built on meta,
    replicating, each rank's ``init_weights()`` drawing other values: ExpertOptimizer gives every instance of an
    expert, in both copies, the first copy's first instance's draw (the experts' whole weights the same on every
    rank), and a step runs."""
    from test_meta_init import OPTIONS, _build as meta_build

    ids = torch.randint(1, 64, (world, 2, 6), generator=torch.Generator().manual_seed(7))
    model = moecompile.parallelize(meta_build("mixtral", on_meta=True), mesh, ids[rank], replication="adaptive",
                                   slots_per_rank=5).to_empty(device="cpu")
    torch.manual_seed(100 + rank)
    model.init_weights()
    opt = moecompile.ExpertOptimizer(model, torch.optim.SGD, lr=LR)
    whole = moecompile.full_state_dict(model)["model.layers.0.mlp.experts.down_proj"]
    every = [torch.empty_like(whole) for _ in range(world)]
    dist.all_gather(every, whole)
    assert all(torch.equal(w, whole) for w in every), "the copies' experts differ"
    local, placement = mesh["ep"].get_local_rank(), model._moe_parallel.replicas[0].placement
    torch.testing.assert_close(model.model.layers[0].mlp.experts.down_proj, whole[placement[local * 5:][:5]], rtol=0,
                               atol=0)
    torch.compile(model, backend="moe", options=OPTIONS)(ids[rank], labels=ids[rank]).loss.backward()
    opt.step()


def state_before_training(mesh, tmp):
    """An optimizer (AdamW) that gives its state before any step (an initial checkpoint; accelerate's round trip,
    ``load_state_dict(state_dict())``) keeps no state, and trains bit for bit as one that did not; so does one that
    loads that initial checkpoint. (Kept, the state a zero step makes counted in Adam's bias correction.) An
    ExpertOptimizer of replicated experts, and torch's AdamW of a sharded model through
    ``moecompile.get_optimizer_state_dict`` / ``set_optimizer_state_dict`` (the state saved with step 0)."""
    batch = _batches(_build("mixtral"), 1)[0]
    for replicated in (True, False):
        runs = []
        for how in ("plain", "saved", "loaded"):
            model, opt = _adamw(mesh, batch, replicated)
            compiled = torch.compile(model, backend="moe", options={"inner": "aot_eager", "strict": True})
            if how != "plain":
                state = {"optim": _state(model, opt)}
                assert state["optim"]["experts" if replicated else "state"]  # (what a checkpoint loads into)
                if how == "saved":
                    dcp.save(state, checkpoint_id=f"{tmp}/before_training{replicated}")
                    _load(model, opt, _state(model, opt))
                else:
                    dcp.load(state, checkpoint_id=f"{tmp}/before_training{replicated}")
                    _load(model, opt, state["optim"])
                if replicated:
                    assert not opt.experts.state and not opt.dense.state, how
                else:  # (torch's AdamW loads the state it was given: step 0, zero moments)
                    assert opt.state and all(float(s["step"]) == 0 for s in opt.state.values()), how
            for _ in range(2):
                compiled(batch, labels=batch).loss.backward()
                opt.step(), opt.zero_grad()
            runs.append([p.detach().clone() for p in model.parameters()] + [
                layer.part.master for layer in (opt.layers if replicated else [])])
        for how, run in zip(("saved", "loaded"), runs[1:]):
            assert all(torch.equal(a, b) for a, b in zip(run, runs[0])), (how, replicated)


def _adamw(mesh, batch, replicated):
    model = _build("mixtral").train()
    if replicated:
        moecompile.parallelize(model, mesh, batch, replication="adaptive", slots_per_rank=9)
        return model, moecompile.ExpertOptimizer(model, torch.optim.AdamW, lr=1e-2)
    moecompile.parallelize(model, mesh, batch)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _state(model, opt):
    return opt.state_dict() if isinstance(opt, moecompile.ExpertOptimizer) else \
        moecompile.get_optimizer_state_dict(model, opt)


def _load(model, opt, state):
    if isinstance(opt, moecompile.ExpertOptimizer):
        opt.load_state_dict(state)
    else:
        moecompile.set_optimizer_state_dict(model, opt, state)
