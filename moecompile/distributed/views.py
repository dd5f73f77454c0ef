"""How a sharded model's modules read the expert weights they no longer hold whole: while Dynamo traces, through
the stand-in ops of ``runtime/comm/ops.py`` (``moe.ep_global_view`` of a local shard, ``moe.ep_remote_expert`` of
another rank's ``nn.ModuleList`` expert), which carry the global shape and the layer's distribution to the
backend's passes; eagerly, they refuse to run (the model's own code would read global expert ids from a shard).
Under FSDP2's mixed precision the weights are read cast to its ``param_dtype``, as FSDP2 presents its own
(``in_param_dtype``).
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

from .copies import cut_of, whole_shape
from .grads import param_dtype_above
from .replicate import REPLICAS
from .sharded_state import DOMAIN_SLOTS, SLOTS, unwrapped


def read_remote(module, attr, like, expert, name, group_name, layer, dedup, extra=None) -> None:
    """While Dynamo traces, the module reads ``attr`` (the weight of an ``nn.ModuleList`` expert another rank holds)
    as ``moe.ep_remote_expert`` (``like``: the shape, dtype, device and name of a local weight of that role); it
    holds no value here and its forward refuses to run eagerly. ``extra``: the op's keyword arguments beyond
    those (``moe_tp``, ``tp_group``)."""
    extra = extra or {}
    shape, dtype, device, like_name = like  # constants (a tensor or module in the closure would become a graph
    # input named after the closure); the device is the one the model was on when it was parallelized
    args = (list(shape), expert, group_name, layer, dedup, like_name, name, dtype, device)

    def read(self):
        if torch.compiler.is_compiling():
            domain = {"domain_slots": self._buffers[DOMAIN_SLOTS]} if DOMAIN_SLOTS in self._buffers else {}
            return in_param_dtype(self, torch.ops.moe.ep_remote_expert(*args, self._buffers.get(SLOTS), **extra,
                                                                       **domain))
        return torch.empty(shape, dtype=dtype, device="meta")

    def refuse_eager(mod, args_):
        if not torch.compiler.is_compiling():
            torch.ops.moe.ep_remote_expert(*args)  # raises, saying why

    def drop_remote(state_dict, prefix, *_):  # a full state_dict loads: this rank keeps only its experts
        state_dict.pop(prefix + attr, None)

    cls = module.__class__
    module.__class__ = type(f"Remote{cls.__name__}", (cls,), {attr: property(read)})
    module.__dict__[ABOVE] = None
    module.register_forward_pre_hook(refuse_eager)
    module._register_load_state_dict_pre_hook(drop_remote)


def read_through_view(module: nn.Module, rows: dict[str, int], group_name: str, layer: str, dedup: str,
                      capacity_factor: float = 0.0, extra=None, full_shapes=None) -> None:
    """While Dynamo traces, the module reads each weight of ``rows`` (name -> its global dim 0: E, or E x R for
    flat weights) as ``moe.ep_global_view`` of its local shard (a subclass with one property per name); elsewhere
    as the shard itself (``get_parameter``, ``.shape``), and its forward refuses to run eagerly: the model's own
    code would read global expert ids from a shard. The parameter stays registered under its name, so
    ``named_parameters`` and optimizers see the shard. ``extra``: the op's keyword arguments beyond those
    (``moe_tp``, ``tp_group``); ``full_shapes``: name -> the whole weight's shape where the shard is cut in more
    dimensions than the first (tensor-expert parallelism cuts the intermediate one too; ``copies.py`` splits a
    stacked shard, or an ``nn.ModuleList`` expert's weight, over its copies' ranks)."""
    extra = extra or {}
    full = {attr: {"full_shape": list(shape)} for attr, shape in (full_shapes or {}).items()}
    for attr, total in rows.items():  # a piece of its copy's shard (a "dp_shard" mesh): gathered by distribute
        cut = cut_of(module, attr)
        if cut is not None:  # (an nn.ModuleList expert's piece: its whole weight's shape is given)
            shape = full_shapes[attr] if attr in (full_shapes or {}) else whole_shape(
                (total, *module._parameters[attr].shape[1:]), cut)
            full[attr] = {"full_shape": list(shape), "copy_group": cut.group, "reshard": cut.reshard,
                          "copy_dim": cut.dim}
    owned = {attr: module._parameters[attr] for attr in rows}  # the shards made here, for taken_over()

    def view(attr):
        def read(self):
            local = self._parameters[attr]
            if local is not owned[attr]:
                taken_over(layer, attr)
            if torch.compiler.is_compiling():
                domain = {"domain_slots": self._buffers[DOMAIN_SLOTS]} if DOMAIN_SLOTS in self._buffers else {}
                return in_param_dtype(self, torch.ops.moe.ep_global_view(
                    local, rows[attr], group_name, layer, dedup, self._buffers.get(SLOTS),
                    self._buffers.get(REPLICAS), capacity_factor, **extra, **full.get(attr, {}), **domain))
            return local
        return property(read)

    def refuse_eager(mod, args):
        if not torch.compiler.is_compiling():
            first = next(iter(rows))
            torch.ops.moe.ep_global_view(mod._parameters[first], rows[first], group_name, layer)  # raises, saying why

    cls = module.__class__
    module.__class__ = type(f"Sharded{cls.__name__}", (cls,), {n: view(n) for n in rows})
    module.__dict__[ABOVE] = None
    module.register_forward_pre_hook(refuse_eager)


def taken_over(layer: str, attr: str) -> None:
    """A sharded expert weight was replaced after parallelize: FSDP2's ``fully_shard`` of a module holding it
    (it would all-gather different experts' shards as one weight), or an assignment. Raises, naming the fix."""
    raise ValueError(
        f"the expert weight {attr!r} of MoE layer {layer!r} is no longer the shard moecompile.parallelize made: "
        "FSDP2's fully_shard of a module holding it took it over (it would gather other ranks' different experts "
        "as one weight), or it was assigned anew. Leave the sharded experts to moecompile: fully_shard(module, "
        "mesh=mesh['dp'], ignored_params=moecompile.expert_parameters(model)); load weights in place "
        "(load_state_dict without assign=True)")


def guard_owned(module: nn.Module, attr: str, layer: str) -> None:
    """``attr`` (a local expert's weight, read by the model's code as it is) raises ``taken_over`` once it is no
    longer the parameter it is now."""
    owned = module._parameters[attr]

    def read(self):
        local = self._parameters[attr]
        if local is not owned:
            taken_over(layer, attr)
        return in_param_dtype(self, local) if torch.compiler.is_compiling() else local

    cls = module.__class__
    module.__class__ = type(f"Held{cls.__name__}", (cls,), {attr: property(read)})
    module.__dict__[ABOVE] = None


ABOVE = "_moe_modules_above"  # (in a module reading expert weights: the key of the modules above it, note_above)
_ABOVE: dict[str, tuple] = {}  # key -> weak references to a module's ancestors in its model, the root first


def note_above(model: nn.Module) -> None:
    """Note, for each module of ``model`` that reads expert weights through the properties above, the modules above
    it (weakly): ``param_dtype`` finds FSDP2's ``fully_shard`` modules among them when the model compiles."""
    for name, module in model.named_modules():
        if ABOVE in module.__dict__:
            parts = name.split(".") if name else []
            key = f"{id(module)}"
            _ABOVE[key] = tuple(weakref.ref(model.get_submodule(".".join(parts[:i]))) for i in range(len(parts)))
            module.__dict__[ABOVE] = key


@torch._dynamo.assume_constant_result
def param_dtype(key: str):
    """The ``param_dtype`` of FSDP2's ``MixedPrecisionPolicy`` above the module ``key`` names (``note_above``), or
    None. Read while Dynamo traces, as a constant: a policy set after the first compile is not seen."""
    return param_dtype_above([ref() for ref in _ABOVE.get(key, ())])


def in_param_dtype(module: nn.Module, weight: torch.Tensor) -> torch.Tensor:
    """An expert weight as the model's code reads it while Dynamo traces: cast to FSDP2's ``param_dtype`` above its
    module where that is less precise (bf16 over a float32 shard), as FSDP2 presents the weights it holds; FSDP2
    leaves the expert shards out (``leave_out_of_fsdp``), and its policy reaches them so. Else as it is."""
    key = module.__dict__.get(ABOVE)
    dtype = param_dtype(key) if key is not None else None
    if dtype is None or not weight.is_floating_point() or dtype.itemsize >= weight.dtype.itemsize:
        return weight
    return weight.to(dtype)


def expert_parameters(model: nn.Module) -> set[nn.Parameter]:
    """The expert weights ``moecompile.parallelize`` sharded, held on this rank: pass them to FSDP2's
    ``fully_shard`` as ``ignored_params`` (each rank holds other experts: their gradients are moecompile's)."""
    info = getattr(model, "_moe_parallel", None)
    if info is None:
        raise ValueError("expert_parameters(model) lists what moecompile.parallelize sharded: call it after "
                         "moecompile.parallelize(model, mesh, ...)")
    model = unwrapped(model)
    return {p for n, p in model.named_parameters()
            if getattr(p, "_moe_sharded", False) or n in info.module_list_experts}


def leave_out_of_fsdp(model: nn.Module) -> list[str]:
    """Mark each module holding an expert weight this rank was given, as torch marks a module under its composable
    ``replicate``: FSDP2's ``fully_shard`` of a module above leaves such modules (and their parameters) out, as if
    they were passed as ``ignored_params``, so ``fully_shard(layer, mesh=mesh["dp"])`` needs no argument. The
    marked modules' other parameters, if any, are averaged over the data-parallel group by moecompile
    (``grads.py``) as any parameter FSDP2 does not hold. Returns the modules marked; none where this torch has no
    such mark (a ``fully_shard`` then needs ``ignored_params=moecompile.expert_parameters(model)``, and one without
    it raises ``taken_over`` at its first run). The modules reading expert weights note the modules above them
    (``note_above``): FSDP2's mixed precision policy there reaches the experts it leaves out."""
    note_above(model)
    try:
        from torch.distributed._composable.contract import REGISTRY_KEY, RegistryItem
        from torch.distributed.fsdp._fully_shard._fsdp_common import _is_composable_with_fsdp
    except ImportError:
        return []
    held = expert_parameters(model)
    owners = {name.rpartition(".")[0] for name, p in model.named_parameters() if p in held}
    marked = []
    for name in sorted(owners):
        module = model.get_submodule(name)
        if module is model:  # the model itself: FSDP2 of it would hold nothing
            continue
        module.__dict__.setdefault(REGISTRY_KEY, {}).setdefault("replicate", RegistryItem())
        if _is_composable_with_fsdp(module):  # this torch reads another mark: leave the module as it was
            module.__dict__[REGISTRY_KEY].pop("replicate")
            return marked
        marked.append(name)
    return marked


class NotUnderDDP:
    """``_ddp_params_and_buffers_to_ignore`` of a parallelized model and of each module above its experts, which
    ``DistributedDataParallel``'s constructor reads (as a list of names) before it broadcasts rank 0's weights:
    reading it raises instead. Under DDP each rank's experts would be overwritten by rank 0's, and the replicated
    gradients averaged twice (``grads.py`` already averages them as DDP does)."""

    def __iter__(self):
        raise ValueError("this model was given to moecompile.parallelize, whose ranks hold different experts and "
                         "which already averages the other gradients over the ranks as DistributedDataParallel "
                         "does: DDP would overwrite every rank's experts with rank 0's. Train the model itself, "
                         "torch.compile(model, backend='moe'), without DistributedDataParallel (with transformers' "
                         "Trainer: moecompile.ExpertParallelTrainer)")


def refuse_ddp(model: nn.Module) -> None:
    """Make ``DistributedDataParallel`` of ``model``, or of any module holding or above its experts, raise
    (``NotUnderDDP``)."""
    held = expert_parameters(model)
    above = {""}
    for name, p in model.named_parameters():
        if p in held:
            parts = name.split(".")[:-1]
            above.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    for name in above:
        model.get_submodule(name)._ddp_params_and_buffers_to_ignore = NotUnderDDP()
