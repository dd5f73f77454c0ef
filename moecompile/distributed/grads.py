"""Data-parallel gradients of a model ``moecompile.parallelize`` sharded: what each rank's backward leaves in
``.grad`` so that every parameter holds the gradient of the mean loss over the data-parallel batches, as one
process training on all of them would.

    replicated parameters   each backward's incoming gradients are held back (the parameter accumulates zeros),
                            all-reduced together over the data-parallel group when backward ends, averaged, then
                            accumulated (gradient accumulation over several backwards stays right, as DDP's)
    sharded experts         summed over every rank that routed rows to them already (the exchange's backward):
                            divided by the number of ranks whose rows repeat the same batch's tokens' share

On a mesh with a ``"tp"`` dimension the data-parallel group is the ranks of the other dimensions: the ranks of one
tp group see the same tokens, so their replicated gradients are equal (a replicated tensor's gradient is whole on
every tp rank, as tensor parallelism keeps it, and a sequence-sharded MoE block gives whole gradients back too:
``runtime/comm/tp.py``), and averaging over dp alone is the mean. Expert divisors: the dp size where each token
reaches its experts once over the tp group (``moe_tp="ssmb"``), the mesh size where every tp rank routes all its
tokens (``"off"``: each token's rows arrive tp times).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


def sync_gradients(model: nn.Module, expert_divisors: dict[str, int], group, size: int) -> None:
    """Register the hooks: ``expert_divisors`` maps the name of each sharded expert parameter held here to what its
    gradient is divided by; every other parameter that requires a gradient is averaged over ``group`` (``size``
    ranks; None or 1: nothing to average)."""
    replicated = [p for n, p in model.named_parameters() if n not in expert_divisors and p.requires_grad]
    pending: dict[int, torch.Tensor] = {}

    def finish():
        grads = [pending.pop(id(p), None) for p in replicated]
        flat = torch.cat([(g if g is not None else torch.zeros_like(p)).reshape(-1) for g, p in zip(grads, replicated)])
        dist.all_reduce(flat, group=group)
        flat /= size
        offset = 0
        for p in replicated:
            g = flat[offset:offset + p.numel()].view_as(p)
            offset += p.numel()
            p.grad = g.clone() if p.grad is None else p.grad + g

    def hold(p):
        def hook(grad):
            if not pending:
                torch.autograd.Variable._execution_engine.queue_callback(finish)
            pending[id(p)] = grad.detach().clone() if id(p) not in pending else pending[id(p)] + grad
            return torch.zeros_like(grad)
        return hook

    if size > 1:
        for p in replicated:
            p.register_hook(hold(p))
    for n, p in model.named_parameters():
        divisor = expert_divisors.get(n, 1)
        if divisor > 1 and p.requires_grad:
            p.register_hook(lambda grad, d=divisor: grad / d)
