"""Expert copies split over their ranks: a mesh's outermost ``"dp_shard"`` dimension (FSDP over the copies of the
experts, torchtitan's ``dp_shard_mod_ep``; ``"dp_replicate"`` keeps each copy whole).

As under ``"dp_replicate"``, each index of ``"dp_shard"`` is one expert-parallel group holding every expert once (E
/ group experts a rank) and rows are exchanged only inside it; but the ``R`` ranks holding the same experts (one per
index) each keep 1 / R of each of those weights: a stacked ``[E_l, A, B]`` (or flat ``[E_l x F, H]``) shard is cut
along its dimension 1 (2 for a fused gate/up weight ``[E_l, 2I, H]``: a checkpoint concatenates its gate and up
along 2I), rank ``s`` of the copies keeping ``[:, s A / R:(s + 1) A / R]``. Parameters, gradients and optimizer
state are 1 / R of the copy's. Where the layer runs, the ``distribute`` pass all-gathers the pieces over the copies
(``moe.domain_gather`` of the piece transposed, so that the cut dimension is gathered: its backward reduce-scatters
the gradient, the sum over the copies of each piece); with ``reshard_after_forward=True`` the gathered weights are
not kept from forward to backward (gathered again there), as FSDP2's default. Both gathers start ahead of the layer
(``distribute._start_gathers_early``). The pieces' gradients are then divided as ``"dp_replicate"``'s averaged ones
are (``grads.py``): the mean loss's gradient. Under FSDP2's bf16 ``param_dtype`` the pieces are sent cast to it
(half the bytes), their gradients summed in the pieces' float32.

Under tensor-expert parallelism (``ted.py``) the copy's shard is a tp slice of each expert (I cut over tp): it is
split along another dimension (H), never I (a piece of a slice along I would not be one run of the whole weight),
and its state_dict entry is whole along I (``ted.to_whole``), ``Shard`` of the cut dimension over ``"dp_shard"``.
Beside expert domains (``domains.py``) a layer gathers its pieces over the copies first, then the domain's experts
from those (both again in backward with ``reshard_after_forward=True``); their compressed gathers are refused. A
layer whose experts replicate (``replicate.py``) keeps its slots whole on each copy (each copy placing by its own
routing), and splits each rank's master part and its optimizer state over ``"dp_shard"`` (``ExpertPartition``'s
shares: the part's gradient reduce-scattered, the updated part all-gathered); the other layers of the model are
split.

A weight none of whose dimensions after the experts' the copies divide (a fused gate/up bias: only 2I), or with one
dimension (a per-expert scale), stays whole on each copy and is averaged as under ``"dp_replicate"``. The state_dict
gives a cut weight (and its optimizer state) as the DTensor ``Shard(d)`` (its cut dimension) over ``"dp_shard"`` and
``Shard(0)`` over the expert-parallel dimensions: ``torch.distributed.checkpoint`` saves each piece once and loads
on any layout.

An ``nn.ModuleList`` expert held here (each an ``nn.Linear`` of its own) is cut the same way, each of its weights
along its first dimension the copies divide (``[I, H]``: I), and read while Dynamo traces through a view of its
whole shape; the distribute pass stacks the layer's local pieces of a role, gathers them as one stacked weight and
unbinds them. Its state_dict entry (and optimizer state) is the DTensor of the expert's whole weight over the
copies' sub-mesh (``Shard(d)`` over ``"dp_shard"``, ``Replicate()`` over ``"dp_replicate"``), under the expert's own
name: each piece is saved once, and no rank holds the expert whole (``listed_state``).

Both ``"dp_replicate"`` and ``"dp_shard"`` (in that order, HSDP: e.g. ``("dp_replicate", "dp_shard", "ep")``, the
copies inside a node splitting their experts, whole over the nodes): each index of the two together is one
expert-parallel group, the weights are cut over the ``"dp_shard"`` ranks alone, and each piece is held whole by the
``"dp_replicate"`` ranks, which average its gradient after the reduce-scatter (``grads.py``: summed over them,
divided by every copy); the state_dict's DTensors are ``Replicate()`` over ``"dp_replicate"``.
"""

from __future__ import annotations

import copy
import dataclasses

import torch
import torch.distributed as dist
from torch import nn

from moecompile.runtime.layouts import contiguous_stride

from .mesh import COPIES, REPLICATE, SHARD, copies_split, shard_group


@dataclasses.dataclass(frozen=True)
class Cut:
    """How one weight is split over its copies: along ``dim``, ``parts`` pieces of ``size``, this rank's the
    ``index``-th; ``group``: the copies' process group's name (the distribute pass gathers over it); ``reshard``:
    gathered again in backward (``reshard_after_forward``)."""
    dim: int
    parts: int
    index: int
    size: int
    group: str
    reshard: bool = False
    listed: bool = False  # an nn.ModuleList expert's weight (``dim`` counts from its own first dimension)

    def piece(self, whole: torch.Tensor) -> torch.Tensor:
        """This rank's piece of ``whole`` (its copy's shard, or the same shaped optimizer state)."""
        return whole.narrow(self.dim, self.index * self.size, self.size)


