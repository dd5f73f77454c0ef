"""The state_dict of a layer ``moecompile.parallelize`` sharded: each stacked (or flat) expert weight as a DTensor
``Shard(0)`` over the mesh, in expert order (its global ``[E, ...]`` or ``[E * R, ...]`` identity, for
``torch.distributed.checkpoint``), and back on load (a DTensor of this mesh, one of another layout gathered
whole, or a full tensor). A layer that swaps
experts holds its rows in slot order: they are exchanged to expert order for the state_dict and back on load.
"""

from __future__ import annotations

import math

import torch

SLOTS = "moe_expert_slots"  # the buffer holding a swapping layer's placement (expert -> slot)


def global_state(rows: dict[str, int], mesh, group):
    """``rows``: each sharded weight's name and global dim 0 (E, or E x R for flat weights)."""
    from torch.distributed.tensor import DTensor, Shard

    def hook(module, state_dict, prefix, local_metadata):
        for attr, total in rows.items():
            local = _placed(state_dict[prefix + attr], module._buffers.get(SLOTS), group, to_slots=False)
            shape = (total, *local.shape[1:])
            state_dict[prefix + attr] = DTensor.from_local(local, mesh, [Shard(0)] * mesh.ndim, run_check=False,
                                                           shape=shape, stride=_contiguous_stride(shape))
    return hook


def local_state(rows: dict[str, int], mesh, rank, group):
    from torch.distributed.tensor import DTensor

    def hook(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
        for attr, total in rows.items():
            key = prefix + attr
            value = state_dict.get(key)
            per_rank = total // group.size()
            if isinstance(value, DTensor):  # this mesh's shard as it is; another layout gathered whole
                value = value.to_local() if value.device_mesh == mesh else value.full_tensor()
            if isinstance(value, torch.Tensor) and value.shape[:1] == (total,):  # a full tensor: this rank's rows
                value = value[rank * per_rank:(rank + 1) * per_rank]
            if value is not None:
                state_dict[key] = _placed(value, module._buffers.get(SLOTS), group, to_slots=True)
    return hook


def _placed(rows, slots, group, to_slots: bool):
    """A shard in expert order (checkpoints) from one in slot order (after expert swaps), or back; as it is while
    no expert was swapped (every rank holds the same placement: all exchange, or none does)."""
    from moecompile.runtime.ep_swap import move_rows

    if slots is None or torch.equal(slots.cpu(), torch.arange(slots.numel())):
        return rows
    identity = torch.arange(slots.numel())
    return move_rows(rows, identity, slots, group) if to_slots else move_rows(rows, slots, identity, group)


def _contiguous_stride(shape) -> tuple[int, ...]:
    return tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
