"""Tensor-expert parallelism (TED: DeepSpeed-TED, X-MoE App. C) of one MoE layer, ``moe_tp="ted"``.

The experts are sharded over the mesh's dimensions other than ``"tp"`` (the data-parallel group: E / dp experts
per rank), and each expert's intermediate dimension over ``"tp"`` (I / tp per rank): gate and up by rows of
their [I, H] (their columns as a product), down by columns of its [H, I]. Tokens stay replicated over tp; the
``distribute`` pass exchanges rows over the dp group, runs the local experts on this rank's intermediate slice,
sums the down projection's partial rows over tp (``moe.tp_reduce``; the down bias added once, after it) and
gives the token input's gradient the sum of its tp partials (``moe.tp_copy``). Every tensor the model reads keeps
its whole shape while Dynamo traces (``moe.ep_global_view(..., full_shape=)``).

Which positions of a stored weight are this tp rank's (t of G, Is = I / G): along I, [t Is, (t + 1) Is) for a
separate gate, up or down weight or bias; a fused gate/up weight ([2I, H] rows in its layout) keeps its layout
locally: ``chunk`` (gate rows then up rows) takes both runs, [t Is, (t + 1) Is) and I + the same, as does
``chunk_up_first``; ``interleave`` (gate and up rows alternating) takes [2 t Is, 2 (t + 1) Is). The down bias [H]
is not cut.

The state_dict gives each weight whole along I (gathered over tp): a stacked one as the DTensor of its experts,
``Shard(0)`` over the dp dimensions and ``Replicate()`` over tp; a ModuleList layer's local experts as full
tensors. Loading takes a DTensor (the state_dict's layout by its local part, never gathered; another layout's
whole), a full tensor, or this rank's experts, and keeps this rank's slice. Beside a ``"dp_shard"`` mesh dimension
(``copies.py``) each slice is split again over the copies along another dimension than I, and its entry is ``Shard``
of that dimension over ``"dp_shard"`` (a ModuleList expert's: the DTensor over the copies), never whole there.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from moecompile.runtime.layouts import contiguous_stride

from . import copies
from .mesh import TP, state_mesh
from .views import read_remote, read_through_view


def check(rec, tp) -> None:
    """ValueError naming the fix where TED cannot cut this layer."""
    e = rec.spec.experts
    if e.storage not in ("stacked", "modulelist"):
        raise ValueError(f"moe_tp='ted' cuts stacked [E, ...] expert weights or nn.ModuleList experts; MoE layer "
                         f"{rec.path} stores its experts {e.storage}: use moe_tp='ssmb' for it")
    if e.intermediate % tp.tp:
        raise ValueError(f"moe_tp='ted' splits each expert's intermediate size over tp: MoE layer {rec.path} has "
                         f"{e.intermediate}, which {tp.tp} does not divide: use a tp size that divides it, or "
                         "moe_tp='ssmb'")
    if e.num_experts % tp.ep:
        raise ValueError(f"moe_tp='ted' shards the experts over the mesh's dimensions other than 'tp' ({tp.ep} ranks):"
                         f" MoE layer {rec.path} has {e.num_experts} experts, which do not divide over them: use a "
                         "mesh whose dp size divides them, or moe_tp='ssmb'")


def _cut(spec, role: str, per_expert: bool) -> tuple[int, str] | None:
    """(dimension of the stored weight that holds I, how it is cut: "run" or a gate/up layout), None if not cut."""
    e = spec.experts
    if role == "down_bias":
        return None
    if role in ("gate", "up", "gate_up"):
        dim = 2 if e.up_transposed else 1
    elif role == "down":
        dim = 1 if e.down_transposed else 2
    else:  # gate_bias, up_bias, gate_up_bias: [E, I] or [E, 2I]
        dim = 1
    return dim - per_expert, (e.gate_up if role.startswith("gate_up") else "run")


def positions(kind: str, I: int, G: int, t: int) -> torch.Tensor:
    """This tp rank's positions along the cut dimension (module docstring)."""
    Is = I // G
    run = torch.arange(t * Is, (t + 1) * Is)
    if kind == "run":
        return run
    if kind == "interleave":
        return torch.arange(2 * t * Is, 2 * (t + 1) * Is)
    return torch.cat([run, run + I])  # chunk, chunk_up_first: both halves' runs, in the stored order


