"""Checks of tests/test_parallelize.py on sharded models after expert swaps, and the checkpoints they save for the
parent process to load: the state_dict and the optimizer's state (moecompile.get_optimizer_state_dict, in expert
order) equal one process's, round-trip exactly, and are saved with torch.distributed.checkpoint beside the whole
tensors each load must find."""

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict as torch_optimizer_state
from torch.distributed.tensor import DTensor

import moecompile

TOL = 1e-5  # fp32: every distributed run against one process


def check_after_swaps(model, ref, opt, ref_opt, rank, tmp, family):
    """Experts were swapped, each swap lowering the predicted time; the state_dict (expert order: DTensors of
    stacked and flat weights, this rank's experts of a ModuleList under their experts' names) equals the
    one-process parameters; a round trip leaves each rank's rows as they are; a checkpoint is saved (the parent
    loads it in one process); so is the optimizer's."""
    swap = model._moe_parallel.swap
    assert swap.history, f"{family}: no expert was swapped"
    assert all(after < before for *_, before, after in swap.history), swap.history
    state = model.state_dict()
    full = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in state.items()}
    every = dict(ref.named_parameters())
    assert len(set(full) & set(every)) == len(list(model.named_parameters(remove_duplicate=False))), sorted(full)
    for name in set(full) & set(every):
        torch.testing.assert_close(full[name], every[name].detach(), rtol=TOL, atol=TOL,
                                   msg=lambda m: f"{family} after swaps {name}: {m}")
    held = {n: p.detach().clone() for n, p in model.named_parameters()}
    model.load_state_dict(state)
    assert all(torch.equal(p, held[n]) for n, p in model.named_parameters())
    dcp.save(state, checkpoint_id=f"{tmp}/ckpt_swap_{family}")
    every_rank = [None] * dist.get_world_size()
    dist.all_gather_object(every_rank, full)
    if rank == 0:
        torch.save({k: v for part in every_rank for k, v in part.items()}, f"{tmp}/saved_swap_{family}.pt")
    optimizer_state_after_swaps(model, ref, opt, ref_opt, rank, tmp, family)


def optimizer_state_after_swaps(model, ref, opt, ref_opt, rank, tmp, family):
    """moecompile.get_optimizer_state_dict gives each expert's momentum in expert order (a DTensor of a stacked
    weight's, each ModuleList expert's on its rank under its expert's name): equal to the one-process momentum;
    it round-trips through set_optimizer_state_dict to the same rows in their slots, one process's state (torch's)
    loads exactly, and its torch.distributed.checkpoint loads in one process (the parent checks, for Mixtral)."""
    state = moecompile.get_optimizer_state_dict(model, opt)
    full = {}
    every = dict(ref.named_parameters())
    assert len(state["state"]) == len(list(model.parameters())) and set(state["state"]) <= set(every)
    stacked = {n for n, p in model.named_parameters() if getattr(p, "_moe_sharded", False)}
    for name, value in state["state"].items():
        momentum = value["momentum_buffer"]
        sharded = isinstance(momentum, DTensor)
        assert sharded == (name in stacked), name
        full[name] = momentum.full_tensor() if sharded else momentum
        torch.testing.assert_close(full[name], ref_opt.state[every[name]]["momentum_buffer"], rtol=TOL, atol=TOL,
                                   msg=lambda m: f"{family}: momentum of {name}: {m}")
    held = {n: opt.state[p]["momentum_buffer"].clone() for n, p in model.named_parameters()}
    for p in model.parameters():  # new tensors: the state dict may hold the optimizer's own
        opt.state[p]["momentum_buffer"] = torch.zeros_like(p)
    step = {n: torch.tensor(3.0) for n in state["state"]}  # a scalar beside the rows (as Adam's step count)
    moecompile.set_optimizer_state_dict(model, opt, {**state, "state": {n: {**s, "step": step[n]}
                                                                       for n, s in state["state"].items()}})
    bad = [n for n, p in model.named_parameters() if not torch.equal(opt.state[p]["momentum_buffer"], held[n])
           or float(opt.state[p]["step"]) != 3.0]
    assert not bad, f"momentum or step not restored by set_optimizer_state_dict: {bad}"
    one = torch_optimizer_state(ref, ref_opt)  # one process's state, every expert's: each rank takes its own
    moecompile.set_optimizer_state_dict(model, opt, one)
    for name, value in moecompile.get_optimizer_state_dict(model, opt)["state"].items():
        momentum = value["momentum_buffer"]
        momentum = momentum.full_tensor() if isinstance(momentum, DTensor) else momentum
        assert torch.equal(momentum, one["state"][name]["momentum_buffer"]), f"{family}: one process's {name}"
    if family == "mixtral":
        dcp.save(state, checkpoint_id=f"{tmp}/ckpt_swap_optim")
        if rank == 0:
            torch.save(full, f"{tmp}/saved_swap_optim.pt")
    optimizer_round_trip(model, opt, f"{tmp}/ckpt_swap_optim_{family}")


