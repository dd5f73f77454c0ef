"""expose_sharded: make the experts moecompile.parallelize sharded over ranks look, to detect and verify, like the
parameters they stand for on one device.

A sharded parameter reaches the graph as ``moe.ep_global_view(local_shard, E, group, layer)`` (the model's own
experts code reads its global ``[E, ...]`` shape; it has no value); a weight of an ``nn.ModuleList`` expert held by
another rank as ``moe.ep_remote_expert(shape, expert, group, layer, ...)``. This pass gives each such view a
placeholder of its own (views of the same weight share one, the repeats erased), standing for a random tensor of the
global shape (``meta["ep_standin"]``, a meta-device parameter seen by ``graph_utils.placeholder_values``; verify
``materialize``s it for the one layer it proves), so detect reads the layer and verify proves it exactly as on one
device (on random weights: the proof is about what the code computes, not about the values). ``distribute``
puts the local shards back and removes these placeholders.

    before: w = moe.ep_global_view(l_gate_up_proj_, 8, "1", "model.layers.0.mlp"); ... w[ids] ...
    after:  placeholder ep_global_view_standin (meta["ep_view"] = the view node);    ... ep_global_view_standin[ids] ...
"""

from __future__ import annotations

import math
import re

import torch
import torch.fx as fx

import moecompile.runtime.comm.ops  # noqa: F401  (registers moe::ep_global_view)

from moecompile.runtime.layouts import contiguous_stride

from .graph_utils import example, hint
from .report import PassReport

EP_VIEWS = (torch.ops.moe.ep_global_view.default, torch.ops.moe.ep_global_view,
            torch.ops.moe.ep_remote_expert.default, torch.ops.moe.ep_remote_expert)


def is_ep_view(n: fx.Node) -> bool:
    return n.op == "call_function" and n.target in EP_VIEWS


def expose_sharded_pass(gm: fx.GraphModule, example_inputs, *, config, report: PassReport) -> fx.GraphModule:
    views = [n for n in gm.graph.nodes if is_ep_view(n)]
    if not views:
        return gm
    last = [n for n in gm.graph.nodes if n.op == "placeholder"][-1]
    seen: dict[tuple, fx.Node] = {}
    for view in views:
        key = _key(view)
        if key in seen:  # the same weight read again (dbrx reads its flat weights once per expert): one stand-in
            view.replace_all_uses_with(seen[key])
            gm.graph.erase_node(view)
            continue
        with gm.graph.inserting_after(last):
            ph = gm.graph.placeholder(_standin_name(view))
        fake = example(view)
        ph.meta["example_value"] = fake
        ph.meta["ep_view"] = view
        if "nn_module_stack" in view.meta:  # as a local parameter's input carries its module: detect groups a
            ph.meta["nn_module_stack"] = dict(view.meta["nn_module_stack"])  # block's nodes and weights by it
        shape = [hint(s) for s in fake.shape]  # only its shape until verify proves this layer (materialize)
        ph.meta["ep_standin"] = torch.nn.Parameter(torch.empty(shape, dtype=fake.dtype, device="meta"),
                                                   requires_grad=False)
        ph.meta["ep_standin_at"] = (fake.device, config.probe_seed + len(seen))
        view.replace_all_uses_with(ph)
        seen[key] = last = ph
        report.counters["expose_sharded.views"] += 1
    return gm


def materialize(ph: fx.Node) -> torch.nn.Parameter:
    """The random weights a stand-in placeholder holds while verify proves its layer: made here, on the layer's
    device and in its dtype by that device's generator (no host copy), from the placeholder's own seed (the same
    each time), and dropped with the proof; stacked experts as overlapping windows of one buffer (``random_weight``:
    about one expert's bytes, where DeepSeek-V3's global experts are 21 GiB a layer). Made for every layer at once,
    the stand-ins of a large model sharded over many ranks would be its whole global expert weights on each rank."""
    shape, dtype = ph.meta["ep_standin"].shape, ph.meta["ep_standin"].dtype
    device, seed = ph.meta["ep_standin_at"]
    gen = torch.Generator(device=device).manual_seed(seed)
    return torch.nn.Parameter(random_weight(shape, dtype, gen), requires_grad=False)


WINDOW_SHIFT = 1048  # elements between one expert's window and the next's (a multiple of 8: 16-byte aligned strides)


def random_weight(shape, dtype, gen: torch.Generator, windows: bool = True) -> torch.Tensor:
    """Random values at a layer's usual scale (probes neither vanish nor saturate), drawn on ``gen``'s device. With
    ``windows``, stacked experts (``[E, ...]``, 3 or more dimensions) are windows of one buffer, expert ``e`` starting
    ``WINDOW_SHIFT`` elements after expert ``e - 1`` (``as_strided``): each expert its own values, yet the buffer about
    one expert's size, not E times it. For weights only read, never written (proofs, the traced run of a block; a
    gradient taken of one is a whole tensor of its own); never for activations, whose code may ``view`` them."""
    std = 1.0 / max(1, shape[-1]) ** 0.5
    if not windows or len(shape) < 3 or shape[0] < 2:
        return torch.randn(shape, generator=gen, device=gen.device, dtype=dtype).mul_(std)
    one = math.prod(shape[1:])
    shift = min(WINDOW_SHIFT, one)
    flat = torch.randn(one + shift * (shape[0] - 1), generator=gen, device=gen.device, dtype=dtype).mul_(std)
    return flat.as_strided(tuple(shape), (shift, *contiguous_stride(shape[1:])))