def _gather_whole(local: torch.Tensor, cut, I: int, tp) -> torch.Tensor:
    """The weight whole along I from every tp rank's slice (every tp rank calls it together)."""
    if cut is None:
        return local
    dim, kind = cut
    parts = [torch.empty_like(local) for _ in range(tp.tp)]
    dist.all_gather(parts, local.contiguous(), group=tp.tp_group)
    shape = list(local.shape)
    shape[dim] = shape[dim] * tp.tp
    whole = local.new_empty(shape)
    for t, part in enumerate(parts):
        whole.index_copy_(dim, positions(kind, I, tp.tp, t).to(local.device), part)
    return whole


def _mine(value: torch.Tensor, cut, I: int, tp) -> torch.Tensor:
    if cut is None:
        return value
    dim, kind = cut
    return value.index_select(dim, positions(kind, I, tp.tp, dist.get_rank(tp.tp_group)).to(value.device))


def shard(model, rec, params: dict, mesh, tp, split=None) -> set[str]:
    """Keep this rank's experts (over dp) and intermediate slice (over tp) of one layer; the names held. With
    ``split`` (a ``"dp_shard"`` mesh: ``copies.py``) each slice is this rank's piece of its copy's, cut along a
    dimension other than I (H: a piece of a slice along I would not be one run of the whole weight)."""
    e, layer = rec.spec.experts, rec.path
    d, E_l = dist.get_rank(tp.ep_group), e.num_experts // tp.ep
    mine = range(d * E_l, (d + 1) * E_l)
    extra = {"moe_tp": "ted", "tp_group": tp.tp_group.group_name}
    group_name = tp.ep_group.group_name  # the experts' exchange: over dp (the copy's ranks, with "dp_replicate")
    held = set()
    for role, names in params.items():
        listed = isinstance(names, list)
        cut = _cut(rec.spec, role, per_expert=listed)
        for i, name in enumerate(names if listed else [names]):
            module_name, _, attr = name.rpartition(".")
            module = model.get_submodule(module_name)
            full = module._parameters[attr]
            if listed and i not in mine:
                like = (tuple(full.shape), full.dtype, full.device, names[mine.start])  # a local one's name
                del module._parameters[attr]
                read_remote(module, attr, like, i, name, group_name, layer, "off", extra)
                continue
            rows = full.detach() if listed else full.detach()[d * E_l:(d + 1) * E_l]
            rows = _mine(rows, cut, e.intermediate, tp)
            if split is not None:  # ("dp_shard": this rank's piece of the slice)
                rows = split.cut(module, attr, rows, role, listed, ted=cut and cut[0])
            local = nn.Parameter(rows.clone(), full.requires_grad)
            local._moe_sharded = True
            module._parameters[attr] = local
            read_through_view(module, {attr: 1 if listed else e.num_experts}, group_name, layer, "off",
                              extra=extra, full_shapes={attr: tuple(full.shape)})
            piece = copies.cut_of(module, attr)
            _state_hooks(module, attr, cut, e.intermediate, tp, None if listed else (e.num_experts, state_mesh(mesh)),
                         None if piece is None else (piece, mesh))
            held.add(name)
    rec.sharding = (f"{E_l} of {e.num_experts} experts on each of {tp.ep} data-parallel ranks, each expert's "
                    f"intermediate size {e.intermediate} cut over tp ({tp.tp} ranks, {e.intermediate // tp.tp} "
                    "each); tokens replicated over tp, the down projection's partial sums reduced over it "
                    "(moe_tp='ted')")
    if rec.moe_tp_choice is not None:
        rec.sharding += f"; {rec.moe_tp_choice}"
    if split is not None:
        rec.sharding += "; " + split.describe(model, held, isinstance(next(iter(params.values())), list))
    return held


