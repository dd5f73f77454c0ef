"""Where a detected router's MoE block lies in the graph: the innermost module around the router that also uses
expert weights (its nodes, its path in the model and its type), or the whole graph when the compiled module is the
block itself (``passes/detect.py``)."""

from __future__ import annotations

import torch.fx as fx

from . import aliases
from .experts import Skip, expert_params
from .graph_utils import FRAME_PREFIX, FRAME_TYPE, module_stack
from .routing import router_weight
from .unexplained import ROOT


def block_of(router: fx.Node, gm: fx.GraphModule, by_key, values) -> tuple[set[fx.Node], str, str]:
    """(nodes, path, type) of the block around ``router``: the innermost module that also uses expert weights,
    or the whole graph when the compiled module is the block itself."""
    key = block_key(router, by_key, values)
    if key is not None or expert_params(gm.graph.nodes, values, values[router_weight(router)].shape[0]):
        return module_block(key, by_key, gm)
    raise Skip(aliases.EAGER_EXPERTS_REASON)


def module_block(key, by_key, gm) -> tuple[set[fx.Node], str, str]:
    if key is None:  # the compiled frame's module: named by its path in the model where that is known
        return ({n for n in gm.graph.nodes if n.op not in ("placeholder", "output")}, FRAME_PREFIX.get() or ROOT,
                FRAME_TYPE.get() or "<compiled module>")
    path, block_type = next((p, t) for k, p, t in module_stack(by_key[key][0]) if k == key)
    return set(by_key[key]), path, block_type


def path_of(n: fx.Node) -> str:
    st = module_stack(n)
    return st[-1][1] if st else n.name


def block_key(router: fx.Node, by_key, values) -> str | None:
    E = values[router_weight(router)].shape[0]
    for key, _, _ in reversed(module_stack(router)):
        if expert_params(by_key[key], values, E):
            return key
    return None
