"""How every ``moe::`` op is defined: ``moe_op`` is ``torch.library.custom_op`` with the op tagged
``cudagraph_unsafe``.

Under CUDA graphs (``torch.compile(..., mode="reduce-overhead")``, the option ``mode``) Inductor runs such ops
between the graphed parts of a graph, never inside a captured graph. Ours may read sizes back to the host (row
counts of the routing, an exchange's split sizes), launch kernels sized by the routing, exchange over gloo or
tune tiles at a first launch, none of which a captured graph replays; so all of them are tagged, and the rest of
the model (attention, norms, the MoE layer's own elementwise work) is graphed around them. A torch without the tag
(older than Inductor's graph partitions) gets the ops untagged.
"""

from __future__ import annotations

import torch
from torch.library import custom_op

CUDAGRAPH_UNSAFE = tuple(t for t in (getattr(torch.Tag, "cudagraph_unsafe", None),) if t is not None)


def moe_op(name: str, *, mutates_args, **kwargs):
    """``torch.library.custom_op(name, mutates_args=..., ...)`` (a decorator), the op tagged cudagraph-unsafe."""
    return custom_op(name, mutates_args=mutates_args, tags=CUDAGRAPH_UNSAFE, **kwargs)