def _state_hooks(module, attr, cut, I, tp, stacked, piece) -> None:
    """state_dict: the weight whole along I (a DTensor over the dp dimensions when ``stacked`` = (E, mesh); with
    ``piece`` = (its ``copies.Cut``, the mesh) over ``"dp_shard"`` too, never whole there); load_state_dict: this
    rank's slice (and piece) of a DTensor, a full tensor or this rank's whole-I experts. The module keeps how
    (``_moe_ted``): its optimizer state converts the same way (``sharded_state``)."""
    how = (cut, I, tp, stacked, piece)
    module.__dict__.setdefault("_moe_ted", {})[attr] = how

    def save(mod, state_dict, prefix, local_metadata):
        if prefix + attr in state_dict:
            state_dict[prefix + attr] = to_whole(state_dict[prefix + attr], how)

    def load(mod, state_dict, prefix, *_):
        if prefix + attr in state_dict:
            state_dict[prefix + attr] = to_slice(state_dict[prefix + attr], mod._parameters[attr].shape, how)

    module.register_state_dict_post_hook(save)
    module._register_load_state_dict_pre_hook(load, with_module=True)


def parameters(model) -> dict[str, tuple]:
    """Each TED-cut expert weight ``model`` holds: its name -> how it is cut (``to_whole``, ``to_slice``)."""
    return {f"{name}.{attr}" if name else attr: how for name, module in model.named_modules()
            for attr, how in module.__dict__.get("_moe_ted", {}).items()}


def to_whole(local: torch.Tensor, how) -> torch.Tensor:
    """This rank's slice of a weight (or of its optimizer state) whole along I, for a checkpoint: a DTensor
    ``Shard(0)`` over the dp dimensions and ``Replicate()`` over tp (and ``"dp_replicate"``) for a stacked weight,
    a ``"dp_shard"`` piece's ``Shard`` of its cut dimension over ``"dp_shard"`` (a ModuleList expert's piece: the
    DTensor over the copies, ``copies.listed_global``) (every rank calls it)."""
    cut, I, tp, stacked, piece = how
    out = _gather_whole(local, cut, I, tp)
    split, mesh = piece or (None, None)
    if stacked is None:
        return out if split is None else copies.listed_global(out, split, mesh)
    from torch.distributed.tensor import DTensor

    mesh, placements = _layout(how)
    shape = copies.whole_shape((stacked[0], *out.shape[1:]), split)
    return DTensor.from_local(out, mesh, placements, run_check=False, shape=shape, stride=contiguous_stride(shape))


def _layout(how) -> tuple | None:
    """The mesh and placements of ``to_whole``'s DTensor (None where it gives a full tensor): a stacked weight's
    are a copy's (``copies.placements``) whole along I, replicated over tp; a split ModuleList expert's are
    ``copies.listed_global``'s."""
    _, _, _, stacked, piece = how
    split, mesh = piece or (None, None)
    if stacked is None:
        if split is None:
            return None
        sub = copies.copies_mesh(mesh)
        return sub, copies.placements(sub, split)
    from torch.distributed.tensor import Replicate

    mesh = stacked[1]
    return mesh, [Replicate() if name == TP else p
                  for name, p in zip(mesh.mesh_dim_names, copies.placements(mesh, split))]


def to_slice(value, shape, how):
    """This rank's slice (of ``shape``) of a checkpoint's weight or optimizer state: a DTensor, a full tensor or
    this rank's experts whole along I (and its copy's whole); anything else (a step count) as it is."""
    cut, I, tp, stacked, piece = how
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):  # to_whole's layout (a checkpoint of this model): this rank's part as it is,
        layout = _layout(how)  # never the whole weight on every rank; another layout's gathered whole
        ours = layout is not None and value.device_mesh == layout[0] and tuple(value.placements) == tuple(layout[1])
        value = value.to_local() if ours else value.full_tensor()
    if not isinstance(value, torch.Tensor) or value.dim() != len(shape):
        return value
    if stacked is not None and value.shape[0] == stacked[0] and value.shape[0] != shape[0]:
        d = dist.get_rank(tp.ep_group)
        value = value[d * shape[0]:(d + 1) * shape[0]]
    if cut is not None and value.shape[cut[0]] != shape[cut[0]]:  # (whole along I: this tp rank's slice)
        value = _mine(value, cut, I, tp)
    return value if piece is None else copies.mine(value, piece[0])
