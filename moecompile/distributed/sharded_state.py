"""The state_dict of a layer ``moecompile.parallelize`` sharded: each stacked (or flat) expert weight as a DTensor
``Shard(0)`` over the mesh (``Replicate`` over its ``"dp_replicate"`` dimension, ``Shard`` of its cut dimension over
``"dp_shard"``: ``copies.py``), in expert order (its global ``[E, ...]`` or ``[E * R, ...]`` identity, for
``torch.distributed.checkpoint``), and back on load (a DTensor of this mesh, one of another layout gathered whole,
or a full tensor). A layer that swaps experts holds its rows in slot order: they are exchanged to expert order for
the state_dict and back on load. The optimizer state of those weights likewise (``get_optimizer_state_dict``,
``set_optimizer_state_dict``; of a ZeroRedundancyOptimizer too, ``zero.py``)."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from moecompile.runtime.layouts import contiguous_stride

from . import copies, ted, zero
from .gather import first_rank, whole_on
from .mesh import stage_group, state_mesh

SLOTS = "moe_expert_slots"  # the buffer holding a swapping layer's placement (expert -> slot)
DOMAIN_SLOTS = "moe_domain_slots"  # expert domains: each expert's slot in the exchange group's gathered order


def to_global(local, total: int, held, mesh, group):
    """This rank's shard of weight ``held`` (module, name: its placement's slot order, its piece of its copy's:
    ``copies.py``) as the DTensor ``Shard(0)`` of the global ``[total, ...]`` tensor in expert order (every rank
    calls it together), on ``mesh`` (a pipeline stage's sub-mesh under "pp"; over ``"dp_shard"``, ``Shard`` of the
    piece's cut dimension)."""
    from torch.distributed.tensor import DTensor

    mesh, cut = state_mesh(mesh), copies.cut_of(*held)
    local = _placed(local, row_slots(*held), group, to_slots=False)
    shape = copies.whole_shape((total, *local.shape[1:]), cut)
    return DTensor.from_local(local, mesh, copies.placements(mesh, cut), run_check=False, shape=shape,
                              stride=contiguous_stride(shape))


def to_local(value, total: int, held, mesh, rank, group):
    """This rank's shard of weight ``held`` (as ``to_global``'s) from ``value``: a DTensor of this mesh, one of
    another layout (gathered whole), a full ``[total, ...]`` tensor, or this rank's rows; anything else (a scalar)
    as it is."""
    from torch.distributed.tensor import DTensor

    per_rank, mesh = total // group.size(), state_mesh(mesh)
    if isinstance(value, DTensor):  # this mesh's shard as it is; another layout gathered whole
        value = value.to_local() if value.device_mesh == mesh else value.full_tensor()
    if isinstance(value, torch.Tensor) and value.shape[:1] == (total,):  # a full tensor: this rank's rows
        value = value[rank * per_rank:(rank + 1) * per_rank]
    value = copies.mine(value, copies.cut_of(*held))  # (its copy's whole shard: this rank's piece)
    if isinstance(value, torch.Tensor) and value.shape[:1] == (per_rank,):  # rows: into this rank's placement
        return _placed(value, row_slots(*held), group, to_slots=True)
    return value  # anything else (Adam's step count) as it is


def row_slots(module, attr: str):
    """The placement of a sharded weight's rows (slot of each global row; None: in order): the layer's expert swap
    placement, or a weight's own, made from it (spare rows of identity experts: ``shardable.py``)."""
    own = getattr(module, "_moe_row_slots", {}).get(attr)
    return module._buffers.get(SLOTS) if own is None else own(module._buffers.get(SLOTS))


def global_state(rows: dict[str, int], mesh, group):
    """``rows``: each sharded weight's name and global dim 0 (E, or E x R for flat weights)."""
    def hook(module, state_dict, prefix, local_metadata):
        for attr, total in rows.items():
            state_dict[prefix + attr] = to_global(state_dict[prefix + attr], total, (module, attr), mesh, group)
    return hook


def local_state(rows: dict[str, int], mesh, rank, group):
    def hook(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
        for attr, total in rows.items():
            key = prefix + attr
            if key in state_dict:
                state_dict[key] = to_local(state_dict[key], total, (module, attr), mesh, rank, group)
    return hook


def list_prefix(names: list[str]) -> str | None:
    """The ``nn.ModuleList`` path of a ModuleList layer's weights of one role, ``names[i]`` being
    ``<path>.<i>.<rest>`` with one ``rest``; else None."""
    if len(names) < 2:
        return None
    first, second = names[0].split("."), names[1].split(".")
    k = next((i for i, (a, b) in enumerate(zip(first, second)) if a != b), None)
    if k is None or first[k] != "0":
        return None
    path, rest = ".".join(first[:k]), ".".join(first[k + 1:])
    return path if all(n == f"{path}.{i}.{rest}" for i, n in enumerate(names)) else None


def experts_module(model, names: list[str], slots):
    """A ModuleList layer that swaps experts holds in entry i the expert of slot i: its ``state_dict()`` names each
    expert's weights by the expert (``<list>.<expert>.<weight>``, as one process does), and ``load_state_dict``
    puts each in its slot. ``names``: the layer's weights of one role (``list_prefix`` finds the list)."""
    module = model.get_submodule(list_prefix(names))
    module._moe_list_slots = slots

    def to_experts(module, state_dict, prefix, local_metadata):
        _renumber(state_dict, prefix, torch.argsort(module._moe_list_slots))  # slot -> expert

    def to_slots(module, state_dict, prefix, *_):
        _renumber(state_dict, prefix, module._moe_list_slots)  # expert -> slot

    module.register_state_dict_post_hook(to_experts)
    module._register_load_state_dict_pre_hook(to_slots, with_module=True)
    return module


def _renumber(state_dict, prefix: str, new_index) -> None:
    """Keys ``<prefix><i>.<rest>`` renamed ``<prefix><new_index[i]>.<rest>``, all at once."""
    moved = {key: _renumbered(key, prefix, new_index) for key in list(state_dict)}
    state_dict.update({new: state_dict.pop(key) for key, new in moved.items() if new != key})


def _renumbered(key: str, prefix: str, new_index) -> str:
    head, dot, rest = key[len(prefix):].partition(".") if key.startswith(prefix) else ("", "", "")
    return f"{prefix}{int(new_index[int(head)])}.{rest}" if head.isdigit() and dot else key


def expert_order_names(model) -> dict[str, str]:
    """Each parameter name of ``model`` -> the name one process gives it: a ModuleList layer that swapped experts
    holds in ``<list>.<i>`` the expert of slot i."""
    lists = [(f"{path}.", torch.argsort(m._moe_list_slots)) for path, m in model.named_modules()
             if hasattr(m, "_moe_list_slots")]
    out = {}
    for name, _ in model.named_parameters():
        out[name] = name
        for prefix, expert_of_slot in lists:
            out[name] = _renumbered(out[name], prefix, expert_of_slot)
    return out


def sharded_parameters(model) -> dict[str, tuple[int, object]]:
    """Each stacked or flat sharded expert weight of ``model``: name -> (global dim 0, the module holding it)."""
    return {f"{name}.{attr}" if name else attr: (total, module) for name, module in model.named_modules()
            for attr, total in getattr(module, "_moe_rows", {}).items()}


def unwrapped(model):
    """The module ``torch.compile`` wrapped (whose parameter names ``parallelize`` recorded), else ``model``."""
    return getattr(model, "_orig_mod", model)


def _parallel(model):
    info = getattr(model, "_moe_parallel", None)
    if info is None:
        raise ValueError("the model was not given to moecompile.parallelize: use torch.distributed.checkpoint."
                         "state_dict's own get/set_optimizer_state_dict for it")
    return info


def parts_of(model) -> tuple[list, list]:
    """The modules of ``model`` (one, or the list of stage modules a rank runs; a compiled one's own module, whose
    parameters ``parallelize`` named) and their ``ParallelInfo``s (one mesh and group, checked)."""
    parts = [unwrapped(m) for m in (model if isinstance(model, (list, tuple)) else [model])]
    infos = [_parallel(part) for part in parts]
    if not parts or len({id(info.group) for info in infos}) > 1:
        raise ValueError("give the model, or the stage modules this rank runs, each parallelized on the same mesh")
    return parts, infos


def get_optimizer_state_dict(model, optimizer) -> dict:
    """The optimizer's state keyed by parameter name, as ``torch.distributed.checkpoint.state_dict.
    get_optimizer_state_dict`` gives it (``{"state": {name: {...}}, "param_groups": [{..., "params": [names]}]}``),
    with the state of each sharded expert weight that is shaped like it (Adam's moments, SGD's momentum) as a
    DTensor ``Shard(0)`` of the global tensor, in expert order, as the weight itself is in ``model.state_dict()``:
    a ``torch.distributed.checkpoint`` of it loads on any number of ranks, and in one process (torch's
    ``set_optimizer_state_dict``). Each rank's plain shard under one key would be kept once by the checkpoint:
    the other ranks' state lost. (ModuleList experts keep their own keys, one rank each.) An optimizer that has
    not stepped gives the state a step with zero gradients and lr 0 makes, its step count 0 (so that a checkpoint
    loads into it; no expert swap counts it), but keeps none (torch's keeps it: an initial checkpoint changed Adam's
    first update; ``zero.state_made``). Its ``param_groups`` name every rank's parameters, the same on every rank
    (``_every_ranks_groups``). Every rank calls it together; ``optimizer`` None where this rank's part of the
    model trains nothing (``ExpertOptimizer``'s dense part of a pipeline stage whose dense weights are all frozen):
    no state, the other ranks' groups; a ``ZeroRedundancyOptimizer`` (``expert_zero_optimizer``): the state of the
    weights this rank steps. ``model``: the model, or the list of stage modules this rank runs (an interleaved
    pipeline schedule's, one optimizer over them; their parameters keep the model's names)."""
    from .swap import paused

    parts, (info, *_) = parts_of(model)
    if optimizer is None:
        return {"state": {}, "param_groups": _every_ranks_groups(None)}
    with paused(), zero.state_made(optimizer):
        saved = zero.state_dict(optimizer)
    names = _names_by_index(parts, optimizer, saved)
    state = {names[i]: dict(v) for i, v in saved["state"].items()}
    for part in parts:
        for fqn, (total, module) in sharded_parameters(part).items():
            shard = part.get_parameter(fqn)
            for key, value in state.get(fqn, {}).items():
                if isinstance(value, torch.Tensor) and value.shape == shard.shape:
                    held = (module, fqn.rpartition(".")[2])
                    state[fqn][key] = to_global(value, total, held, info.mesh, info.group)
        for fqn, how in ted.parameters(part).items():  # tensor-expert parallel: whole along I, as the weight
            shard = part.get_parameter(fqn)
            for key, value in state.get(fqn, {}).items():
                if isinstance(value, torch.Tensor) and value.shape == shard.shape:
                    state[fqn][key] = ted.to_whole(value, how)
        copies.listed_optimizer_state(part, state, expert_order_names(part), info.mesh, True)  # (ModuleList)
    groups = [{**g, "params": [names[i] for i in g["params"]]} for g in saved["param_groups"]]
    return {"state": state, "param_groups": _every_ranks_groups(groups)}


def _every_ranks_groups(groups: list[dict] | None) -> list[dict]:
    """The parameter groups of every rank's optimizer as one list, the same on every rank (a checkpoint keeps one
    rank's list under its one key: a rank's own names alone would lose the other ranks' ModuleList experts and the
    other pipeline stages' parameters): group i's hyperparameters, equal on every rank, with every rank's names of
    its group i, in rank order. ``groups`` None: this rank has no optimizer (it trains nothing here)."""
    if not dist.is_initialized():
        return groups or []
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, groups)
    held = {r: theirs for r, theirs in enumerate(every) if theirs is not None}
    if not held:
        return []
    hyper = {r: [repr(sorted((k, v) for k, v in g.items() if k != "params")) for g in theirs]
             for r, theirs in held.items()}
    first = min(held)
    differ = [r for r, h in hyper.items() if h != hyper[first]]
    if differ:
        raise ValueError(f"ranks {differ} build their optimizer with other parameter groups than rank {first} (their "
                         "number or hyperparameters): a checkpoint of the optimizer keeps one list of groups for "
                         "every rank (under pipeline stages too); build it the same way on every rank, the same groups "
                         "in the same order, each with its hyperparameters")
    return [{**g, "params": list(dict.fromkeys(n for theirs in held.values() for n in theirs[i]["params"]))}
            for i, g in enumerate(held[first])]


def _every_name(names: set[str]) -> set[str]:
    """Every rank's parameter names (every rank calls it together): other stages' and ranks' ModuleList experts too."""
    if not dist.is_initialized():
        return names
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, sorted(names))
    return set().union(*map(set, every))


