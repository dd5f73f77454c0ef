"""``moecompile.expert_zero_optimizer(model, torch.optim.AdamW, lr=...)``: ZeRO-1 of the experts over the copies
of a ``"dp_replicate"`` mesh dimension, with torch's ``ZeroRedundancyOptimizer``.

Under ``"dp_replicate"`` every copy's rank holds the same experts and, once backward ends, the same averaged
gradients (``grads.py``); a plain optimizer on each would hold the experts' whole state on every copy. Here each
expert weight is stepped on one rank of its copies, which alone holds its state, and broadcast to the others:
the state of 1 / copies of the experts' parameters a rank (torch partitions whole tensors: the largest first, each
to the rank holding least). The planner prices it so (``docs/planner.md``). The dense parameters are the caller's
(FSDP2, or an optimizer of their own); checkpoint it as torch's: ``consolidate_state_dict(to)``, then
``state_dict()`` on that rank of the group, ``load_state_dict`` on every rank.
"""

from __future__ import annotations

import torch
from torch.distributed.optim import ZeroRedundancyOptimizer

from .mesh import REPLICATE, SHARD


def expert_zero_optimizer(model, optimizer_class, **kwargs) -> ZeroRedundancyOptimizer:
    """A ``ZeroRedundancyOptimizer`` of ``optimizer_class(**kwargs)`` over the expert weights ``moecompile.
    parallelize`` gave this rank (in the model's order, the same on every copy), partitioned over its
    ``"dp_replicate"`` group. ValueError, naming the fix, for a model with nothing to partition so."""
    from .sharded_state import unwrapped
    from .views import expert_parameters

    info = getattr(model, "_moe_parallel", None)
    if info is None:
        raise ValueError("expert_zero_optimizer(model, ...) steps the experts moecompile.parallelize sharded: call it "
                         "after moecompile.parallelize(model, mesh, ...)")
    names = info.mesh.mesh_dim_names or ()
    if REPLICATE not in names or SHARD in names:
        raise ValueError(f"expert_zero_optimizer partitions the experts' optimizer state over the copies of a "
                         f"{REPLICATE!r} mesh dimension (each copy whole); this model's mesh names {names}: "
                         + (f"under {SHARD!r} the state is split with the weights already, use a plain optimizer"
                            if SHARD in names else f"add an outermost {REPLICATE!r} dimension, or use a plain "
                                                   "optimizer (one copy of each expert: nothing to partition)"))
    if info.replicas:
        raise ValueError("this model's experts replicate (parallelize(..., replication=...)): moecompile."
                         "ExpertOptimizer keeps their state on the hosts; use it instead")
    if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)):
        raise ValueError(f"optimizer_class must be a torch.optim.Optimizer class (torch.optim.AdamW...); got "
                         f"{optimizer_class!r}")
    experts = expert_parameters(model)
    params = [p for p in unwrapped(model).parameters() if p in experts and p.requires_grad]
    return ZeroRedundancyOptimizer(params, optimizer_class, process_group=info.mesh[REPLICATE].get_group(), **kwargs)
