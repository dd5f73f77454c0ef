"""Gradient clipping of a model ``moecompile.parallelize`` sharded: the norm one process holding the whole model
would compute, the same on every rank.

``torch.nn.utils.clip_grad_norm_(model.parameters(), ...)`` on an expert-parallel rank sees the experts this rank
holds only: each rank computes another norm, scales its replicated gradients by another factor, and the replicas of
the dense weights drift apart from the first step (a tiny Mixtral on 2 ranks: norms 3.12 and 3.14 where one
process has 3.16). Here the norm is made of three parts:

    expert weights held here       (``expert_parameters``) summed over the expert-parallel group, each expert
                                   held once in it (a ``"dp_replicate"`` copy is another group's; the pieces
                                   of a ``"dp_shard"`` copy summed over the copies too)
    tensor-parallel / FSDP2 weights their gradients are DTensors: each group of the same mesh and placements
                                   reduced by DTensor, as torch's clip does for FSDP2
    every other weight             replicated, its gradient the same on every rank after backward: counted once

Under pipeline stages (a mesh's ``"pp"``) each stage computes the norm of its part of the model so, and the stages'
parts are summed (one all-reduce over one rank of each stage).

``clip_together`` does it for given lists of gradients: ``ExpertOptimizer.clip_grad_norm_`` passes its own (the
dense optimizer's, and the experts' local shards and master parts).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from .grads import check_reduced
from .copies import pieces
from .mesh import pipeline_group, shard_group
from .views import expert_parameters


@torch.no_grad()
def clip_grad_norm_(model: nn.Module | list[nn.Module], max_norm: float, norm_type: float = 2.0,
                    error_if_nonfinite: bool = False) -> torch.Tensor:
    """Scale the gradients of ``model``'s parameters so that their total norm is at most ``max_norm``, as
    ``torch.nn.utils.clip_grad_norm_`` does on one process holding the whole model; returns the total norm before
    clipping (float32, the same on every rank). Call it on every rank together, after backward and before the
    optimizer's step. ``model``: the model or its ``torch.compile`` wrapper, or a list of the stage modules this rank
    runs (an interleaved pipeline schedule's, each parallelized on the same mesh). A model ``parallelize`` did not
    shard is passed to ``torch.nn.utils.clip_grad_norm_``."""
    parts = list(model) if isinstance(model, (list, tuple)) else [model]
    infos = [getattr(part, "_moe_parallel", None) for part in parts]
    if all(info is None for info in infos):
        params = [p for part in parts for p in part.parameters()]
        return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type, error_if_nonfinite)
    if any(info is None for info in infos) or len({id(info.group) for info in infos}) > 1:
        raise ValueError("clip_grad_norm_ of several model parts takes parts moecompile.parallelize sharded on one "
                         "mesh (each stage module this rank runs): parallelize every part, even one without MoE "
                         "layers (its dense gradients are then averaged over the stage's ranks)")
    check_reduced([info.sync for info in infos], "clip_grad_norm_")
    if any(info.replicas for info in infos):
        raise ValueError("this model's experts are replicated (parallelize(..., replication=...)): their gradients "
                         "are summed over the instances by moecompile.ExpertOptimizer; clip with its "
                         "opt.clip_grad_norm_(max_norm) instead")
    experts = {id(p) for part in parts for p in expert_parameters(part)}
    with_grad = [p for part in parts for p in part.parameters() if p.grad is not None]
    held, split = expert_grads(parts, [p for p in with_grad if id(p) in experts])
    return clip_together([p.grad for p in with_grad if id(p) not in experts], held, infos[0].group, max_norm,
                         norm_type, error_if_nonfinite, stages=pipeline_group(infos[0].mesh),
                         split=(split, shard_group(infos[0].mesh)))


def expert_grads(parts: list[nn.Module], params: list) -> tuple[list, list]:
    """The gradients of the expert weights ``params`` of ``parts`` (those with one): held once over the
    expert-parallel group, and this rank's pieces of a copy split over ``"dp_shard"`` (held once over the copies
    too: ``clip_together``'s ``split``)."""
    split = {id(p) for part in parts for p in pieces(part)}
    with_grad = [p for p in params if p.grad is not None]
    return [p.grad for p in with_grad if id(p) not in split], [p.grad for p in with_grad if id(p) in split]


@torch.no_grad()
def clip_together(once: list[torch.Tensor], summed: list[torch.Tensor], group, max_norm: float,
                  norm_type: float = 2.0, error_if_nonfinite: bool = False, stages=None, split=None) -> torch.Tensor:
    """Scale ``once`` and ``summed`` so that their total norm is at most ``max_norm``; returns that norm (float32,
    the same on every rank of ``group``). ``once``: gradients the same on every rank (plain tensors, counted once)
    or DTensors (whole by DTensor, per mesh and placements); ``summed``: this rank's part of gradients held once over
    ``group`` (expert shards; ``ExpertOptimizer``'s master parts). Every rank of ``group`` calls it together.
    ``stages``: under pipeline stages, one rank of each stage (each stage's norm is its part of the model's);
    ``split``: (gradients of pieces held once over ``group`` and over the ranks splitting a copy, their group)."""
    norm_type = float(norm_type)
    if not (norm_type > 0 or norm_type == math.inf):  # (nan is neither)
        raise ValueError(f"norm_type must be a positive number or inf; got {norm_type!r}")
    plain, by_mesh = [], {}
    for g in once:
        if hasattr(g, "device_mesh"):  # a DTensor
            by_mesh.setdefault((g.device_mesh, tuple(g.placements)), []).append(g)
        else:
            plain.append(g)
    pieces, copies = split if split is not None and split[0] else ([], None)
    grads = summed + once + pieces
    device = next((g.device for g in grads if g.device.type != "cpu"), torch.device("cpu"))
    # the summed part on the device of the model (NCCL reduces no CPU tensor; host parts' norms are moved there)
    inf = norm_type == math.inf  # norms combine as their max, or as the sum of their p-th powers
    op = dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM
    power = (lambda n: n) if inf else (lambda n: n ** norm_type)  # noqa: E731
    mine = power(_norm(summed, norm_type, device))
    parts = [_norm(plain, norm_type, device)] + [_norm(same, norm_type, device) for same in by_mesh.values()]
    if pieces:  # ("dp_shard") each copy's rank holds another piece of the same experts: summed over them first
        split_part = power(_norm(pieces, norm_type, device))
        dist.all_reduce(split_part, op=op, group=copies)
        mine = torch.maximum(mine, split_part) if inf else mine + split_part
    dist.all_reduce(mine, op=op, group=group)
    total = torch.stack(parts + [mine]).max() if inf else torch.stack(parts).pow(norm_type).sum() + mine
    if stages is not None:
        dist.all_reduce(total, op=op, group=stages)
    total = total if inf else total ** (1.0 / norm_type)
    total = total.float()
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(f"the total norm of order {norm_type} of the gradients is non-finite ({total.item()}), "
                           "so it cannot be clipped; pass error_if_nonfinite=False to clip anyway")
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        local = g.to_local() if hasattr(g, "to_local") else g  # (a view of the DTensor's shard)
        local.mul_(coef.to(local.device, local.dtype))
    return total


def _norm(grads: list[torch.Tensor], norm_type: float, device: torch.device) -> torch.Tensor:
    """The norm of ``grads`` together, float64 on ``device`` (0 for none); DTensors' as their whole tensors'."""
    if not grads:
        return torch.zeros((), dtype=torch.float64, device=device)
    norm = torch.nn.utils.get_total_norm(grads, norm_type)
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    return norm.to(device, torch.float64)
