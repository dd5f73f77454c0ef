"""moecompile.parallelize: shard each MoE layer's experts over the ranks of a device mesh (expert parallelism).

    mesh  = init_device_mesh("cpu", (2, 2), mesh_dim_names=("node", "local"))
    model = moecompile.parallelize(model, mesh, example_input_ids)   # every rank: the same model and seed
    model = torch.compile(model, backend="moe")

1. Detect with the backend's own passes (``explain``) on the MoE blocks traced alone (``find_blocks.py``), on
   every rank.
2. Check that every rank found the same layers and holds the same weights (else ``ValueError``).
3. Keep on each rank its E / W consecutive experts of every layer (W = mesh size). A stacked (or flat
   ``[E * R, ...]``) parameter becomes the local ``[E / W, ...]`` shard, and the module reads, in its place,
   ``moe.ep_global_view`` of it: the global ``[E, ...]`` shape for Dynamo and detect, no value
   (``runtime/comm/ops.py``); an ``nn.ModuleList`` keeps its local experts' weights and reads the others' as
   ``moe.ep_remote_expert``. The backend's ``distribute`` pass then runs the experts where they live.
4. ``state_dict()`` gives each sharded parameter as a DTensor ``Shard(0)`` over the mesh (its global identity, for
   ``torch.distributed.checkpoint``); ``load_state_dict`` takes a DTensor or a full ``[E, ...]`` tensor.
5. Data parallelism for the rest (``grads.py``): in backward, the gradients of the parameters that are not sharded
   are averaged over the data-parallel ranks (one all-reduce of their flattened incoming gradients when backward
   ends), and the sharded experts' gradients (which gather every rank's tokens) divided by the ranks whose tokens
   they saw: the gradients of the mean loss, as DDP.
6. On a mesh with a ``"tp"`` dimension, ``moe_tp`` (``moe_tp.py``) says whether each tp rank routes all its tokens
   or its slice of them (sequence-sharded MoE blocks).

Why not DTensor parameters: the model's own experts code (transformers' grouped_mm / batched_mm / eager forms)
mixes the expert weights with plain activation tensors, which DTensor refuses ("mixed torch.Tensor and DTensor")
both eagerly and while Dynamo traces; plain local shards behind a global-shaped view trace as on one device.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch import nn

import moecompile.runtime.comm.ops  # noqa: F401  (registers moe::ep_global_view)
from moecompile.runtime.stats import recording_routing

from . import copies as copies_mod
from . import domains as domains_mod
from . import meta as meta_mod
from . import moe_tp as moe_tp_mod
from . import ted
from .find_blocks import explain_blocks
from .grads import GradientSync, fsdp_wraps
from .hf_tp import take_back_experts
from .mesh import (check_dedup, describe, ep_shape, expert_copies, level_names, piece_copies_group, replicate_group,
                   setup_mesh, stage_group)
from moecompile.runtime.placement.replication import check_slots
from .replicate import check_options, replicable, replicate_layer, setup as replicate_setup
from .shardable import check_ranks_agree, expert_tensors, identity_shard, identity_slots, rows_home, unshardable
from .sharded_state import DOMAIN_SLOTS, SLOTS, experts_module, global_state, list_prefix, local_state
from .views import guard_owned, leave_out_of_fsdp, read_remote, read_through_view, refuse_ddp


def parallelize(model: nn.Module, mesh, *example_args, dedup: str = "off", link_model=None, swap_every: int = 0,
                swap_gamma: float = 10.0, replication: str = "off", slots_per_rank: int | None = None,
                capacity_factor: float | None = None, moe_tp: str = "off", expert_domains=None, compress=None,
                reshard_after_forward: bool = False, **options) -> nn.Module:
    """Shard the experts of every MoE layer of ``model`` over ``mesh`` (in place; returns ``model``).

    ``dedup``: ``"off"`` (one row per (token, expert) over the whole mesh), ``"node"`` (one row per distinct
    (token, node) across nodes; a ("node", "local") mesh; on a mesh of more levels, any level but the innermost:
    ``"rack"`` on ("rack", "node", "local")...) or ``"auto"`` (per layer, "off" or the level the link model
    predicts fastest for the routing of ``example_args``; ``link_model``: a ``LinkModel`` or the JSON file
    ``python -m moecompile calibrate`` wrote). ``swap_every=N``: every N optimizer steps, swap a pair of experts
    of each sharded layer where that lowers the predicted time of its last routing (smooth max over the ranks,
    ``swap_gamma``; ``moecompile/distributed/swap.py``). ``replication="adaptive"`` (or ``"static"``) with
    ``slots_per_rank=S``: each rank holds S expert slots, instances of the experts placed by the routing of each step,
    their master weights and optimizer state on the hosts (train with ``moecompile.ExpertOptimizer``;
    ``capacity_factor``: rows per instance, ceil(factor x routed rows / slots), the rest dropped;
    ``moecompile/distributed/replicate.py``). ``moe_tp`` on a mesh with a ``"tp"`` dimension (the ranks whose
    MoE-block inputs are identical): ``"off"`` (each tp rank routes all its tokens), ``"ssmb"`` (each routes its
    slice) or ``"ted"`` (experts over the other dimensions, their intermediate size over tp;
    ``moecompile/distributed/moe_tp.py``). ``expert_domains={level: size}``: the workers of each level that form
    one domain all-gather their experts, only tokens for other domains' experts travel (HybridEP;
    ``moecompile/distributed/domains.py``); ``"auto"``: each layer's sizes by the stream model, on ``link_model``;
    ``compress=q``: each gathered expert sent as the mean expert's residual, its q largest entries (not exact);
    ``reshard_after_forward=True``: the gathered copies freed after forward and gathered again in backward.
    ``mesh``: an outermost dimension named ``"dp_replicate"`` keeps copies of the experts, one per index (each group
    over the other dimensions; ``mesh.py``; ``"dp_shard"``: each copy split over its ranks, ``copies.py``; both:
    HSDP); one named ``"pp"`` holds pipeline stages, each index its own stage module (``model``; the copies' may
    follow it). A ``model`` on the meta device: each rank allocates its expert shards, the rest on
    ``model.to_empty(device=...)`` (``meta.py``). Other keyword arguments are backend options."""
    group = setup_mesh(mesh)
    copies = expert_copies(mesh)
    tp = moe_tp_mod.check(moe_tp, mesh, dedup, swap_every, replication)
    take_back_experts(model, tp.tp_group if tp is not None else None)  # transformers' tp_plan="auto" experts
    gathers = (compress, reshard_after_forward)  # how each domain gathers its experts
    domains = domains_mod.check(expert_domains, *gathers, mesh, link_model, dedup=dedup != "off",
                                swap_every=bool(swap_every), replication=replication != "off", moe_tp=tp is not None)
    domains = domains_mod.prepare(mesh, domains, *gathers)  # its Domains, None or "auto"
    split = copies_mod.setup(mesh, reshard_after_forward, compress=bool(compress))  # ("dp_shard": copies.py)
    check_dedup(dedup, mesh)
    check_options(replication, slots_per_rank, capacity_factor, dedup, swap_every)
    device = meta_mod.check(model, mesh, dedup, domains)  # a model built on meta: its device (meta.py)
    if not isinstance(swap_every, int) or swap_every < 0:
        raise ValueError(f"swap_every must be a whole number of optimizer steps >= 0 (0: never); got {swap_every!r}")
    link = _link_model(link_model) if dedup == "auto" or link_model is not None else None
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    auto = dedup == "auto" or domains == "auto"  # (the choice reads the example's routing)
    with recording_routing() as routing:  # the torch references record it (Triton kernels would not)
        report = explain_blocks(model, example_args, device, twins=not auto,  # (a block untraced records no routing)
                                **({**options, "lowering": "torch"} if auto else options))
    names = {id(p): name for name, p in model.named_parameters(remove_duplicate=False)}
    plans, left = [], []
    for rec in report.layers:
        rec.moe_tp = moe_tp_mod.layer_mode(rec, moe_tp, tp, example_args, world)
        why = unshardable(rec, tp.ep if rec.moe_tp == "ted" else world)
        if why:
            left.append((rec.path, why))
            continue
        plans.append((rec, {role: [names[id(p)] for p in w] if isinstance(w, list) else names[id(w)]
                            for role, w in rec.expert_weights.items()}))
    check_ranks_agree(model, plans, stage_group(mesh))  # every rank (the copies of each expert too) or the stage's
    _choose_dedup([rec for rec, _ in plans], dedup, link, routing, mesh, group)
    if replication != "off":  # every layer's slots checked before any layer changes
        for rec, params in plans:
            if not (rows_home(rec) or replicable(model, params)):  # (the layers that replicate)
                check_slots(rec.spec.experts.num_experts, world, slots_per_rank)
        hosts = replicate_setup(mesh, group)  # (every rank, every stage's: groups made together)
    divisors, swapping, replicas = {}, [], []  # sharded expert parameter held here -> its gradient's divisor
    for rec, params in plans:  # every layer checked before any changes
        if rec.moe_tp == "ted":
            ted.check(rec, tp)
        if domains is not None:
            domains_mod.check_layer(rec, compress)
    if domains == "auto":
        records = [rec for rec, _ in plans]
        pre = domains_mod.pre_expert_seconds(model, [r.path for r in records], example_args, group)
        # priced for a training step unless the experts take no gradient (a model served: requires_grad_(False))
        training = any(p.requires_grad for rec in records for p in expert_tensors(rec))
        domains_mod.choose(records, link, routing, mesh, group, pre, training, reshard_after_forward)
    meta_mod.materialize(model, device, lazy={id(w) for rec, _ in plans for w in expert_tensors(rec)})  # (meta.py)
    for rec, params in plans:
        why_not = (rows_home(rec) or replicable(model, params)) if replication != "off" else "not asked"
        if why_not and replication != "off":
            rec.shard_note = f"not replicated: {why_not}"
        if not why_not:
            layer, rows = replicate_layer(model, rec, params, hosts, slots_per_rank, replication == "adaptive",
                                          capacity_factor)
            read_through_view(layer.module, rows, group.group_name, rec.path, "off", layer.capacity_factor,
                              extra=moe_tp_mod.view_args(rec.moe_tp, tp))
            divisors.update(dict.fromkeys(layer.names, _divisor(tp, rec.moe_tp, world, copies)))
            replicas.append(layer)
            if tp is not None:
                rec.sharding += "; " + moe_tp_mod.describe(rec.moe_tp, tp)
            if split:  # ("dp_shard": each copy's slots whole all the same)
                rec.sharding += "; " + split.replicated()
            continue
        first = next(iter(params.values()))
        slots = torch.arange(rec.spec.experts.num_experts, device=model.get_parameter(
            first[0] if isinstance(first, list) else first).device) if swap_every and world > 1 else None
        if slots is not None and isinstance(first, list) and list_prefix(first) is None:
            slots, rec.shard_note = None, "its experts' weights are not named <list>.<i>.<weight>: not swapped"
        layer_split = split and split.for_layer(rec.spec.experts)  # ("dp_shard": where its fused weight holds 2I)
        if rec.moe_tp == "ted":
            held = ted.shard(model, rec, params, mesh, tp, layer_split)
        else:
            layer_domains = domains_mod.setup(mesh, rec.domain_sizes, *gathers) if domains == "auto" else domains
            held = _shard_layer(model, rec, params, mesh, group, rank, world, slots, tp, layer_domains, layer_split)
            if domains == "auto":
                rec.sharding += "; " + rec.domain_reason
        divisors.update(dict.fromkeys(held, _divisor(tp, rec.moe_tp, world, copies)))
        if slots is not None:
            swapping.append((rec, _swapped_tensors(model, params, held), slots))
    meta_mod.finish(model, device)  # (a model built on meta: what the sharding left whole)
    for rec in report.layers:  # the full expert weights it holds would stay alive (the sharding freeing nothing)
        rec.expert_weights = {}
    dense = stage_group(mesh)  # the ranks holding the same dense weights: the world, or a pipeline stage's ranks
    sync = GradientSync(model, divisors, *((tp.dp_group, tp.dp) if tp is not None else (dense, dist.get_world_size(
                        dense))), expert_group=replicate_group(mesh), copies=copies,
                        piece_group=piece_copies_group(mesh))  # (HSDP: the ranks holding the same pieces)
    model._moe_parallel = ParallelInfo(report, left, world, mesh, group)
    model._moe_parallel.sync, model._moe_parallel.copies = sync, copies
    replicated = {layer.path for layer in replicas}  # (a replicated ModuleList's weights: in its slots)
    model._moe_parallel.module_list_experts = {n for rec, params in plans if rec.path not in replicated
                                               for names in params.values() if isinstance(names, list) for n in names}
    model._moe_parallel.replicas = replicas
    model._moe_parallel.fsdp_left_out = leave_out_of_fsdp(model)
    refuse_ddp(model)  # DistributedDataParallel would overwrite every rank's experts with rank 0's
    if swapping:
        from .swap import ExpertSwap

        model._moe_parallel.swap = ExpertSwap(swapping, swap_every, swap_gamma, link, mesh, group, model)
    return model


def _divisor(tp, mode: str, world: int, copies: int = 1) -> int:
    """What a sharded expert weight's gradient is divided by: the ranks of its expert-parallel group whose tokens
    reach it (``world``: the group's size; the tp setup's dp counts every copy's ranks)."""
    return tp.expert_divisor(mode, world * copies) // copies if tp is not None else world


class ParallelInfo:
    """What parallelize did: the detection report, the layers it left whole (and why), the expert-parallel size."""

    def __init__(self, report, left: list[tuple[str, str]], world: int, mesh, group):
        self.report, self.left, self.world, self.mesh, self.group = report, left, world, mesh, group
        self.swap = None  # the ExpertSwap of a model parallelized with swap_every
        self.module_list_experts: set[str] = set()  # every weight name of the sharded ModuleList experts (all ranks')
        self.replicas: list = []  # the ReplicaLayer of each layer whose experts replicate (replicate.py)
        self.fsdp_left_out: list[str] = []  # the modules holding expert shards that FSDP2's fully_shard leaves out
        self.copies = 1  # the ranks holding each expert (a mesh's "dp_replicate" or "dp_shard" size)
        self.sync = None  # the GradientSync of its parameters' gradients (grads.py)

    def __str__(self) -> str:
        lines = [describe(self.mesh, self.world, self.copies, bool(self.replicas))]
        lines += [f"  sharded {r.path}: {r.sharding}" for r in self.report.layers if r.sharding]
        lines += [f"  left whole (replicated) {path}: {why}" for path, why in self.left]
        if self.fsdp_left_out and self.sync is not None and fsdp_wraps(self.sync.model):
            lines.append(f"  FSDP2's fully_shard leaves out {len(self.fsdp_left_out)} module(s) holding expert shards "
                         "(moecompile reduces their gradients)")
        return "\n".join(lines + ([f"  {self.sync}"] if self.sync is not None and self.sync.late else []))


def _link_model(link_model):
    from moecompile.runtime.comm.cost_model import LinkModel

    if isinstance(link_model, LinkModel):
        return link_model
    if link_model is None:
        raise ValueError("dedup='auto' chooses by a link model: pass link_model= a LinkModel or the JSON file that "
                         "`torchrun --nproc-per-node N -m moecompile calibrate --mesh NODESxLOCAL --out links.json` "
                         "wrote")
    return LinkModel.load(link_model)


ONE_ROW_PER_EXPERT = ("the routing weight scales each expert's input (weights on the input): a token's rows differ "
                      "per expert, there is nothing to dedup")


def _choose_dedup(records, dedup: str, link, routing: dict, mesh, group) -> None:
    """Each layer's dedup level; for "auto", the least predicted time of one dispatch and combine of every rank's
    example routing (gathered, so every rank makes the same choice). A layer whose routing weights scale the
    experts' input sends one row per (token, expert): "off"."""
    if dedup == "auto":
        _choose_by_time(records, link, routing, mesh, group)
    else:
        for rec in records:
            rec.dedup, rec.dedup_reason = dedup, "chosen by the caller"
    for rec in records:
        if rec.spec.routing.weights_on_input and rec.dedup != "off":
            rec.dedup, rec.dedup_reason = "off", ONE_ROW_PER_EXPERT


def _choose_by_time(records, link, routing: dict, mesh, group) -> None:
    from moecompile.runtime.comm.cost_model import choose_dedup, dispatch_times
    from moecompile.runtime.comm.plan import Placement

    every = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, {rec.path: routing.get(rec.path) for rec in records}, group=group)
    for rec in records:
        ids = [mine[rec.path] for mine in every]
        if any(i is None for i in ids):
            rec.dedup, rec.dedup_reason = "off", "no routing was recorded on the example input"
            continue
        e = rec.spec.experts
        weight = next(iter(rec.expert_weights.values()))
        elem = (weight[0] if isinstance(weight, list) else weight).element_size()  # a ModuleList: its first expert
        source = torch.cat([torch.full((len(i),), r) for r, i in enumerate(ids)])
        ids = torch.cat(ids)
        if e.identity_experts:  # their rows stay home (an id < 0: cost_model.messages)
            ids = torch.where(ids < e.num_experts, ids, -1)
        times = dispatch_times(ids, Placement.contiguous(e.num_experts, ep_shape(mesh)), source,
                               e.hidden, elem, link, names=level_names(mesh))
        rec.dedup, rec.predicted_s = choose_dedup(times), times
        rec.dedup_reason = ("least predicted time of one dispatch and combine of the example routing: " +
                            ", ".join(f"{k} {v * 1e3:.3g} ms" for k, v in times.items()))