class Split:
    """The copies of a ``"dp_shard"`` mesh (``setup``): ``cut`` keeps this rank's piece of a shard."""

    def __init__(self, mesh, reshard: bool):
        self.mesh, self.group = mesh, shard_group(mesh)
        self.parts, self.index, self.reshard = dist.get_world_size(self.group), dist.get_rank(self.group), reshard
        self.up_transposed = False  # (the layer's: ``for_layer``)

    def for_layer(self, experts) -> Split:
        """This split for a layer of expert spec ``experts`` (where its fused gate/up weight holds 2I)."""
        out = copy.copy(self)
        out.up_transposed = experts.up_transposed
        return out

    def cut(self, module, attr: str, rows: torch.Tensor, role: str, listed: bool = False, ted: int | None = None
            ) -> torch.Tensor:
        """This rank's piece of ``rows`` (the copy's shard of ``module``'s weight ``attr`` of ``role``, noted as
        ``_moe_cuts``), cut along the first dimension after the experts' that the copies divide, but a fused
        gate/up weight's 2I (a checkpoint's gate and up weights are concatenated along it: a piece of each would
        not be a piece of the whole) and ``ted``, the dimension tensor-expert parallelism cut over tp (a piece of
        a tp slice along it would not be one run of the whole); ``rows`` where none is (a 1-D weight, a fused
        bias, a bias along I under TED). ``listed``: ``rows`` is one ``nn.ModuleList`` expert's weight (no
        experts' dimension)."""
        fused = (2 if self.up_transposed else 1) if role == "gate_up" else 1 if role == "gate_up_bias" else None
        fused = None if fused is None else fused - listed
        dims = [d for d in range(1 - listed, rows.dim()) if d not in (fused, ted) and rows.shape[d] % self.parts == 0]
        if not dims:
            return rows
        cut = Cut(dims[0], self.parts, self.index, rows.shape[dims[0]] // self.parts, self.group.group_name,
                  self.reshard, listed)
        module.__dict__.setdefault("_moe_cuts", {})[attr] = cut
        return cut.piece(rows)

    def cut_expert(self, module, attr: str, role: str) -> bool:
        """Keep this rank's piece of the ``nn.ModuleList`` expert weight ``attr`` of ``role`` (a new parameter; its
        state_dict entry: ``listed_state``); False where it stays whole (no dimension divides)."""
        full = module._parameters[attr]
        piece = self.cut(module, attr, full.detach(), role, listed=True)
        if cut_of(module, attr) is None:
            return False
        module._parameters[attr] = held = nn.Parameter(piece.clone(), full.requires_grad)
        held._moe_sharded = True
        listed_state(module, attr, self.mesh)
        return True

    def describe(self, model, held, listed: bool) -> str:
        """What ``explain()`` says of a layer's experts (``listed``: an ``nn.ModuleList``'s): which weights are
        split, which whole on each copy."""
        split, whole = [], []
        for name in sorted(held):
            module_name, _, attr = name.rpartition(".")
            (split if cut_of(model.get_submodule(module_name), attr) else whole).append(attr)
        again = "again in backward" if self.reshard else "kept for backward"
        what = f"the {len(split)} weights of its nn.ModuleList experts held here" if listed else ", ".join(split)
        out = (f"{what} split over {self.parts} ranks ({SHARD!r}: 1/{self.parts} each), gathered "
               f"where the layer runs ({again})") if split else ""
        why = f"no dimension {self.parts} divides" + ("" if listed else ", or 1-D")
        kept = f"{len(whole)} weight(s) whole on each copy ({why}), averaged over the copies" if whole else ""
        return "; ".join(part for part in (out, kept) if part)

    def replicated(self) -> str:
        """What ``explain()`` says of a layer whose experts replicate (``replicate.py``) beside the split copies."""
        return (f"its slots whole on each of the {self.parts} ranks of {SHARD!r} (replication places whole experts "
                f"in the slots), each rank's master part and its optimizer state split over them (1/{self.parts} "
                "each: reduce-scattered after the collect, all-gathered before the distribute)")


def setup(mesh, reshard_after_forward: bool, **options) -> Split | None:
    """The ``Split`` of a ``"dp_shard"`` mesh, else None. ValueError, naming the fix, for the options not built
    beside it (``options``: each option's name -> whether it is asked)."""
    if not copies_split(mesh):
        return None
    asked = [name for name, on in options.items() if on]
    if asked:
        raise ValueError(f"{', '.join(asked)} beside a {SHARD!r} mesh dimension (each rank holding a part of its copy "
                         f"of the experts) is not built yet: name the dimension {REPLICATE!r} (each copy whole) for "
                         f"{'them' if len(asked) > 1 else 'it'}, or leave {'them' if len(asked) > 1 else 'it'} out")
    return Split(mesh, reshard_after_forward)