def set_optimizer_state_dict(model, optimizer, optim_state_dict) -> None:
    """Load a state from ``get_optimizer_state_dict`` (saved on any number of ranks) or torch's own (one process)
    into the optimizer: each sharded expert weight's state becomes this rank's rows, in its placement; the state of
    parameters other ranks hold (their ModuleList experts, other pipeline stages') is left to them, a name no rank
    holds refused. Every rank calls it together; ``optimizer`` None where this rank's part of the model trains
    nothing (as ``get_optimizer_state_dict``): it loads nothing. ``model``: as ``get_optimizer_state_dict``'s."""
    parts, infos = parts_of(model)
    info, listed = infos[0], set().union(*(i.module_list_experts for i in infos))
    if optimizer is None:
        _every_name(listed)  # (the other ranks gather every rank's names)
        return
    rank = dist.get_rank(info.group)
    current = zero.state_dict(optimizer)
    index = {name: i for i, name in _names_by_index(parts, optimizer, current).items()}
    # the parameters other ranks hold (ModuleList experts, other pipeline stages'): theirs to load
    remote = _every_name(set(index) | listed) - set(index)
    state = {k: dict(v) for k, v in optim_state_dict["state"].items() if k not in remote}
    for part in parts:
        for fqn, (total, module) in sharded_parameters(part).items():
            for key, value in state.get(fqn, {}).items():
                state[fqn][key] = to_local(value, total, (module, fqn.rpartition(".")[2]), info.mesh, rank,
                                           info.group)
        for fqn, how in ted.parameters(part).items():
            for key, value in state.get(fqn, {}).items():
                state[fqn][key] = ted.to_slice(value, part.get_parameter(fqn).shape, how)
        copies.listed_optimizer_state(part, state, expert_order_names(part), info.mesh, False)
    unknown = sorted(set(state) - set(index))
    if unknown:
        raise ValueError(f"the optimizer state names parameters the optimizer does not train ({unknown[:3]}...): "
                         "load it into an optimizer over the same parameters of the same model")
    groups = optim_state_dict["param_groups"]
    mine = [sorted(index.get(n, -1) for n in g["params"] if n not in remote) for g in groups]  # -1: on no rank
    if len(groups) != len(current["param_groups"]) or any(
            m != sorted(g["params"]) for m, g in zip(mine, current["param_groups"])):
        raise ValueError("the optimizer state's parameter groups hold other parameters than the optimizer's: load "
                         "it into an optimizer built the same way over the same model")
    # torch pairs the saved groups' parameters with the optimizer's by position: list them in the optimizer's order
    # (after expert swaps a ModuleList's names, in expert order, no longer follow it)
    groups = [{**g, "params": cur["params"]} for g, cur in zip(groups, current["param_groups"])]
    zero.load_state_dict(optimizer, {"state": {index[n]: v for n, v in state.items()}, "param_groups": groups})