def _shard_layer(model, rec, params: dict, mesh, group, rank: int, world: int, slots=None, tp=None, domains=None,
                 split=None) -> set[str]:
    """Keep this rank's experts of one layer; returns the names of the expert parameters it still holds."""
    dedup, E = rec.dedup, rec.spec.experts.num_experts
    views = moe_tp_mod.view_args(rec.moe_tp, tp)  # the views' moe_tp and tp_group
    local_E = E // world
    mine = range(rank * local_E, (rank + 1) * local_E)
    if isinstance(next(iter(params.values())), list):
        held = _shard_module_list(model, params, mine, group, rec.path, dedup, slots, views, domains, E, split)
    else:
        held = _shard_stacked(model, params, mesh, group, rank, world, rec.path, dedup, slots, views, domains, E,
                              rec.spec.experts.identity_experts, split)
    names = sorted(n for v in params.values() for n in (v if isinstance(v, list) else [v]))
    listed = names if len(names) <= 4 else names[:2] + [f"... {len(names)} in all"]
    how = "one row per (token, expert)" if dedup == "off" else (
        f"one row per (token, {dedup}) across {dedup}s, copied to the experts inside the {dedup}, their outputs "
        "weighted and summed there")
    how += f" (dedup={dedup!r}: {rec.dedup_reason})"
    rec.sharding = (f"{local_E} of {E} experts on each of {world} ranks ({', '.join(listed)}); "
                    f"the rows cross the ranks padding-free, {how}")
    if tp is not None:
        rec.sharding += "; " + moe_tp_mod.describe(rec.moe_tp, tp)
        if rec.moe_tp_choice is not None:
            rec.sharding += f"; {rec.moe_tp_choice}"
    if domains is not None:
        rec.sharding += "; " + domains.describe()
    if split is not None:
        rec.sharding += "; " + split.describe(model, held, isinstance(next(iter(params.values())), list))
    if slots is not None:
        rec.sharding += "; experts swap ranks during training (swap_every)"
    elif getattr(rec, "shard_note", None):
        rec.sharding += f"; {rec.shard_note}"
    return held


