"""A sharded weight whole on one rank's host: each of its shards sent there once, the receiver copying each into
place as it arrives. ``DTensor.full_tensor()`` all-gathers the weight whole onto every device of its mesh (a
DeepSeek-V3 layer's stacked ``gate_up_proj``: 15 GB in bf16 on each GPU); a checkpoint writer needs it on one host,
and the devices need hold no more than their shards (the receiver one shard more, as it arrives)."""

import contextlib
import itertools
import logging

import torch
import torch.distributed as dist


def first_rank(value) -> int | None:
    """The first global rank of a DTensor's mesh (an ``nn.ModuleList`` expert split over its copies: whole there
    alone), None for a plain tensor (this rank's own)."""
    return int(value.device_mesh.mesh.min()) if hasattr(value, "device_mesh") else None


def whole_on(value, dst: int | None):
    """``value`` (a state_dict entry: a DTensor or a plain tensor) whole, as a CPU tensor, on global rank ``dst``,
    None on the other ranks (every rank of the DTensor's mesh calls it together); ``dst=None``: on every rank (an
    all-gather: ``full_tensor()``). A plain tensor is this rank's own, not sent. A DTensor on a mesh without
    ``dst`` (another copy's mesh, whose ranks hold the same weight) gives None on its ranks. Placements other than
    ``Shard`` and ``Replicate`` (``_StridedShard``: FSDP2 over a tensor-parallel one), and host shards where the
    default process group is NCCL alone, are all-gathered, then kept on ``dst`` only. Shards are sent over the
    default group: on the device with NCCL, through the host with gloo."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    me = dist.get_rank() if dist.is_initialized() else 0
    if not isinstance(value, DTensor):
        return value.detach().cpu() if dst in (None, me) else None
    local = value.to_local().detach()
    backend, on_host = str(dist.get_backend()), local.device.type == "cpu"
    if dst is None or any(type(p) not in (Shard, Replicate) for p in value.placements) or (
            on_host and "gloo" not in backend):  # (host shards where the world's group moves no CPU tensor)
        with _one_by_one_said():
            whole = value.full_tensor().detach()
        return whole.cpu() if dst in (None, me) else None
    mesh, placements = value.device_mesh, value.placements
    ranks = mesh.mesh
    if dst not in ranks.flatten().tolist():
        return None
    at = [int(c) for c in (ranks == dst).nonzero()[0]]  # dst's coordinate: the copies it holds are the ones used
    spans = [range(at[d], at[d] + 1) if isinstance(p, Replicate) else range(n)
             for d, (p, n) in enumerate(zip(placements, mesh.shape))]
    device = local.device if not on_host and "nccl" in backend else "cpu"  # (gloo: through the host)
    if me != dst:  # a sender: the rank along each dimension the weight is replicated over where dst is
        if all(c in span for c, span in zip(mesh.get_coordinate(), spans)) and local.numel():
            dist.send(local.to(device).contiguous(), dst)
        return None
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    whole = torch.empty(value.shape, dtype=value.dtype, device="cpu")
    for coordinate in itertools.product(*spans):
        shape, offset = _compute_local_shape_and_global_offset(value.shape, mesh.shape, list(coordinate), placements)
        if 0 in shape:  # (an uneven cut leaves this rank nothing)
            continue
        src = int(ranks[coordinate])
        if src == me:
            piece = local
        else:
            piece = torch.empty(shape, dtype=value.dtype, device=device)
            dist.recv(piece, src)
        whole[tuple(slice(o, o + n) for o, n in zip(offset, shape))].copy_(piece)
    return whole


@contextlib.contextmanager
def _one_by_one_said():
    """While inside, torch's note that a weight sharded over several mesh dimensions is gathered by one all-gather a
    dimension (suboptimal for a mesh it did not flatten) is not printed: these gathers are a checkpoint's, once."""
    class _Drop(logging.Filter):
        def filter(self, record):
            return not str(record.msg).startswith("While redistributing from")

    logger, drop = logging.getLogger("torch.distributed.tensor._redistribute"), _Drop()
    logger.addFilter(drop)
    try:
        yield
    finally:
        logger.removeFilter(drop)
