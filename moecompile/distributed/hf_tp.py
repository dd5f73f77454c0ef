"""A transformers model loaded tensor-parallel (``from_pretrained(path, tp_plan="auto")`` under torchrun) meeting
``moecompile.parallelize``.

transformers' plan (``model._tp_plan``) shards the dense layers (attention by columns and rows, the embedding by
vocabulary rows, the LM head by columns) and, with the style ``"moe_tp_experts"``, each experts module too: its
stacked weights become DTensors cut along the intermediate size over transformers' tp mesh, and the module's
``forward`` is replaced (an instance attribute) by one that runs on the local shards and all-reduces the partial
outputs. ``parallelize`` shards the experts itself (``moe_tp``), so ``take_back_experts`` first undoes that for the
experts modules only: each DTensor weight becomes a plain parameter holding the whole weight (gathered over tp),
and the class's own ``forward`` is restored. The dense layers stay as transformers made them: their tp group must
be the mesh's ``"tp"`` group (the ranks whose MoE-block inputs are then identical), else ``ValueError``.
"""

from __future__ import annotations

import re

import torch.distributed as dist
from torch import nn

EXPERT_STYLES = ("moe_tp_experts",)  # transformers' styles of a whole experts module


def take_back_experts(model: nn.Module, tp_group) -> list[str]:
    """Undo transformers' tensor parallelism of each experts module of ``model`` (none without a plan); returns
    their names. ``tp_group``: the mesh's tp group (None on a mesh without ``"tp"``). A model FSDP2 sharded first
    is refused (``ValueError``)."""
    _check_not_fully_sharded(model)
    plan = getattr(model, "_tp_plan", None) or {}
    if not plan or not any(hasattr(p, "full_tensor") for p in model.parameters()):
        return []  # not loaded tensor-parallel
    _check_no_expert_parallel(model)
    _check_same_tp(model, tp_group)
    taken = []
    for name, module in model.named_modules():
        if _style(plan, name) not in EXPERT_STYLES:
            continue
        for attr, p in list(module._parameters.items()):
            if p is not None and hasattr(p, "full_tensor"):
                module._parameters[attr] = nn.Parameter(p.detach().full_tensor(), p.requires_grad)
        module.__dict__.pop("forward", None)  # the class's forward again, on the whole weights
        taken.append(name)
    return taken


def _style(plan: dict[str, str], name: str) -> str | None:
    """The style the plan gives module ``name`` (its keys name layers with ``*`` for the index)."""
    for pattern, style in plan.items():
        if re.fullmatch(re.escape(pattern).replace(r"\*", r"\d+"), name):
            return style
    return None


def _check_no_expert_parallel(model) -> None:
    config = getattr(getattr(model, "config", None), "distributed_config", None)
    if (getattr(config, "ep_size", None) or 1) > 1:
        raise ValueError("this model was loaded with transformers' expert parallelism (DistributedConfig(ep_size="
                         f"{config.ep_size})), and moecompile.parallelize shards the experts too: load it without "
                         "ep_size (tp_plan='auto' alone), and let parallelize place the experts")


def _check_not_fully_sharded(model) -> None:
    """``parallelize`` takes the experts out of the modules before FSDP2 shards the rest: a module ``fully_shard``
    already holds would keep the experts in its parameter groups (its first forward failed in torch's FSDP2)."""
    from torch.distributed.fsdp import FSDPModule

    sharded = [name or "the model" for name, m in model.named_modules() if isinstance(m, FSDPModule)]
    if sharded:
        more = "..." if len(sharded) > 3 else ""
        raise ValueError(f"moecompile.parallelize: FSDP2 already shards {sharded[:3]}{more} (fully_shard, or "
                         "transformers' from_pretrained with DistributedConfig(fsdp_size=... or dp_replicate_size=...)"
                         "): parallelize the model first, then fully_shard its decoder layers and the model "
                         "(fully_shard leaves out the experts parallelize took)")


def _check_same_tp(model, tp_group) -> None:
    mesh = getattr(model, "_device_mesh", None)
    names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
    if mesh is None or "tp" not in names:
        return
    theirs = sorted(int(r) for r in mesh["tp"].mesh.flatten())
    ours = sorted(dist.get_process_group_ranks(tp_group)) if tp_group is not None else [dist.get_rank()]
    if theirs != ours and len(theirs) > 1:
        raise ValueError(f"transformers made this model tensor-parallel over ranks {theirs}, but the mesh's 'tp' "
                         f"group of this rank is {ours}: their MoE-block inputs would differ. Build the mesh so "
                         "that its 'tp' dimension holds transformers' tp ranks, e.g. init_device_mesh(device, "
                         f"(world // {len(theirs)}, {len(theirs)}), mesh_dim_names=('dp', 'tp'))")