def _names_by_index(parts, optimizer, saved) -> dict[int, str]:
    """The parameter name of each index of ``optimizer.state_dict()`` (``saved``), of the modules ``parts``."""
    names = {}
    for part in parts:
        order = expert_order_names(part)
        mine = {id(p): order[n] for n, p in part.named_parameters()}
        twice = sorted(set(names.values()) & set(mine.values()))
        if twice:
            raise ValueError(f"two stage modules name parameters alike ({twice[:3]}): keep the model's names in each "
                             "stage module (a ModuleDict of its layers, as torchtitan cuts stages)")
        names.update(mine)
    out = {}
    for group, saved_group in zip(optimizer.param_groups, saved["param_groups"]):
        for p, i in zip(group["params"], saved_group["params"]):
            if id(p) not in names:
                raise ValueError("the optimizer trains a tensor that is not a parameter of the model: build it "
                                 "over model.parameters()")
            out[i] = names[id(p)]
    return out


def _placed(rows, slots, group, to_slots: bool):
    """A shard in expert order (checkpoints) from one in slot order (after expert swaps), or back; as it is while
    no expert was swapped (every rank holds the same placement: all exchange, or none does)."""
    from moecompile.runtime.placement.swap import move_rows

    if slots is None or torch.equal(slots.cpu(), torch.arange(slots.numel())):
        return rows
    identity = torch.arange(slots.numel())
    rows = rows.to(slots.device)  # a checkpoint read to the host, exchanged beside the weights (NCCL sends no CPU rows)
    return move_rows(rows, identity, slots, group) if to_slots else move_rows(rows, slots, identity, group)


