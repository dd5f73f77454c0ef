"""parallelize's detection, MoE block by MoE block: the blocks traced alone, not the whole model.

``explain(model)`` traces the whole model with Dynamo: attention, embeddings, masks, norms and the loss, which the
sharding never reads, cost more than the MoE blocks themselves (a tiny Mixtral: 0.34 s of Dynamo per MoE block,
0.76 s per decoder layer). Here:

1. The expert holders, from the module tree: a module with a parameter of 3 or more dimensions (stacked experts,
   ``[E, ...]``) other than a convolution (``nn.Conv1d``...: a Mamba mixer's or a short convolution's, in every
   layer of hybrid models, whose climb (3.) would trace their decoder layers whole), and a ``ModuleList`` /
   ``ModuleDict`` of 2 or more modules of one type, each with a matrix, with no such parameter or list below them
   (one module per expert).
2. One eager run of the example, without gradients, records the first inputs of every holder's ancestors.
3. Each holder's parent is explained alone, with its recorded inputs (``explain_calls``: the layers named by their
   path in the model). Where that finds no layer, its parent next, and so on; where it finds layers that do not
   hold the holder's weights, the holder was no expert (an attention's 3-d weight, say).

The whole model is explained instead, as before, where no holder is found (experts stored flat as ``[E * I, H]``,
as DBRX does), where a climb reaches the model itself, where a module it needs never ran in the example, or where
one raised when run alone.

A model on the meta device (``meta.py``) runs step 2 on shapes only (fake tensors), each holder's parent on random
weights of the mesh's device (or, where the model still reads values outside them, their parents, and so on up), and
step 3 on random weights too. It has no whole model to explain instead: a holder no block up to the model explains
is left whole and reported (``report.skipped``), and where no block finds a layer, ``ValueError``.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
from torch import nn
from torch.utils._pytree import tree_map

from moecompile.passes.report import SkipRecord
from moecompile.passes.verify import SHARED_PROOFS

from . import meta as meta_mod
from .twins import Twins

ON_META_LEFT = "a model on the meta device: not found by its blocks traced alone, left whole"
ON_META = ("moecompile.parallelize of a model on the meta device traces its MoE blocks alone, on random weights "
           "(moecompile/distributed/meta.py), and could not here: {why}. Build the model on a device instead, or "
           "file the model's code with this message")


def explain_blocks(model: nn.Module, example_args: tuple, device=None, twins: bool = True, **options):
    """The ``ExplainReport`` of the model's MoE blocks, each traced alone (module docstring), or of the whole
    model where the blocks cannot be told from the module tree. ``device``: where a model on the meta device
    runs its blocks (``meta.py``); None: the model is not on meta. ``twins``: a block of the code, attributes and
    input shapes of one traced before takes its report, untraced (``twins.py``); False: each block traced."""
    from ..explain import explain

    holders = _holders(model)
    if not holders:
        if device is not None:
            raise ValueError(ON_META.format(why="no module holds experts (stacked [E, ...] weights or a list of "
                                                "expert modules)"))
        return explain(model, *example_args, **options)
    paths = {parent for h in holders for parent in _ancestors(h)}
    inputs = _first_inputs(model, paths, example_args) if device is None else _first_inputs_meta(
        model, holders, paths, example_args, device)
    shared = SHARED_PROOFS.set({})  # a layer of the code and shapes of one proved before: proved (as in one graph)
    unexplained: dict[str, str] = {}  # (a model on meta) holder -> why no block holding it was explained
    try:
        explained = _explain_holders(model, holders, inputs, options, device, unexplained, Twins(model, twins))
    finally:
        SHARED_PROOFS.reset(shared)
    if explained is None:
        return explain(model, *example_args, **options)
    if device is not None and not any(report.layers for report in explained.values()):
        raise ValueError(ON_META.format(why="no block found an MoE layer alone: " + "; ".join(
            f"{h}: {why}" for h, why in unexplained.items())))
    report = _merged(list(explained.values()), model)
    report.skipped += [SkipRecord(h, f"{ON_META_LEFT}: {why}") for h, why in unexplained.items()]
    return report


def _explain_holders(model: nn.Module, holders: list[str], inputs: dict, options: dict, device, unexplained: dict,
                     twins: Twins) -> dict | None:
    """path -> the report of each module explained alone (module docstring, 3.); None: explain the whole model.
    A model on meta cannot be explained whole: a holder no block explains goes to ``unexplained`` (-> why), and a
    module that never ran as a call (a block calling its experts' other methods) is climbed past."""
    explained: dict[str, object] = {}
    for holder in holders:
        if _covered(model.get_submodule(holder), explained.values()):
            continue
        for path in _ancestors(holder):
            if device is not None and path and path not in inputs:
                continue
            if path == "" or path not in inputs:
                if device is None:
                    return None
                unexplained[holder] = "traced alone up to the model, no block holding it was proved an MoE layer"
                break
            if path not in explained:
                try:
                    k = twins.key(path, inputs[path])
                    explained[path] = twins.report(k, path) or _explain_one(model, path, inputs[path], options, device)
                    twins.add(k, path, explained[path])
                except Exception as e:  # (run again alone, a module may meet state its first run left: a KV cache)
                    if device is None:
                        return None
                    unexplained[holder] = f"{path} raised {_first_line(e)}"
                    break
            if explained[path].layers:
                break
    return explained


def _explain_one(model: nn.Module, path: str, inputs: tuple, options: dict, device):
    """The report of the module at ``path`` explained alone with its recorded inputs; on random weights and inputs
    of ``device`` for a model on meta, the layers' expert weights named by the meta parameters again."""
    from ..explain import explain_calls

    module = model.get_submodule(path)
    if device is None:
        return explain_calls(model, [(module, *inputs)], **options)
    with meta_mod.materialized(module, device) as standing:
        args, kwargs = meta_mod.real(*inputs, device)
        report = explain_calls(model, [(module, args, kwargs)], **options)
        for rec in report.layers:  # (inside: the random parameters' ids stay theirs)
            rec.expert_weights = tree_map(lambda w: standing.get(id(w), w), rec.expert_weights)
    return report


_CONVOLUTIONS = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)


