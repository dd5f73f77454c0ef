"""parallelize's detection, MoE block by MoE block: the blocks traced alone, not the whole model.

``explain(model)`` traces the whole model with Dynamo: attention, embeddings, masks, norms and the loss, which the
sharding never reads, cost more than the MoE blocks themselves (a tiny Mixtral: 0.34 s of Dynamo per MoE block,
0.76 s per decoder layer). Here:

1. The expert holders, from the module tree: a module with a parameter of 3 or more dimensions (stacked experts,
   ``[E, ...]``), and a ``ModuleList`` / ``ModuleDict`` of 2 or more modules of one type, each with a matrix, with
   no such parameter or list below them (one module per expert).
2. One eager run of the example, without gradients, records the first inputs of every holder's ancestors.
3. Each holder's parent is explained alone, with its recorded inputs (``explain_calls``: the layers named by their
   path in the model). Where that finds no layer, its parent next, and so on; where it finds layers that do not
   hold the holder's weights, the holder was no expert (an attention's 3-d weight, say).

The whole model is explained instead, as before, where no holder is found (experts stored flat as ``[E * I, H]``,
as DBRX does), where a climb reaches the model itself, where a module it needs never ran in the example, or where
one raised when run alone.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn
from torch.utils._pytree import tree_map

from moecompile.passes.verify import SHARED_PROOFS


def explain_blocks(model: nn.Module, example_args: tuple, **options):
    """The ``ExplainReport`` of the model's MoE blocks, each traced alone (module docstring), or of the whole
    model where the blocks cannot be told from the module tree."""
    from ..explain import explain

    holders = _holders(model)
    if not holders:
        return explain(model, *example_args, **options)
    inputs = _first_inputs(model, {parent for h in holders for parent in _ancestors(h)}, example_args)
    shared = SHARED_PROOFS.set({})  # a layer of the code and shapes of one proved before: proved (as in one graph)
    try:
        explained = _explain_holders(model, holders, inputs, options)
    finally:
        SHARED_PROOFS.reset(shared)
    if explained is None:
        return explain(model, *example_args, **options)
    return _merged(list(explained.values()), model)


def _explain_holders(model: nn.Module, holders: list[str], inputs: dict, options: dict) -> dict | None:
    """path -> the report of each module explained alone (module docstring, 3.); None: explain the whole model."""
    from ..explain import explain_calls

    explained: dict[str, object] = {}
    for holder in holders:
        if _covered(model.get_submodule(holder), explained.values()):
            continue
        for path in _ancestors(holder):
            if path == "" or path not in inputs:
                return None
            if path not in explained:
                args, kwargs = inputs[path]
                try:
                    explained[path] = explain_calls(model, [(model.get_submodule(path), args, kwargs)], **options)
                except Exception:  # (run again alone, a module may meet state its first run left: a KV cache)
                    return None
            if explained[path].layers:
                break
    return explained


def _holders(model: nn.Module) -> list[str]:
    """The paths of the modules that may hold experts (module docstring, 1.), deepest first."""
    out = []
    for name, module in model.named_modules():
        if name and (_stacked(module) or _expert_list(module)):
            out.append(name)
    return sorted(out, key=lambda n: -n.count("."))


def _stacked(module: nn.Module) -> bool:
    return any(p.dim() >= 3 for p in module.parameters(recurse=False))


def _expert_list(module: nn.Module) -> bool:
    if not isinstance(module, (nn.ModuleList, nn.ModuleDict)) or len(module) < 2:
        return False
    children = list(module.children())
    if len({type(c) for c in children}) != 1:
        return False
    if not all(any(p.dim() == 2 for p in c.parameters()) for c in children):  # (a list of norms, say)
        return False
    return not any(_stacked(m) or (m is not c and isinstance(m, (nn.ModuleList, nn.ModuleDict)) and len(m) >= 2)
                   for c in children for m in c.modules())


def _ancestors(path: str) -> list[str]:
    """``a.b.c`` -> ``["a.b", "a", ""]``: the parent first, the model last."""
    parts = path.split(".")
    return [".".join(parts[:i]) for i in range(len(parts) - 1, -1, -1)]


def _first_inputs(model: nn.Module, paths: set[str], example_args: tuple) -> dict[str, tuple]:
    """path -> (args, kwargs) of the module's first call while the model runs the example (tensors copied)."""
    seen: dict[str, tuple] = {}
    copy = lambda t: t.detach().clone() if isinstance(t, torch.Tensor) else t  # noqa: E731

    def hook(path):
        def record(module, args, kwargs):
            seen.setdefault(path, (tree_map(copy, args), tree_map(copy, kwargs)))
        return record

    handles = [model.get_submodule(p).register_forward_pre_hook(hook(p), with_kwargs=True) for p in paths if p]
    try:
        with torch.no_grad():
            model(*example_args)
    finally:
        for h in handles:
            h.remove()
    return seen


def _covered(holder: nn.Module, reports) -> bool:
    """Whether a layer found so far holds the holder's weights."""
    held = {id(p) for p in holder.parameters()}
    for report in reports:
        for rec in report.layers:
            weights = [w for ws in rec.expert_weights.values() for w in (ws if isinstance(ws, list) else [ws])]
            if any(id(w) in held for w in weights):
                return True
    return False


def _merged(reports: list, model: nn.Module):
    """One report of the blocks' reports: each layer once, in the model's module order."""
    order = {name: i for i, (name, _) in enumerate(model.named_modules())}
    layers = {}
    for report in reports:
        for rec in report.layers:
            layers.setdefault(rec.path, rec)
    counters: dict = {}
    for report in reports:
        for key, n in report.counters.items():
            counters[key] = counters.get(key, 0) + n
    return dataclasses.replace(
        reports[0], layers=sorted(layers.values(), key=lambda r: order.get(r.path, len(order))),
        skipped=[s for r in reports for s in r.skipped], graphs=[g for r in reports for g in r.graphs],
        counters=counters, num_graphs=sum(r.num_graphs for r in reports),
        failures=[f for r in reports for f in r.failures])