def check_not_moved(holders) -> None:
    """``holders``: (module, buffer name, the tensor parallelize registered). A model moved after parallelize
    (``model.to(...)``, ``.cuda()``) holds copies of its placement buffers, which the graph reads while expert swap
    and replication would update the tensors they kept: refuse rather than route by a stale placement."""
    for module, name, tensor in holders:
        now = module._buffers.get(name)
        if now is not tensor:
            raise RuntimeError(f"the model was moved after moecompile.parallelize (its {name!r} buffer was replaced, "
                               f"now on {getattr(now, 'device', None)}): move the model to its device before "
                               "moecompile.parallelize(model, mesh, ...), as examples/train_ep.py does")


def full_state_dict(model) -> dict[str, torch.Tensor]:
    """Every weight of ``model`` (or of the model its ``torch.compile`` wrapper holds) whole, in expert order, as one
    process holding the whole model has it: CPU tensors, on every rank (every rank calls it together). For
    transformers' ``save_pretrained(path, state_dict=...)`` or ``torch.save``, where the model fits in host memory
    (else ``moecompile.save_hf_checkpoint``, a layer at a time, or ``torch.distributed.checkpoint``). Stacked, flat
    and tensor-parallel weights are DTensors in ``state_dict()``: each is gathered whole; an ``nn.ModuleList``
    layer's experts are sent to every rank (``whole_groups``). Under pipeline stages: the stage module's."""
    return {name: value for _, weights in whole_groups(model) for name, value in weights.items()}