def _holders(model: nn.Module) -> list[str]:
    """The paths of the modules that may hold experts (module docstring, 1.), deepest first."""
    out = []
    for name, module in model.named_modules():
        if name and ((_stacked(module) and not isinstance(module, _CONVOLUTIONS)) or _expert_list(module)):
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


def _first_inputs_meta(model: nn.Module, holders: list[str], paths: set[str], example_args: tuple, device
                       ) -> dict[str, tuple]:
    """``_first_inputs`` of a model on meta: the holders' parents run on random weights (``meta.run_materialized``),
    or where the model still reads values elsewhere (a block calling its experts' methods other than ``forward``,
    its router's ``nonzero()`` outside them: JetMoE's attention), their parents, and so on up to the model."""
    error: Exception = ValueError("its experts' holders are the model's own children")
    for level in range(max(len(_ancestors(h)) for h in holders) - 1):
        up = {(_ancestors(h) + [""] * level)[level] for h in holders}
        run = {p for p in up if not any(a in up for a in _ancestors(p))}  # the outermost
        if "" in run:
            break
        try:
            return _first_inputs(model, paths, example_args, run, device)
        except Exception as e:
            error = e
    raise ValueError(ON_META.format(why=f"the model raised on meta ({_first_line(error)})")) from error


def _first_line(error: Exception) -> str:
    """``Type: message``, the message's first line, at most 200 characters (Dynamo's run to dozens of lines)."""
    return f"{type(error).__name__}: {(str(error).splitlines() or [''])[0][:200]}"


def _first_inputs(model: nn.Module, paths: set[str], example_args: tuple, run=(), device=None
                  ) -> dict[str, tuple]:
    """path -> (args, kwargs) of the module's first call while the model runs the example (tensors copied). A
    model on meta runs on meta, the modules of ``run`` on random weights of ``device`` (``meta.run_materialized``)."""
    seen: dict[str, tuple] = {}
    copy = lambda t: t.detach().clone() if isinstance(t, torch.Tensor) else t  # noqa: E731

    def hook(path):
        def record(module, args, kwargs):
            if path not in seen:  # (a model on meta: shapes only)
                seen[path] = (meta_mod.recorded(args), meta_mod.recorded(kwargs)) if device is not None else (
                    tree_map(copy, args), tree_map(copy, kwargs))
        return record

    handles = [model.get_submodule(p).register_forward_pre_hook(hook(p), with_kwargs=True) for p in paths if p]
    for p in run:
        model.get_submodule(p).forward = meta_mod.run_materialized(model.get_submodule(p), device)
    if device is not None:
        example_args = meta_mod.as_meta(example_args)
    try:
        with torch.no_grad(), meta_mod.shapes_only() if device is not None else contextlib.nullcontext():
            model(*example_args)
    finally:
        for h in handles:
            h.remove()
        for p in run:
            del model.get_submodule(p).forward  # (the class's again)
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
