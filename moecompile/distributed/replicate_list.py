"""Replication of a layer whose experts are modules of an ``nn.ModuleList`` (or ``nn.ModuleDict``): each weight role
of the experts (``experts.<i>.w1.weight`` for every i) becomes one slot weight ``[S, ...]`` registered on the list
(``experts.moe_slots_w1_weight``), as a stacked layer's slots are, and each expert module reads its weight as entry
i of that slot weight's global view while Dynamo traces: the backend then sees the experts as stacked ``[E, ...]``
weights indexed by expert (as transformers' eager experts read theirs) and the layer replicates as a stacked one
does (``replicate.py``). The experts' own weights are dropped (their values live in the slots and the host master
parts); run eagerly, an expert refuses, naming the fix, as a sharded one does.

``state_dict()`` keeps the model's names: each expert's weight under its own key (``experts.3.w1.weight``), as the
DTensor ``Shard(0)`` of its ``[R, ...]`` over the ranks' hosts (each rank's piece its rows of the expert's master
weights: nothing gathered); ``load_state_dict`` takes those or whole tensors per expert."""

from __future__ import annotations

import torch
from torch import nn

from moecompile.runtime.placement.expert_state import host_placements

from .meta import LAZY


def container(names: list[str]) -> tuple[str, list[str]] | None:
    """``names[i]`` = ``<path>.<key_i>.<rest>`` with one ``path`` and ``rest`` and distinct keys (a ModuleList's
    ``0, 1, ...`` or a ModuleDict's): ``(path, ["<key_i>.<rest>", ...])``; else None."""
    parts = [n.split(".") for n in names]
    if len(parts) < 2 or len({len(p) for p in parts}) != 1:
        return None
    differ = [k for k in range(len(parts[0])) if len({p[k] for p in parts}) > 1]
    if len(differ) != 1 or differ[0] in (0, len(parts[0]) - 1) or len({p[differ[0]] for p in parts}) < len(parts):
        return None
    k = differ[0]
    return ".".join(parts[0][:k]), [".".join(p[k:]) for p in parts]


def check(model: nn.Module, params: dict[str, list[str]]) -> str:
    """Why the ModuleList layer of ``params`` (role -> its experts' weight names) cannot replicate, or ""."""
    found = [container(names) for names in params.values()]
    if any(c is None for c in found) or len({c[0] for c in found}) != 1:
        return ("its experts' weights are not named <list>.<expert>.<weight> alike in one list (sharded without "
                "replication)")
    for names in params.values():
        weights = [model.get_parameter(n) for n in names]
        if len({(tuple(w.shape), w.dtype, w.requires_grad) for w in weights}) != 1:
            return "its experts' weights of one role differ in shape, dtype or requires_grad (sharded without " \
                   "replication)"
    return ""


def stack(model: nn.Module, params: dict[str, list[str]]):
    """(the list module, a slot attribute name per role, the role's weights stacked ``[E, ...]``, per role the
    experts' names relative to the list, per role whether it trains)."""
    found = [container(names) for names in params.values()]
    module = model.get_submodule(found[0][0])
    attrs = ["moe_slots_" + rel[0].split(".", 1)[1].replace(".", "_") for _, rel in found]
    full = [_stacked([model.get_parameter(n) for n in names]) for names in params.values()]
    grads = [model.get_parameter(names[0]).requires_grad for names in params.values()]
    return module, attrs, full, [rel for _, rel in found], grads


def _stacked(weights: list[torch.Tensor]) -> torch.Tensor:
    """``weights`` stacked ``[E, ...]``; of a model built on meta, not yet allocated (one element each, expanded:
    ``meta.LAZY``), one element expanded too, so that only this rank's slots and master part are ever allocated."""
    if all(getattr(w, LAZY, False) for w in weights):
        one = weights[0].detach()[(0,) * weights[0].dim()]  # (its one element)
        return one.reshape((1,) * (weights[0].dim() + 1)).expand(len(weights), *weights[0].shape)
    return torch.stack([w.detach() for w in weights])


