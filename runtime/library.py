"""How every ``moe::`` op is defined: ``moe_op`` is ``torch.library.custom_op`` with the op tagged
``cudagraph_unsafe``.

Under CUDA graphs (``torch.compile(..., mode="reduce-overhead")``, the option ``mode``) Inductor runs such ops
between the graphed parts of a graph, never inside a captured graph. Ours may read sizes back to the host (row
counts of the routing, an exchange's split sizes), launch kernels sized by the routing, exchange over gloo or
tune tiles at a first launch, none of which a captured graph replays; so all of them are tagged, and the rest of
the model (attention, norms, the MoE layer's own elementwise work) is graphed around them. A torch without the
tag, or whose ``custom_op`` takes no tags (older than 2.8), gets the ops untagged.

``asked`` and ``wanted``: which gradients a backward op computes, from its ``needs`` flags (read from
``ctx.needs_input_grad``).
"""

from __future__ import annotations

import inspect

import torch
from torch.library import custom_op

CUDAGRAPH_UNSAFE = tuple(t for t in (getattr(torch.Tag, "cudagraph_unsafe", None),) if t is not None)
_TAGS = {"tags": CUDAGRAPH_UNSAFE} if CUDAGRAPH_UNSAFE and "tags" in inspect.signature(custom_op).parameters else {}


def moe_op(name: str, *, mutates_args, **kwargs):
    """``torch.library.custom_op(name, mutates_args=..., ...)`` (a decorator), the op tagged cudagraph-unsafe."""
    return custom_op(name, mutates_args=mutates_args, **_TAGS, **kwargs)


def asked(ctx, positions) -> list[bool]:
    """``ctx.needs_input_grad`` at ``positions`` of an op's arguments: False past the arguments passed (trailing
    ones left to their defaults), and for a list of tensors whether any of them needs a gradient."""
    asks = ctx.needs_input_grad
    return [i < len(asks) and (any(asks[i]) if isinstance(asks[i], (list, tuple)) else bool(asks[i]))
            for i in positions]


def wanted(tensors, needs) -> list[int]:
    """Positions of the gradients a backward op returns: its present tensors (not None), of those the ``needs``
    flags (one per tensor, as ``ctx.needs_input_grad`` gives them; None: all) ask for. A frozen weight's gradient
    is not computed: autograd would drop it."""
    if needs is not None and len(needs) != len(tensors):
        raise ValueError(f"needs has {len(needs)} flags for {len(tensors)} inputs")
    return [i for i, t in enumerate(tensors) if t is not None and (needs is None or needs[i])]