def whole_groups(model, writers: list[int] | None = None):
    """``full_state_dict``'s weights a group at a time, for a writer that holds one group, not the model: (the
    group's name, {name: whole CPU tensor}): each weight outside the decoder layers alone, then each decoder layer's
    (``<...>.layers.<i>.``, its own ``state_dict()`` taken in its turn: a swapping layer's experts put in expert order
    one layer at a time), then the experts of ``nn.ModuleList`` layers outside decoder layers (one group, last);
    every rank iterates them together (the gathers are collectives). ``writers`` (global ranks):
    the i-th group is sent to ``writers[i % len(writers)]`` alone (``gather.whole_on``: no device holds more than its
    shards and one shard more), the others get None for it; None: every rank gets every group."""
    model = unwrapped(model)  # (a compiled model's state_dict names its weights "_orig_mod.<name>")
    info = getattr(model, "_moe_parallel", None)
    listed = set(info.module_list_experts) if info is not None and info.module_list_experts and \
        dist.is_initialized() else set()
    layers = [(name, module) for name, module in model.named_modules() if name and _layer_of(f"{name}.w") == f"{name}."]
    with _without(model, layers):  # (the weights outside the layers; no layer's hooks run)
        rest = model.state_dict()
    groups = [(name, lambda name=name: {name: rest[name]}) for name in rest if name not in listed]
    groups += [(f"{name}.", lambda m=module, p=f"{name}.": m.state_dict(prefix=p)) for name, module in layers]
    if any(name in listed for name in rest):  # (the experts of lists outside any decoder layer: one group, last)
        groups.append((LISTS, lambda: {name: value for name, value in rest.items() if name in listed}))
    me = dist.get_rank() if dist.is_initialized() else 0
    for i, (prefix, take) in enumerate(groups):
        dst, state = writers[i % len(writers)] if writers else None, take()
        out = {name: whole_on(value, first_rank(value) if name in listed else dst) for name, value in state.items()}
        del state  # (a swapping layer's experts in expert order: dropped before the next layer's are made)
        if listed:  # an nn.ModuleList layer's experts, each in its own rank's: sent to every rank, or to dst
            group = stage_group(info.mesh)  # the world (a "dp_replicate" copy sends the same ones again), the stage
            mine = {name: v for name, v in out.items() if name in listed and v is not None}  # (split over copies:
            every = [None] * dist.get_world_size(group)  # whole on their first rank only, sent by it alone)
            if dst is None:
                dist.all_gather_object(every, mine, group=group)
            else:
                dist.gather_object(mine, every if me == dst else None, dst=dst, group=group)
            for theirs in every if dst in (None, me) else ():
                out.update(theirs)
        yield prefix, (out if dst in (None, me) else None)


@contextlib.contextmanager
def _without(model, layers: list):
    """While inside, the lists of ``model`` holding ``layers`` ((name, module) each) hold none of them."""
    lists = {id(p): p for p in (model.get_submodule(name.rsplit(".", 1)[0]) for name, _ in layers)}
    kept = {key: parent._modules for key, parent in lists.items()}
    try:
        for parent in lists.values():
            parent._modules = {k: v for k, v in parent._modules.items() if all(v is not m for _, m in layers)}
        yield
    finally:
        for key, parent in lists.items():
            parent._modules = kept[key]


LISTS = "(nn.ModuleList experts outside decoder layers)"


def _layer_of(name: str) -> str:
    """``<...>.layers.<i>.`` of a decoder layer's weight, else the name itself."""
    parts = name.split(".")
    for i in range(len(parts) - 2):
        if parts[i] in ("layers", "blocks", "h") and parts[i + 1].isdigit():
            return ".".join(parts[:i + 2]) + "."
    return name
