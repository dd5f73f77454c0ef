"""``moecompile.expert_zero_optimizer(model, torch.optim.AdamW, lr=...)``: ZeRO-1 of the experts over the copies
of a ``"dp_replicate"`` mesh dimension, with torch's ``ZeroRedundancyOptimizer``.

Under ``"dp_replicate"`` every copy's rank holds the same experts and, once backward ends, the same averaged
gradients (``grads.py``); a plain optimizer on each would hold the experts' whole state on every copy. Here each
expert weight is stepped on one rank of its copies, which alone holds its state, and broadcast to the others:
the state of 1 / copies of the experts' parameters a rank (torch partitions whole tensors: the largest first, each
to the rank holding least). The planner prices it so (``docs/planner.md``). The dense parameters are the caller's
(FSDP2, or an optimizer of their own).

Checkpoints: ``moecompile.get_optimizer_state_dict(model, opt)`` gives each rank's state as a plain optimizer's
(``sharded_state.py``): the weights this rank steps, each state tensor a DTensor of the global weight's shape, so a
``torch.distributed.checkpoint`` of it holds every expert's state once, loads back with
``set_optimizer_state_dict`` into any number of copies (each rank keeping its own part), into a plain optimizer,
and in one process. (torch's own ``consolidate_state_dict`` and ``state_dict`` still work: one rank's whole copy.)
"""

from __future__ import annotations

import contextlib

import torch
from torch.distributed.optim import ZeroRedundancyOptimizer

from .mesh import REPLICATE, SHARD


def local(optimizer):
    """The optimizer that holds this rank's state: a ``ZeroRedundancyOptimizer``'s own (``.optim``), else itself."""
    return optimizer.optim if isinstance(optimizer, ZeroRedundancyOptimizer) else optimizer


@contextlib.contextmanager
def state_made(optimizer):
    """While inside, the state of ``optimizer`` (``local``'s) is made if it has not stepped: by a step with zero
    gradients and lr 0, as ``torch.distributed.checkpoint`` makes it, so that a checkpoint loads into it, its step
    counts set back to 0 (Adam's zero moments at step 0 step as no state does; SGD's zero momentum buffer does so only
    without ``dampening``). After, a fresh optimizer holds none again (a state dict taken inside keeps it): torch's
    keeps it, and its step counts in Adam's bias correction, so an initial checkpoint would change the first update."""
    from torch.distributed.checkpoint.state_dict import _init_optim_state

    own = local(optimizer)
    fresh = not own.state
    _init_optim_state(own)
    for state in own.state.values() if fresh else ():
        if "step" in state:
            step = state["step"]
            state["step"] = torch.zeros_like(step) if isinstance(step, torch.Tensor) else 0
    try:
        yield
    finally:
        if fresh:
            own.state.clear()


def state_dict(optimizer) -> dict:
    """``optimizer.state_dict()``; for a ``ZeroRedundancyOptimizer`` (whose own needs the state consolidated on one
    rank) the same form without a collective: every parameter's index and the groups' hyperparameters as its own
    (what an LR schedule sets), the state of those this rank steps."""
    if not isinstance(optimizer, ZeroRedundancyOptimizer):
        return optimizer.state_dict()
    index = {p: i for i, p in enumerate(_params(optimizer))}
    return {"state": {index[p]: s for p, s in optimizer.optim.state.items() if s},
            "param_groups": [{**g, "params": [index[p] for p in g["params"]]} for g in optimizer.param_groups]}


def load_state_dict(optimizer, saved: dict) -> None:
    """``optimizer.load_state_dict(saved)``; for a ``ZeroRedundancyOptimizer``, ``saved`` as ``state_dict`` gives it
    (or a whole one: the state of the weights other ranks step is left to them): this rank's state into its own
    optimizer, the hyperparameters into both."""
    if not isinstance(optimizer, ZeroRedundancyOptimizer):
        return optimizer.load_state_dict(saved)
    params, own = _params(optimizer), optimizer.optim
    mine = {p: i for i, p in enumerate(_params(own))}
    state = {mine[params[i]]: v for i, v in saved["state"].items() if params[i] in mine}
    groups = [{**g, "params": [mine[p] for p in g_own["params"]]} for g, g_own in zip(saved["param_groups"],
                                                                                      own.param_groups)]
    own.load_state_dict({"state": state, "param_groups": groups})
    for g, g_own in zip(optimizer.param_groups, own.param_groups):  # (what ZeroRedundancyOptimizer reads at a step)
        g.update((k, v) for k, v in g_own.items() if k != "params")


def _params(optimizer) -> list:
    """The optimizer's parameters in its groups' order: the indices of its state_dict."""
    return [p for g in optimizer.param_groups for p in g["params"]]


def expert_zero_optimizer(model, optimizer_class, **kwargs) -> ZeroRedundancyOptimizer:
    """A ``ZeroRedundancyOptimizer`` of ``optimizer_class(**kwargs)`` over the expert weights ``moecompile.
    parallelize`` gave this rank (in the model's order, the same on every copy), partitioned over its
    ``"dp_replicate"`` group. ``model``: the model, or the list of stage modules this rank runs (an interleaved
    pipeline schedule's, each parallelized on the same mesh: one optimizer over their experts, in the list's order).
    ValueError, naming the fix, for a model with nothing to partition so."""
    from .sharded_state import parts_of, unwrapped
    from .views import expert_parameters

    held = list(model) if isinstance(model, (list, tuple)) else [model]
    if not held or any(getattr(unwrapped(m), "_moe_parallel", None) is None for m in held):
        raise ValueError("expert_zero_optimizer(model, ...) steps the experts moecompile.parallelize sharded: call it "
                         "after moecompile.parallelize(model, mesh, ...)")
    parts, infos = parts_of(held)
    info = infos[0]
    names = info.mesh.mesh_dim_names or ()
    if REPLICATE not in names or SHARD in names:
        raise ValueError(f"expert_zero_optimizer partitions the experts' optimizer state over the copies of a "
                         f"{REPLICATE!r} mesh dimension (each copy whole); this model's mesh names {names}: "
                         + (f"under {SHARD!r} the state is split with the weights already, use a plain optimizer"
                            if SHARD in names else f"add an outermost {REPLICATE!r} dimension, or use a plain "
                                                   "optimizer (one copy of each expert: nothing to partition)"))
    if any(i.replicas for i in infos):
        raise ValueError("this model's experts replicate (parallelize(..., replication=...)): moecompile."
                         "ExpertOptimizer keeps their state on the hosts; use it instead")
    if any(i.swap is not None for i in infos):  # (a swap moves the state with the rows, on every rank of the copy)
        raise ValueError("this model swaps experts (parallelize(..., swap_every=N)): a swap moves each expert's "
                         "optimizer state with its weights, which ZeRO-1 keeps on one copy's rank only; use "
                         "swap_every=0, or a plain optimizer")
    if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)):
        raise ValueError(f"optimizer_class must be a torch.optim.Optimizer class (torch.optim.AdamW...); got "
                         f"{optimizer_class!r}")
    experts = set().union(*(expert_parameters(m) for m in held))
    params = [p for part in parts for p in part.parameters() if p in experts and p.requires_grad]
    return ZeroRedundancyOptimizer(params, optimizer_class, process_group=info.mesh[REPLICATE].get_group(), **kwargs)