def _swapped_tensors(model, params: dict, held: set[str]) -> list:
    """What an expert swap moves rows of, per weight: a stacked or flat shard (its rows, expert by expert), or the
    list of a ModuleList layer's local experts' weights of one role (in slot order, stacked to move)."""
    return [[model.get_parameter(n) for n in names if n in held] if isinstance(names, list)
            else model.get_parameter(names) for names in params.values()]


def _shard_stacked(model, params: dict[str, str], mesh, group, rank, world, layer, dedup, slots, views,
                   domains=None, num_experts=0, identity=0, split=None) -> set[str]:
    """Stacked ``[E, ...]`` weights, or flat ``[E * R, ...]`` ones (R rows per expert): each rank keeps its
    consecutive 1 / world of dim 0 (its E / world experts). With ``domains`` the module reads them through views
    of its domain (gathered) and exchange groups."""
    exchange, views = domains_mod.view_args(domains, group, views)
    attrs = {}
    for role, name in params.items():
        module_name, _, attr = name.rpartition(".")
        module = model.get_submodule(module_name)
        full = module._parameters[attr]
        per_rank = full.shape[0] // world
        rows = full.detach()[rank * per_rank:(rank + 1) * per_rank]
        if identity and full.shape[0] == num_experts + identity:  # spare rows after the experts' (shardable.py)
            rows = identity_shard(full.detach(), num_experts, rank, world)
            module.__dict__.setdefault("_moe_row_slots", {})[attr] = functools.partial(  # (after swaps too)
                identity_slots, num_experts, full.shape[0], world, device=full.device)
        rows = split.cut(module, attr, rows, role) if split is not None else rows  # ("dp_shard": this rank's piece)
        shard = nn.Parameter(rows.clone(), full.requires_grad)
        shard._moe_sharded = True
        module._parameters[attr] = shard
        attrs.setdefault(module, {})[attr] = full.shape[0]
    order = domains.slots(num_experts, shard.device) if domains is not None else None  # the layer's, once
    if order is not None and torch.equal(order, torch.arange(num_experts, device=order.device)):
        order = None  # the gathered order is expert order: nothing to sort
    for module, rows in attrs.items():
        if slots is not None:  # the placement, a graph input read by the ops (not saved: state_dict un-swaps)
            module.register_buffer(SLOTS, slots, persistent=False)
        if order is not None:  # each expert's slot in the exchange group's order (a graph input)
            module.register_buffer(DOMAIN_SLOTS, order, persistent=False)
        read_through_view(module, rows, exchange, layer, dedup, extra=views)
        module._moe_rows = rows  # read by sharded_state.sharded_parameters (optimizer state)
        module.register_state_dict_post_hook(global_state(rows, mesh, group))
        module._register_load_state_dict_pre_hook(local_state(rows, mesh, rank, group), with_module=True)
    return set(params.values())