def cloned(state):
    """A nested state dict whose tensors are copies of ``state``'s (DTensors too), not the optimizer's own."""
    if isinstance(state, dict):
        return {key: cloned(value) for key, value in state.items()}
    if isinstance(state, list):
        return [cloned(value) for value in state]
    if isinstance(state, DTensor):
        return DTensor.from_local(state.to_local().clone(), state.device_mesh, state.placements, run_check=False,
                                  shape=state.shape, stride=state.stride())
    return state.clone() if isinstance(state, torch.Tensor) else state


def optimizer_round_trip(model, opt, where):
    """The optimizer's state (``moecompile.get_optimizer_state_dict``) saved with torch.distributed.checkpoint by
    every rank loads back on the same ranks into an optimizer whose state was zeroed: every rank's state exactly
    (each rank's parameter groups name other parameters, a ModuleList's experts or another pipeline stage's: the
    checkpoint keeps one list of them)."""
    dcp.save(moecompile.get_optimizer_state_dict(model, opt), checkpoint_id=where)
    held = {p: {k: v.clone() for k, v in s.items()} for p, s in opt.state.items()}
    assert held, "the optimizer holds no state to check"
    for s in opt.state.values():
        for v in s.values():
            v.zero_()
    state = cloned(moecompile.get_optimizer_state_dict(model, opt))  # (DCP loads into copies, not opt's own tensors:
    dcp.load(state, checkpoint_id=where)  # set_optimizer_state_dict must bring every state in)
    moecompile.set_optimizer_state_dict(model, opt, state)
    bad = [k for p, s in held.items() for k, v in s.items() if not torch.equal(opt.state[p][k], v)]
    assert not bad, f"{len(bad)} states not restored from the checkpoint"


def loads_in_one_process(one, tmp, ckpt, saved):
    """The torch.distributed.checkpoint ``ckpt`` (saved by several ranks) loaded into ``one`` (a model of one
    process, no process group) gives exactly the parameters in ``saved`` (``save``'s whole state)."""
    state = one.state_dict()
    dcp.load(state, checkpoint_id=f"{tmp}/{ckpt}")
    one.load_state_dict(state)
    whole = torch.load(f"{tmp}/{saved}")
    for name, p in one.named_parameters():
        torch.testing.assert_close(p, whole[name], rtol=0, atol=0, msg=f"{ckpt}: {name}")


def optimizer_loads_in_one_process(one, tmp, lr):
    """The optimizer checkpoint saved on 4 ranks after expert swaps loads, in expert order, into an SGD optimizer of
    ``one`` (a model of one process): every momentum exactly as saved."""
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    opt = torch.optim.SGD(one.parameters(), lr=lr, momentum=0.9)
    state = torch_optimizer_state(one, opt)  # initialises the state (a zero step), so the load has its keys
    dcp.load(state, checkpoint_id=f"{tmp}/ckpt_swap_optim")
    set_optimizer_state_dict(one, opt, state)
    saved = torch.load(f"{tmp}/saved_swap_optim.pt")
    for name, p in one.named_parameters():
        torch.testing.assert_close(opt.state[p]["momentum_buffer"], saved[name], rtol=0, atol=0, msg=name)


def save(model, tmp, rank, family):
    """A torch.distributed.checkpoint of the model, and (rank 0) the whole state as plain tensors: what each load
    must find, exactly."""
    state = model.state_dict()
    dcp.save(state, checkpoint_id=f"{tmp}/ckpt_{family}")
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in state.items()})
    if rank == 0:
        torch.save({k: v for part in every for k, v in part.items()}, f"{tmp}/saved_{family}.pt")