def view_arg(view: fx.Node, name: str, default=None):
    """The view op's argument ``name`` (by its schema: ``moe.ep_global_view`` and ``moe.ep_remote_expert`` place
    them differently), or ``default`` where the op has none or the call left it out."""
    op = view.target if hasattr(view.target, "_schema") else view.target.default
    names = [a.name for a in op._schema.arguments]
    if name not in names:
        return default
    at = names.index(name)
    return view.args[at] if len(view.args) > at else view.kwargs.get(name, default)


def _key(view: fx.Node) -> tuple:
    """Views equal in op and arguments read the same weight."""
    plain = lambda a: tuple(a) if isinstance(a, list) else a  # noqa: E731
    return (view.target, tuple(plain(a) for a in view.args), tuple(sorted(view.kwargs.items())))


def _dynamo_name(fqn: str) -> str:
    """How Dynamo spells a parameter ``a.0.w.weight`` in a graph input's name: ``modules_a_modules_0_modules_w_
    parameters_weight``."""
    *modules, attr = fqn.split(".")
    return "_".join([f"modules_{m}" for m in modules] + [f"parameters_{attr}"])


def _standin_name(view: fx.Node) -> str:
    """A remote ModuleList expert's weight is named as Dynamo would name it, after the graph input of the local
    weight it is shaped like (detect reads a ModuleList's experts from those names); others after their view.
    Under tensor-expert parallelism a local ModuleList expert's weight is a view of its slice too: its stand-in
    is named after that slice's graph input, and every stand-in of the layer ends in ``ted_`` alike. A module
    compiled below the model's root (the MoE block alone) names its inputs from there: the names are matched
    with as many of the layer path's leading modules dropped as that takes. A local expert's piece of its copy's
    (``"dp_shard"``) likewise, every stand-in of the layer ending in ``copy_``."""
    suffix = "ted_" if view_arg(view, "moe_tp") == "ted" else "copy_" if view_arg(view, "copy_group", "") else ""
    if view.target in EP_VIEWS[2:]:
        like, name, layer = view.args[5].split("."), view.args[6].split("."), view.args[3].split(".")
        for k in range(len(layer) + 1):  # the model's names, then as the layer's own module compiled alone sees them
            like_k, name_k = _dynamo_name(".".join(like[k:])), _dynamo_name(".".join(name[k:]))
            for ph in view.graph.find_nodes(op="placeholder"):
                if ph.name.endswith(f"_{like_k}_"):
                    piece = any(is_ep_view(u) and view_arg(u, "copy_group", "") for u in ph.users)
                    suffix = suffix or ("copy_" if piece else "")  # (the local expert it is named after is a piece)
                    return ph.name[: len(ph.name) - len(like_k) - 1] + name_k + "_" + suffix
    local = view.args[0]
    if suffix and isinstance(local, fx.Node) and local.op == "placeholder" and re.search(r"_modules_\d+_", local.name):
        return local.name + suffix
    return f"{view.name}_standin"


def weight_view(w) -> fx.Node | None:
    """The view a weight input of a rewritten layer is read through (``ep_view``), or None."""
    return w.meta.get("ep_view") if isinstance(w, fx.Node) else None


def copy_view(w) -> fx.Node | None:
    """The view a "dp_shard" piece is read through among a role's weights (an ``nn.ModuleList``'s: its local
    experts'), else None."""
    views = [weight_view(n) for n in (w if isinstance(w, (list, tuple)) else [w])]
    return next((v for v in views if v is not None and view_arg(v, "copy_group", "")), None)


def local_weights(weights: dict):
    """(role -> this rank's weights, the views of the others): a stacked weight's view of its local shard, or the
    ``nn.ModuleList`` entries of the experts held here (a consecutive block; the others are views)."""
    views, local = [], {}
    for role, w in weights.items():
        if isinstance(w, (list, tuple)):  # a local expert's weight: a graph input, or a view of its slice (ted)
            read = [weight_view(n) for n in w]
            remote = [v if v is not None and v.target in EP_VIEWS[2:] else None for v in read]
            here = [i for i, v in enumerate(remote) if v is None]
            local[role] = None
            if any(v is not None for v in read):
                views += [v for v in read if v is not None]
                if not here or here != list(range(here[0], here[0] + len(here))):
                    raise ValueError(f"the experts of the layer held here are not one consecutive block: {here}")
                local[role] = [w[i] if read[i] is None else read[i].args[0] for i in here]
        elif weight_view(w) is not None:
            views.append(weight_view(w))
            local[role] = weight_view(w).args[0]
        else:
            local[role] = None
    if views and any(v is None for v in local.values()):
        sharded = sorted(r for r, v in local.items() if v is not None)
        raise ValueError(f"only some expert weights of the layer are sharded: {sharded}")
    return local, views


def remove_standins(graph: fx.Graph) -> None:
    """Take the stand-in placeholders out of ``graph`` again, giving their uses back to the views they stood for
    (the pipeline calls it on a graph it gives up: Dynamo reads that graph's placeholders after the backend)."""
    for ph in [n for n in graph.nodes if n.op == "placeholder" and "ep_view" in n.meta]:
        view = ph.meta["ep_view"]
        if getattr(view, "_erased", False):
            with graph.inserting_after(ph):
                view = graph.node_copy(view)
        ph.replace_all_uses_with(view)
        graph.erase_node(ph)
        ph.meta.pop("ep_standin", None)