def _shard_module_list(model, params: dict[str, list[str]], mine: range, group, layer, dedup, slots, views,
                       domains=None, num_experts=0, split=None) -> set[str]:
    """An ``nn.ModuleList`` layer: the weights of the experts other ranks hold are dropped (not parameters here,
    not in this rank's state_dict: ``torch.distributed.checkpoint`` gets each expert from the rank holding it);
    while Dynamo traces, the module reads each as ``moe.ep_remote_expert`` (its shape, no value). With ``slots``
    (the layer swaps experts) the list's entry i is slot i: the state_dict names each by the expert it holds. With
    ``domains`` the remote experts' views name the domain and exchange groups (the distribute pass gathers the
    domain's experts, stacked, and unbinds them again). With ``split`` ("dp_shard": ``copies.py``) each local
    expert's weights are this rank's pieces, read through views of their whole shape."""
    if slots is not None:
        experts_module(model, next(iter(params.values())), slots)
    group_name, views = domains_mod.view_args(domains, group, views)
    order = domains.slots(num_experts) if domains is not None else None
    if order is not None and torch.equal(order, torch.arange(num_experts)):
        order = None  # the gathered order is expert order: nothing to sort
    held = set()
    for role, names in params.items():
        like = model.get_parameter(names[mine.start])  # a local expert's weight of this role: the shape
        like = (tuple(like.shape), like.dtype, like.device, names[mine.start])
        for expert, name in enumerate(names):
            if expert in mine:
                held.add(name)
                module_name, _, attr = name.rpartition(".")
                module = model.get_submodule(module_name)
                if split is not None and split.cut_expert(module, attr, role):  # (a lazy weight: its piece alone)
                    if slots is not None:  # (its view is the layer's first: it carries the placement too)
                        module.register_buffer(SLOTS, slots, persistent=False)
                    read_through_view(module, {attr: 1}, group_name, layer, dedup, extra=views,
                                      full_shapes={attr: like[0]})
                    continue
                meta_mod.realize(module, attr)  # (a model built on meta: meta.py)
                guard_owned(module, attr, layer)  # FSDP2 must not take it over
                continue
            module_name, _, attr = name.rpartition(".")
            module = model.get_submodule(module_name)
            del module._parameters[attr]
            if slots is not None:  # the placement, a graph input read by the ops (as a stacked layer's)
                module.register_buffer(SLOTS, slots, persistent=False)
            if order is not None:  # each expert's slot in the exchange group's order (as a stacked layer's)
                module.register_buffer(DOMAIN_SLOTS, order.to(like[2]), persistent=False)
            read_remote(module, attr, like, expert, name, group_name, layer, dedup, views)
    return held
