"""Data-parallel gradients of a model ``moecompile.parallelize`` sharded: what each rank's backward leaves in
``.grad`` so that every parameter holds the gradient of the mean loss over the data-parallel batches, as one
process training on all of them would.

    replicated parameters   each backward's incoming gradients are held back (the parameter accumulates zeros),
                            all-reduced together over the data-parallel group when backward ends, averaged, then
                            accumulated (gradient accumulation over several backwards stays right, as DDP's);
                            those FSDP2's ``fully_shard`` took over later are left to it (no second reduction)
    sharded experts         summed over every rank that routed rows to them already (the exchange's backward):
                            divided by the number of ranks whose rows repeat the same batch's tokens' share

Experts held by several ranks (a mesh's ``"dp_replicate"`` dimension: each expert-parallel group holds every
expert) are held back the same way and summed over those ranks, then divided by the copies times their divisor.

A tensor-parallel weight (a DTensor: torch's ``parallelize_module``) is averaged by its local shard, over the
data-parallel group, whose ranks hold the same shard. On a mesh with a ``"tp"`` dimension the data-parallel group is
the ranks of the other dimensions: the ranks of one tp group see the same tokens, so their replicated gradients are
equal (a replicated tensor's gradient is whole on every tp rank, as tensor parallelism keeps it, and a
sequence-sharded MoE block gives whole gradients back too: ``runtime/comm/tp.py``), and averaging over dp alone is
the mean. Expert divisors: the dp size where each token reaches its experts once over the tp group
(``moe_tp="ssmb"``), the mesh size where every tp rank routes all its tokens (``"off"``: each token's rows arrive tp
times).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


def sync_gradients(model: nn.Module, expert_divisors: dict[str, int], group, size: int, expert_group=None,
                   copies: int = 1) -> None:
    """Register the hooks: ``expert_divisors`` maps the name of each sharded expert parameter held here to what its
    gradient is divided by; every other parameter that requires a gradient is averaged over ``group`` (``size``
    ranks; None or 1: nothing to average). ``copies`` > 1: each expert is held by that many ranks (``expert_group``,
    a mesh's ``"dp_replicate"``): its gradient is averaged over them too."""
    experts = {n: p for n, p in model.named_parameters() if n in expert_divisors and p.requires_grad}
    replicated = [p for n, p in model.named_parameters() if n not in expert_divisors and p.requires_grad]
    if size > 1:
        _average_at_end(model, replicated, group, {id(p): size for p in replicated})
    if copies > 1:  # the divisor applied after the sum over the copies
        _average_at_end(model, list(experts.values()), expert_group,
                        {id(p): copies * expert_divisors[n] for n, p in experts.items()})
        return
    for n, p in experts.items():
        if expert_divisors[n] > 1:
            p.register_hook(lambda grad, d=expert_divisors[n]: None if grad is None else grad / d)


def _average_at_end(model: nn.Module, params: list, group, divisor: dict[int, int]) -> None:
    """Each backward's incoming gradients of ``params`` held back (the parameter accumulates zeros), summed over
    ``group`` in one all-reduce when backward ends, divided by ``divisor[id(p)]``, then accumulated. A parameter
    to which no rank's backward sent a gradient (a routing bias that only chooses experts: its hook gets None) keeps
    its ``.grad`` as it was, as in one process: the all-reduce carries, beside the gradients, how many ranks had
    one for each parameter (a rank without one sends zeros, so the ranks' reductions keep the same size), read back
    to the host once per backward."""
    pending: dict[int, torch.Tensor] = {}

    def finish():
        live = {id(p) for p in model.parameters()}  # FSDP2 replaced the ones it manages: its to reduce
        mine = [p for p in params if id(p) in live]
        grads = [pending.pop(id(p), None) for p in mine]
        pending.clear()
        if not mine:
            return
        had = torch.tensor([g is not None for g in grads], dtype=mine[0].dtype, device=_local(mine[0]).device)
        flat = torch.cat([_local(g if g is not None else torch.zeros_like(p)).reshape(-1)
                          for g, p in zip(grads, mine)] + [had])
        dist.all_reduce(flat, group=group)
        offset, sent = 0, flat[-len(mine):].tolist()
        for p, ranks in zip(mine, sent):
            local = _local(p)
            g = _like(p, flat[offset:offset + local.numel()].view_as(local) / divisor[id(p)])
            offset += local.numel()
            if ranks:
                p.grad = g if p.grad is None else p.grad + g

    def hold(p):
        def hook(grad):
            if grad is None:  # nothing flows to it in this backward
                return None
            if not pending:
                torch.autograd.Variable._execution_engine.queue_callback(finish)
            pending[id(p)] = grad.detach().clone() if id(p) not in pending else pending[id(p)] + grad
            return torch.zeros_like(grad)
        return hook

    for p in params:
        p.register_hook(hold(p))


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor (a tensor-parallel weight or its gradient); a plain tensor as it is."""
    return t.to_local() if hasattr(t, "to_local") else t


def _like(p: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """``local`` as a gradient of ``p``: a DTensor with ``p``'s mesh and placements where ``p`` is one."""
    if not hasattr(p, "to_local"):
        return local
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(local, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())
