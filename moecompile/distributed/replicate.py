"""``moecompile.parallelize(..., replication="adaptive" | "static", slots_per_rank=S)``: the experts of a layer
live in S slots on each rank, as many instances of an expert as the placement gives it
(``runtime/placement/replication.py`` decides it; "static": each expert the same number, never changed;
"adaptive": every optimizer step, in proportion to the routing of the step). The weights of the slots are the only
expert weights on the ranks' devices; each expert's fp32 master weights and optimizer state are a fixed 1/W part on
each rank's host (``runtime/placement/expert_state.py``), stepped by ``moecompile.ExpertOptimizer``, which also
sends the updated weights to the slots of the next placement. Stacked ``[E, ...]`` and flat ``[E x R, ...]`` expert
weights replicate, and so do the experts of an ``nn.ModuleList`` (or ``ModuleDict``): each weight role's slots are
registered on the list and its experts read them (``replicate_list.py``).

The module reads each slot weight ``[S, ...]`` as ``moe.ep_global_view`` (the global ``[E, ...]`` shape, as
without replication) with the placement buffer (``REPLICAS``); the ``distribute`` pass sends each routed row to
one instance of its expert (``moe.ep_to_instances``). ``state_dict()`` gives a stacked replicated weight as the
DTensor ``Shard(1)`` of the whole ``[E, ...]`` over the ranks' hosts, each rank's piece its master part (nothing
gathered), and a flat one ``[E x R, ...]`` whole (gathered from the master parts, the same on every rank);
``load_state_dict`` takes either, or a whole tensor, back into the master weights and the slots.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

import moecompile.runtime.placement.replicas  # noqa: F401  (registers moe::ep_to_instances)
from moecompile.runtime.comm import levels
from moecompile.runtime.placement.expert_state import ExpertPartition, Groups
from moecompile.runtime.placement.replication import uniform

from . import replicate_list
from .mesh import (REPLICATE, SHARD, _timeout, copies_split, ep_groups, ep_shape, piece_copies_group,
                   replicate_group, replicate_groups, shard_group)
from .meta import LAZY

REPLICAS = "moe_slot_experts"  # the buffer holding a replicating layer's placement (slot -> expert)
MODES = ("off", "static", "adaptive")


@dataclass
class Hosts:
    """What every replicating layer of a rank shares: ``mesh``, the expert-parallel group's hosts in order (the
    master parts' DTensors: every rank's, or under ``"pp"`` the stage's, beside copies of the experts the copy's),
    ``groups``, the process groups of every run of consecutive ranks of the group (the instances' gradient sums; its
    ``group``, ``rank``, ``world``), and ``copies``: with ``"dp_replicate"`` or ``"dp_shard"`` (a replicating layer's
    slots are whole on each copy), the group of the ranks at the same place in every copy (one that takes host
    tensors), else None. Under ``"dp_shard"`` those ranks split the master part they hold in shares: ``split``, the
    ranks differing in ``"dp_shard"`` alone (the shares' reduce-scatter and all-gather), and ``mesh`` the hosts as
    ("dp_replicate", "ep", "dp_shard") (the first under HSDP only), each share a nested ``Shard``; ``same``: the
    ranks holding the same master weights (their gradients summed over it): ``copies``, or under HSDP the ranks
    differing in ``"dp_replicate"`` alone, or None."""

    mesh: object
    groups: Groups
    copies: object = None
    split: object = None
    same: object = None

    def share(self) -> tuple | None:
        """(this rank's index, the count, the group) of the ranks splitting its master parts, or None."""
        return None if self.split is None else (dist.get_rank(self.split), dist.get_world_size(self.split),
                                                self.split)


def setup(mesh, group) -> Hosts:
    """The hosts of ``group``, the expert-parallel group of ``mesh``; every rank calls it together (at
    ``parallelize``, each stage's rank too, replicating layers or not: the groups of every stage and copy are made
    on every rank, as ``new_group`` requires)."""
    every = ep_groups(mesh)
    copies = replicate_group(mesh)
    if copies is not None and "gloo" not in str(dist.get_backend(copies)):
        copies = _gloo_group(replicate_groups(mesh))  # (NCCL alone sums no host tensor)
    hosts = Hosts(host_mesh(group, every), Groups(group, timeout=_timeout(), every=every), copies, same=copies)
    if copies_split(mesh):  # ("dp_shard": each rank of a copy keeps a share of the master part they hold)
        hosts.mesh, hosts.split, hosts.same = _shared_hosts(mesh, group, every)
    return hosts


def _shared_hosts(mesh, group, every: list[list[int]]):
    """Under ``"dp_shard"``: the hosts' mesh ("dp_replicate", "ep", "dp_shard") of this rank's stage (the first
    under HSDP only), this rank's ``split`` group and its ``same`` group (``Hosts``): the mesh's groups where they
    take CPU tensors, else gloo groups of their ranks, made on every rank."""
    from torch.distributed.device_mesh import DeviceMesh

    names = tuple(mesh.mesh_dim_names)
    ranks, at = mesh.mesh, names.index(SHARD)
    held = ranks[tuple((ranks == dist.get_rank()).nonzero()[0][:1].tolist())] if names[0] == "pp" else ranks
    outer = held.dim() - len(ep_shape(mesh))  # ("dp_replicate" and "dp_shard", or "dp_shard")
    held = held.reshape(*held.shape[:outer], -1)  # (the expert-parallel ranks in order)
    host = lambda made, dims: made if "gloo" in str(dist.get_backend(made)) else _gloo_group(  # noqa: E731
        levels.partition(ranks, dims) if dims else every)
    ep, split = host(group, ()), host(shard_group(mesh), (at,))
    if outer == 2:  # HSDP
        same = host(piece_copies_group(mesh), (names.index(REPLICATE),))
        return (DeviceMesh.from_group([same, ep, split], "cpu", mesh=held.permute(0, 2, 1),
                                      mesh_dim_names=(REPLICATE, "ep", SHARD)), split, same)
    return DeviceMesh.from_group([ep, split], "cpu", mesh=held.permute(1, 0), mesh_dim_names=("ep", SHARD)), split, None


@dataclass
class ReplicaLayer:
    """One layer whose experts replicate: its module, weights (attribute names, in partition order), this rank's
    master part, the placement (the module's buffer, changed in place) and its slots per rank."""

    path: str
    module: nn.Module
    attrs: list[str]
    part: ExpertPartition
    placement: torch.Tensor
    slots_per_rank: int
    adaptive: bool
    capacity_factor: float
    hosts: Hosts  # the expert-parallel group's hosts and the groups that sum the instances' gradients
    names: list[str] = None  # the slot weights' parameter names in the model
    experts: list[list[str]] | None = None  # a ModuleList's: per weight, each expert's name in the list
    unset: bool = False  # built on meta: no values yet (``from_slots``); a load sets them
    versions: list[int] | None = None  # built on meta: the slot weights' ``_version`` as allocated

    @property
    def host_mesh(self):
        return self.hosts.mesh

    def slot_parameters(self) -> list[nn.Parameter]:
        return [self.module._parameters[a] for a in self.attrs]

    def write_slots(self, rows_SP: torch.Tensor) -> None:
        """Each slot weight from ``[S, P]`` rows (fp32) of this rank's slots."""
        with torch.no_grad():
            for p, w in zip(self.slot_parameters(), self.part.unflatten(rows_SP)):
                p.copy_(w.reshape(p.shape))


def check_options(replication, slots_per_rank, capacity_factor, dedup: str, swap_every: int) -> None:
    if replication not in MODES:
        raise ValueError(f"replication={replication!r}: choose one of {list(MODES)}")
    if replication == "off":
        if slots_per_rank is not None or capacity_factor is not None:
            raise ValueError("slots_per_rank and capacity_factor place replicated experts: pass "
                             "replication='adaptive' (or 'static') with them")
        return
    if slots_per_rank is None:
        raise ValueError(f"replication={replication!r} needs slots_per_rank=S, the expert slots of each rank "
                         "(S x ranks >= experts; more slots, more instances of the popular experts)")
    if dedup != "off" or swap_every:
        raise ValueError(f"replication={replication!r} places experts itself and sends one row per (token, "
                         "instance): use dedup='off' and swap_every=0 with it")
    if capacity_factor is not None and not (isinstance(capacity_factor, (int, float)) and capacity_factor > 0):
        raise ValueError(f"capacity_factor must be a number > 0 (None: dropless); got {capacity_factor!r}")


def replicable(model, params: dict) -> str:
    """Why a layer's experts cannot replicate ("" when they can): stacked or flat weights of one module, or the
    modules of one ``nn.ModuleList`` (``replicate_list.check``)."""
    names = list(params.values())
    if isinstance(names[0], list):
        return replicate_list.check(model, params)
    if len({n.rpartition(".")[0] for n in names}) > 1:
        return "its expert weights live in several modules (sharded without replication)"
    return ""


def replicate_layer(model, rec, params: dict[str, str], hosts: Hosts, slots_per_rank: int, adaptive: bool,
                    capacity_factor: float | None) -> tuple[ReplicaLayer, dict[str, int]]:
    """Replace a stacked or flat layer's expert weights (``replicable``) by this rank's slots of the uniform
    placement; returns the layer and each weight's global dim 0."""
    group, rank, world = hosts.groups.group, hosts.groups.rank, hosts.groups.world
    E = rec.spec.experts.num_experts
    S = slots_per_rank
    names, experts = list(params.values()), None
    first = names[0][0] if isinstance(names[0], list) else names[0]
    unset = getattr(model.get_parameter(first), LAZY, False)  # (built on meta: its weights hold no values yet)
    if isinstance(names[0], list):  # a ModuleList's experts: their weights stacked, the slots on the list
        module, attrs, full, experts, grads = replicate_list.stack(model, params)
        prefix = next(n for n, m in model.named_modules() if m is module)
        names = [f"{prefix}.{a}" for a in attrs]
    else:
        module = model.get_submodule(names[0].rpartition(".")[0])
        attrs = [n.rpartition(".")[2] for n in names]
        full = [module._parameters[a] for a in attrs]
        grads = [w.requires_grad for w in full]
    per_expert = [w.detach() if w.shape[0] == E and w.dim() > 1 else w.detach().reshape(E, w.shape[0] // E,
                                                                                          *w.shape[1:])
                  for w in full]  # [E, R, ...]: a stacked weight as it is, a flat one's rows per expert
    part = ExpertPartition(per_expert, rank, world, split=hosts.share())
    placement = uniform(E, world, S)
    mine = placement[rank * S:(rank + 1) * S]
    rows = {}
    for attr, w, grouped, grad in zip(attrs, full, per_expert, grads):
        local = grouped[mine].reshape(-1, *w.shape[1:]).clone()
        slot = nn.Parameter(local, grad)
        slot._moe_sharded = slot._moe_replicated = True
        module._parameters[attr] = slot
        rows[attr] = w.shape[0]
    module.register_buffer(REPLICAS, placement, persistent=False)
    if experts is not None:
        replicate_list.read_from_slots(module, attrs, experts, rec.path, group.group_name)
    _refuse_other_optimizers()
    layer = ReplicaLayer(rec.path, module, attrs, part, placement, S, adaptive, capacity_factor or 0.0, hosts,
                         names, experts, unset)
    if unset:  # (``from_slots``: written in place since, by the user's initialization)
        layer.versions = [p._version for p in layer.slot_parameters()]
    module.register_state_dict_post_hook(_state(layer, group))
    module._register_load_state_dict_pre_hook(_load(layer, group), with_module=True)
    module._moe_rows = {}  # not sharded by rows: the optimizer state is ExpertOptimizer's
    rec.sharding = (f"{S} expert slots on each of {world} ranks ({', '.join(names)}), {E} experts placed "
                    f"{'in proportion to the routing of each step' if adaptive else 'evenly, never moved'} "
                    f"(replication={'adaptive' if adaptive else 'static'}), each routed row to one instance of "
                    f"its expert, {'dropless' if not capacity_factor else f'capacity factor {capacity_factor}'}; "
                    f"master weights and optimizer state: 1/{world * part.count} of each expert on each rank's host")
    return layer, rows


def state_keys(model) -> dict[str, tuple[frozenset[str], str]]:
    """Each state_dict key of a replicating layer of ``model`` -> (every key of that layer, the name of the module
    holding them): its weights load together, the master parts holding them side by side; {} without replication."""
    info = getattr(model, "_moe_parallel", None)
    names = {id(m): n for n, m in model.named_modules()}
    out = {}
    for layer in getattr(info, "replicas", []):
        prefix = names[id(layer.module)] + "." if names[id(layer.module)] else ""
        rels = layer.attrs if layer.experts is None else [rel for role in layer.experts for rel in role]
        keys = frozenset(prefix + rel for rel in rels)
        out.update(dict.fromkeys(keys, (keys, names[id(layer.module)])))
    return out


def from_slots(layer: ReplicaLayer, group) -> bool:
    """A layer built on meta (``unset``) whose slot weights were all initialized in place since (transformers'
    ``init_weights()``): each expert's master weights taken from its first instance (the placement's first slot
    holding it), the same in every copy of the experts (the first copy's), and sent to every instance, so that
    they agree. Every rank of ``group`` (the expert-parallel group) calls it together; False, nothing changed,
    where some rank's slot weights were not all written (a load may still set them)."""
    written = all(p._version != v for p, v in zip(layer.slot_parameters(), layer.versions))
    agreed = torch.tensor([int(written)])
    for among in (*layer.host_mesh.get_all_groups(), layer.hosts.copies):  # (host tensors: gloo groups)
        if among is not None:
            dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=among)
    if not agreed.item():
        return False
    from moecompile.runtime.placement.expert_state import collect, distribute, reduce_instances

    S, rank, placement = layer.slots_per_rank, layer.part.rank, layer.placement.cpu()
    chosen = torch.zeros(placement.numel(), dtype=torch.bool)
    chosen[[placement.tolist().index(e) for e in torch.unique(placement).tolist()]] = True  # each expert's first
    with torch.no_grad():
        rows = layer.part.flatten([p.reshape(S, -1) for p in layer.slot_parameters()]).float()
        rows *= chosen[rank * S:(rank + 1) * S, None].to(rows.device)
        whole = collect(reduce_instances(rows, layer.placement, layer.hosts.groups), layer.placement, layer.part,
                        group)  # (this rank's [E, P_w] part)
        if layer.hosts.copies is not None:
            dist.broadcast(whole, group=layer.hosts.copies, group_src=0)
        layer.part.master.copy_(layer.part.share(whole))
        layer.write_slots(distribute(layer.part, layer.placement, group, rows.device))
    layer.unset = False
    return True


def host_mesh(group, every: list[list[int]]):
    """The hosts of ``group`` (one of the expert-parallel groups ``every``) as a 1-D DeviceMesh: over ``group``
    where it takes CPU tensors (gloo, or "cpu:gloo,cuda:nccl"), else over a gloo group of its ranks, made once for
    each of ``every`` on every rank (NCCL alone moves no CPU tensor)."""
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    if "gloo" in str(dist.get_backend(group)):
        return init_device_mesh("cpu", (dist.get_world_size(),)) if group is dist.group.WORLD else \
            DeviceMesh.from_group(group, "cpu")
    return DeviceMesh.from_group(_gloo_group(every), "cpu")


def _gloo_group(every: list[list[int]]):
    """This rank's gloo group among the groups ``every`` (global ranks), made once for each of them on every rank
    (per default process group: a later init_process_group makes them again)."""
    key = (dist.group.WORLD, str(every))
    if key not in _GLOO:
        for stale in [k for k in _GLOO if k[0] is not dist.group.WORLD]:
            del _GLOO[stale]
        _GLOO[key] = dist.new_subgroups_by_enumeration(every, timeout=_timeout(), backend="gloo")[0]
    return _GLOO[key]


_GLOO: dict = {}  # (the default group, a list of groups) -> the gloo group of this rank's
_HOOK = None


def _refuse_other_optimizers() -> None:
    """A torch optimizer stepping slot weights would train each instance on its own (and never re-place them):
    refused, naming the fix (a global step pre-hook, installed once)."""
    global _HOOK
    if _HOOK is not None:
        return
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    def check(optimizer, args, kwargs):
        if any(getattr(p, "_moe_replicated", False) for g in optimizer.param_groups for p in g["params"]):
            raise ValueError("this optimizer steps replicated expert slots (moecompile.parallelize(..., "
                             "replication=...)): train the model with moecompile.ExpertOptimizer(model, "
                             "torch.optim.AdamW, ...), which steps the experts' master weights and re-places them")

    _HOOK = register_optimizer_step_pre_hook(check)


def _whole(layer: ReplicaLayer, group) -> list[torch.Tensor]:
    """The layer's weights whole, ``[E, ...]`` each, from every rank's master part (every rank calls it)."""
    part, device = layer.part, layer.slot_parameters()[0].device  # (NCCL gathers device tensors)
    E, size = part.master.shape[0], part.bounds[1] - part.bounds[0]  # every part padded to the first's size
    mine, held = torch.zeros(E, size, device=device), part.whole()  # (this rank's part, from its shares)
    mine[:, :held.shape[1]] = held
    parts = [torch.empty_like(mine) for _ in range(part.world)]
    dist.all_gather(parts, mine, group=group)
    flat = torch.cat([p[:, :part.bounds[r + 1] - part.bounds[r]] for r, p in enumerate(parts)], 1)
    return part.unflatten(flat)


def _stacked(layer: ReplicaLayer) -> list[bool]:
    """Per weight: stacked ``[E, ...]`` (its master pieces are a DTensor of the weight itself), not flat."""
    return [shape == tuple(slot.shape[1:]) for shape, slot in zip(layer.part.shapes, layer.slot_parameters())]


def _state(layer: ReplicaLayer, group):
    """The state_dict's replicated weights: a stacked one as the DTensor ``Shard(1)`` of the whole ``[E, ...]``
    over the ranks' hosts (each rank's master piece, in the weight's dtype: nothing gathered); a flat one
    ``[E x R, ...]`` whole, gathered from every rank's master part."""
    def hook(module, state_dict, prefix, local_metadata):
        stacked = _stacked(layer)
        pieces = layer.part.dtensors(layer.part.master.detach(), layer.host_mesh)
        if layer.experts is not None:  # each expert's weights under their own names
            pieces = [piece.to(dtype) for piece, dtype in zip(pieces, layer.part.dtypes)]
            replicate_list.to_experts(state_dict, prefix, layer.attrs, layer.experts, pieces, layer.host_mesh)
            return
        whole = _whole(layer, group) if not all(stacked) else [None] * len(stacked)
        for attr, piece, w, dtype, slot, is_stacked in zip(layer.attrs, pieces, whole, layer.part.dtypes,
                                                           layer.slot_parameters(), stacked):
            state_dict[prefix + attr] = (piece.to(dtype) if is_stacked
                                         else w.reshape(-1, *slot.shape[1:]).to(slot.device))
    return hook


def _load(layer: ReplicaLayer, group):
    """Replicated weights into the master part and this rank's slots: whole ``[E, ...]`` tensors (the slots from
    them) or DTensors (each rank's piece to its master part, the slots then sent from the master parts, as the
    optimizer step sends them: every rank loads together)."""
    def hook(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
        from torch.distributed.tensor import DTensor

        from moecompile.runtime.placement.expert_state import distribute

        keys = [prefix + a for a in layer.attrs]
        if layer.experts is not None and not replicate_list.from_experts(state_dict, prefix, layer.attrs,
                                                                         layer.experts, layer.host_mesh, layer.path):
            return  # (each expert's weights under their own names, as the layer's [E, ...] under the slots' names)
        if not any(k in state_dict for k in keys):
            return
        if not all(k in state_dict for k in keys):
            raise ValueError(f"the state of {layer.path} holds some of its expert weights, not all: {keys}")
        values = [state_dict[k] for k in keys]
        with torch.no_grad():
            layer.part.master.copy_(layer.part.part_of(values, layer.host_mesh))
        layer.unset = False
        if any(isinstance(v, DTensor) for v in values):
            device = layer.slot_parameters()[0].device
            rows = layer.part.unflatten(distribute(layer.part, layer.placement, group, device))
        else:
            S, rank, E = layer.slots_per_rank, layer.part.rank, layer.part.master.shape[0]
            hosted = layer.placement[rank * S:(rank + 1) * S]
            rows = layer.part.unflatten(layer.part.flatten([v.reshape(E, -1) for v in values])[hosted])
        for k, slot, w in zip(keys, layer.slot_parameters(), rows):  # the load copies this rank's slots
            state_dict[k] = w.reshape(slot.shape)
    return hook
