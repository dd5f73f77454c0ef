"""Expert domains' gathers again in backward, started ahead (``reshard_after_forward=True``, and the gathers of
layers in activation-checkpointed regions, which backward runs again with the rest of the region).

The distribute pass marks a resharded layer's ``moe.domain_gather_start`` and ``moe.domain_gather_wait`` to be
computed again in backward; AOT autograd's partitioner puts what it recomputes right before its first use there, so
the backward graph would start each layer's all-gather and wait for it at once, before that layer's experts' backward,
with nothing to hide it behind. This pass runs on the backward graph (AOT autograd's, before the inner compiler
compiles it: ``compile_inner`` hands it to aot_eager as the backward compiler and to Inductor as a post-grad pass)
and moves each start as the forward has it (hybridep.md §IV-B, ``distribute._start_gathers_early``): right after the
last use of the copies gathered before it in backward order (the later layer's experts' backward), the first one as
soon as its weights are there. Each gather then runs while the later layer's rows' gradients are exchanged and its
pre-expert part computes its backward; two layers' copies at most are alive at once, as in forward.

    before (backward order)                        after
    start_1  wait_1  experts_1'  ...               start_1  ...  wait_1  experts_1'  start_0  ...
    start_0  wait_0  experts_0'                    ...  wait_0  experts_0'

``local_gathers``: the gathers of a layer cut out for the lower pass's timing stand as local copies (no collective).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.fx as fx
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files
from torch.utils.checkpoint import CheckpointPolicy

import moecompile.runtime.comm.domains  # noqa: F401  (registers moe::domain_gather_start, moe::domain_gather_wait)

START = torch.ops.moe.domain_gather_start.default
GATHER = torch.ops.moe.domain_gather.default
WAIT = torch.ops.moe.domain_gather_wait.default


def is_backward(graph: fx.Graph) -> bool:
    """AOT autograd's backward graphs take the outputs' gradients (placeholders ``tangents_*``)."""
    return any(n.op == "placeholder" and n.name.startswith("tangents") for n in graph.nodes)


def regathers(gm: fx.GraphModule) -> bool:
    """Whether ``gm`` (after the MoE passes) may gather a layer's experts again in backward: a gather marked so
    (``reshard_after_forward``), or one in an activation-checkpointed region's body, whose forward backward runs
    again (unless ``checkpoint_exchanges="save"`` keeps the gathered copies; then none is in the backward graph)."""
    return any(n.target is START and (m is not gm or n.meta.get("recompute") == CheckpointPolicy.MUST_RECOMPUTE)
               for m in gm.modules() if isinstance(m, fx.GraphModule) for n in m.graph.nodes)


def start_regathers_early(graph: fx.Graph) -> int:
    """In a backward graph: each ``moe.domain_gather_start`` moved right after the last use of the copies the
    layer before it (in graph order) waited for, or the first layer's right after their inputs (and the graph's);
    never later than it was. A layer's gathers (one a weight) are the waits of one layer name in a row. Returns how
    many moved."""
    if not is_backward(graph):
        return 0
    layers: list[list[fx.Node]] = []  # the waits, by layer, in graph order
    for wait in (n for n in graph.nodes if n.target is WAIT):
        layer = wait.args[3] if len(wait.args) > 3 else ""
        if layers and layer and layers[-1][0].args[3:4] == (layer,):
            layers[-1].append(wait)
        else:
            layers.append([wait])
    moved, last_use = 0, None  # last_use: of the copies the previous layer's waits gave
    inputs = [n for n in graph.nodes if n.op == "placeholder"][-1:]  # (the graph's inputs come first)
    for waits in layers:  # (fx nodes compare by their place in the graph, kept as nodes move)
        placed = None  # the layer's start placed before this one (its starts stay in their order)
        for start in (w.args[0] for w in waits):
            if not (isinstance(start, fx.Node) and start.target is START):
                continue
            ready, prep = start.all_input_nodes, None  # a ModuleList's stack of the experts moves with its start
            if len(ready) == 1 and ready[0].op == "call_function" and all(  # (read by its start and wait only)
                    u.target in (START, WAIT) for u in ready[0].users) and all(
                    a.op == "placeholder" for a in ready[0].all_input_nodes):
                prep, ready = ready[0], ready[0].all_input_nodes
            after = max(n for n in (*inputs, *ready, last_use, placed) if n is not None)
            if after < (prep or start) and after.next is not (prep or start):
                if prep is not None:
                    after.append(prep)
                    after = prep
                after.append(start)
                moved += 1
            placed = start
        last_use = max(u for w in waits for u in (w, *w.users))
    return moved


class RegathersEarly(CustomGraphPass):
    """``start_regathers_early`` as Inductor's ``post_grad_custom_post_pass`` (it runs on forward graphs too, where
    it does nothing), with the hash of this file as its cache key."""

    def __call__(self, graph: fx.Graph) -> None:
        start_regathers_early(graph)

    def uuid(self):
        return get_hash_for_files((__file__,))


def local_gathers(gm: fx.GraphModule) -> None:
    """``gm`` (a layer's local experts cut out to be timed: ``forms.expert_candidate``) with each gather of other
    ranks' weights (``moe.domain_gather``, or its start and wait) standing as this rank's own weights repeated, in the
    dtype the gather sends: the same shapes and work, no collective. Each rank times its forms as often as its own
    time budget allows (or not at all, its choice cached): a collective there would pair one rank's extra gather
    with another's next, or wait for ever (seen on 8 gloo ranks with a cold cache, 2026-12-06)."""
    from moecompile.runtime.comm.exchange import resolve_group

    for n in list(gm.graph.nodes):
        if n.op != "call_function" or n.target not in (GATHER, WAIT):  # (a start: erased below, once its wait is)
            continue
        rest = n.args[1:] if n.target is WAIT else n.args  # (w, group, layer, dtype)
        w, group, dtype = rest[0], rest[1], rest[3] if len(rest) > 3 else n.kwargs.get("dtype")
        with gm.graph.inserting_before(n):
            own = gm.graph.call_method("to", (w, dtype)) if dtype is not None else w
            whole = gm.graph.call_function(torch.cat, ([own] * dist.get_world_size(resolve_group(group)),))
        n.replace_all_uses_with(whole)
        gm.graph.erase_node(n)
    for n in list(gm.graph.nodes):
        if n.target is START and not n.users:
            gm.graph.erase_node(n)
    gm.recompile()