def read_from_slots(module: nn.Module, attrs: list[str], experts: list[list[str]], layer: str, group_name: str
                    ) -> None:
    """Drop each expert's weights; while Dynamo traces, the expert module reads weight ``<key>.<rest>`` as entry i
    of ``module.<attr>`` (the slot weight's global ``[E, ...]`` view, ``views.read_through_view``); eagerly it holds
    a meta tensor of its shape and the expert refuses to run. ``experts``: per role, the experts' names relative to
    ``module`` (``stack``)."""
    owners: dict[str, dict[str, tuple]] = {}  # expert module path (relative) -> {its attribute: (slot attr, i)}
    for attr, rels in zip(attrs, experts):
        for i, rel in enumerate(rels):
            path, _, name = rel.rpartition(".")
            owners.setdefault(path, {})[name] = (attr, i)
    for path, reads in owners.items():
        owner = module.get_submodule(path)
        shapes = {}
        for name, (attr, i) in reads.items():
            w = owner._parameters.pop(name)
            shapes[name] = (tuple(w.shape), w.dtype)
        owner.__dict__["_moe_slots_of"] = module  # (not a child: no second path to the list's parameters)

        def read(attr, i, shape, dtype):
            def get(self):
                if torch.compiler.is_compiling():
                    return getattr(self._moe_slots_of, attr)[i]
                return torch.empty(shape, dtype=dtype, device="meta")
            return property(get)

        def refuse_eager(mod, args, attr=next(iter(reads.values()))[0]):
            if not torch.compiler.is_compiling():
                slot = module._parameters[attr]
                torch.ops.moe.ep_global_view(slot, slot.shape[0], group_name, layer)  # raises, saying why

        cls = owner.__class__
        owner.__class__ = type(f"Replicated{cls.__name__}", (cls,),
                               {name: read(attr, i, *shapes[name]) for name, (attr, i) in reads.items()})
        owner.register_forward_pre_hook(refuse_eager)


def to_experts(state_dict: dict, prefix: str, attrs: list[str], experts: list[list[str]], pieces: list, mesh
               ) -> None:
    """The state_dict's slot weights (``prefix + attr``, dropped) as each expert's weight under its own name, the
    DTensor ``Shard(0)`` of its ``[R, ...]`` over ``mesh`` (``host_placements``) from ``pieces`` (per role: the
    DTensor ``Shard(1)`` of the whole ``[E, R, ...]``, ``ExpertPartition.dtensors``), expert by expert."""
    from torch.distributed.tensor import DTensor

    from moecompile.runtime.layouts import contiguous_stride

    rows = host_placements(mesh, 0)
    for attr in attrs:
        state_dict.pop(prefix + attr, None)
    for i in range(len(experts[0])):
        for rels, piece in zip(experts, pieces):
            local, whole = piece.to_local(), tuple(piece.shape[1:])
            state_dict[prefix + rels[i]] = DTensor.from_local(local[i].contiguous(), mesh, rows, run_check=False,
                                                              shape=whole, stride=contiguous_stride(whole))


def from_experts(state_dict: dict, prefix: str, attrs: list[str], experts: list[list[str]], mesh, path: str
                 ) -> bool:
    """Each expert's weights in ``state_dict`` (whole, or DTensors ``Shard(0)`` as ``to_experts`` gave them) as the
    layer's ``[E, ...]`` weights under the slot names (whole, or the DTensors ``Shard(1)``), the experts' keys
    dropped; False where the state holds none of them."""
    from torch.distributed.tensor import DTensor

    from moecompile.runtime.layouts import contiguous_stride

    rows = host_placements(mesh, 0)
    keys = [[prefix + rel for rel in rels] for rels in experts]
    present = [k for role in keys for k in role if k in state_dict]
    if not present:
        return False
    if len(present) != sum(map(len, keys)):
        missing = [k for role in keys for k in role if k not in state_dict]
        raise ValueError(f"the state of {path} holds some of its experts' weights, not all: {missing[:4]} missing")
    for attr, role in zip(attrs, keys):
        values = [state_dict.pop(k) for k in role]
        if not all(isinstance(v, DTensor) and v.device_mesh == mesh and tuple(v.placements) == tuple(rows)
                   for v in values):  # whole tensors, or DTensors of other placements: made whole
            values = [v.full_tensor() if isinstance(v, DTensor) else v for v in values]
        if isinstance(values[0], DTensor):
            whole = (len(values), *values[0].shape)
            local = torch.stack([v.to_local() for v in values])
            state_dict[prefix + attr] = DTensor.from_local(local, mesh, host_placements(mesh, 1), run_check=False,
                                                           shape=whole, stride=contiguous_stride(whole))
        else:
            state_dict[prefix + attr] = torch.stack(values)
    return True