def listed_state(module, attr: str, mesh) -> None:
    """The state_dict entry of an ``nn.ModuleList`` expert's piece ``attr``: the DTensor of the expert's whole
    weight over the copies (``listed_global``: each piece saved once, no rank holding the expert whole); loading
    takes this rank's piece of it, of a full tensor, or of another layout's DTensor (``listed_local``)."""
    def save(mod, state_dict, prefix, local_metadata):
        if prefix + attr in state_dict:
            state_dict[prefix + attr] = listed_global(state_dict[prefix + attr], cut_of(mod, attr), mesh)

    def load(mod, state_dict, prefix, *_):
        if prefix + attr in state_dict:
            state_dict[prefix + attr] = listed_local(state_dict[prefix + attr], cut_of(mod, attr), mesh)

    module.register_state_dict_post_hook(save)
    module._register_load_state_dict_pre_hook(load, with_module=True)


def copies_mesh(mesh):
    """The sub-mesh of ``mesh`` whose ranks hold the same experts as this one (its ``"dp_replicate"`` and
    ``"dp_shard"`` dimensions)."""
    return mesh[tuple(name for name in mesh.mesh_dim_names if name in COPIES)]


def listed_global(piece: torch.Tensor, cut: Cut, mesh):
    """An ``nn.ModuleList`` expert's piece (or its optimizer state) as the DTensor of the whole weight over the
    copies' sub-mesh: ``Shard(cut.dim)`` over ``"dp_shard"``, ``Replicate()`` over ``"dp_replicate"``."""
    from torch.distributed.tensor import DTensor

    sub, shape = copies_mesh(mesh), whole_shape(piece.shape, cut)
    return DTensor.from_local(piece, sub, placements(sub, cut), run_check=False, shape=shape,
                              stride=contiguous_stride(shape))


def listed_local(value, cut: Cut, mesh):
    """This rank's piece of ``value`` (``listed_global``'s DTensor, another layout's, or a full tensor); anything
    else (a step count) as it is."""
    if hasattr(value, "device_mesh"):
        value = value.to_local() if value.device_mesh == copies_mesh(mesh) else value.full_tensor()
    return mine(value, cut)


def listed_optimizer_state(model, state: dict, names: dict[str, str], mesh, to_global: bool) -> None:
    """The optimizer state (``state``: name -> {key: value}) of ``model``'s ``nn.ModuleList`` expert pieces, in
    place, as their weights in the state_dict: each tensor shaped like its piece made ``listed_global``'s DTensor
    (``to_global``), or a checkpoint's value this rank's piece (``listed_local``). ``names``: each parameter's
    name -> its name in ``state`` (in expert order after swaps)."""
    convert = listed_global if to_global else listed_local
    for name, module in model.named_modules():
        for attr, cut in getattr(module, "_moe_cuts", {}).items():
            ted = attr in getattr(module, "_moe_ted", {})  # (tensor-expert parallel: ted.py converts it)
            entry = state.get(names[f"{name}.{attr}" if name else attr], {}) if cut.listed and not ted else {}
            for key, value in entry.items():
                if isinstance(value, torch.Tensor) and (value.shape == module._parameters[attr].shape or not to_global):
                    entry[key] = convert(value, cut, mesh)


def cut_of(module, attr: str) -> Cut | None:
    """The ``Cut`` of a sharded weight ``attr`` of ``module``, or None (whole on each copy)."""
    return getattr(module, "_moe_cuts", {}).get(attr)


def pieces(model) -> list:
    """The expert weights of ``model`` that are this rank's pieces of its copy's."""
    return [module._parameters[attr] for module in model.modules() for attr in getattr(module, "_moe_cuts", {})]


def placements(mesh, cut: Cut | None) -> list:
    """A sharded weight's DTensor placements on ``mesh``: ``Shard(0)`` over the expert-parallel dimensions, over
    the copies' dimension ``Shard(cut.dim)`` where it is cut there, else ``Replicate()``."""
    from torch.distributed.tensor import Replicate, Shard

    return [(Shard(cut.dim) if cut is not None and name == SHARD else Replicate()) if name in COPIES else Shard(0)
            for name in mesh.mesh_dim_names or [None]]


def whole_shape(shape, cut: Cut | None) -> tuple:
    """The copy's shard shape of a piece of ``shape``."""
    shape = list(shape)
    if cut is not None:
        shape[cut.dim] = cut.size * cut.parts
    return tuple(shape)


def mine(value, cut: Cut | None):
    """This rank's piece of ``value`` where it is its copy's whole shard (a checkpoint's), else ``value``."""
    if cut is None or not isinstance(value, torch.Tensor) or value.dim() <= cut.dim:
        return value
    return cut.piece(value) if value.shape[cut.dim] == cut.size * cut.parts else value
