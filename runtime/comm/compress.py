"""Shared + residual (SR) compression of the experts an expert domain all-gathers (hybridep.md §IV-B).

Experts of one layer differ in few parameters: with the *shared expert* S (the mean of the layer's experts), each
expert's residual W_e - S is sparse. A rank sends, for each of its experts, only the ``q`` fraction of residual
entries largest in magnitude, as (value, index) pairs; a receiver decodes S + the scattered residual.

    encode(W_EX, S_X, q)            -> values [E, k], indices [E, k] (int32), k = ceil(q X) of the X entries
    decode(values, indices, S_X)    -> [E, X]: S plus each expert's kept residual entries (q = 1: W exactly)
    encoded_bytes(E, X, q, elem)    what encode's output costs on the wire, against E X elem uncompressed

    moe::expert_mean(w, E, group)                  the shared expert: the mean of the layer's E experts, all-
                                                   reduced over every rank each step
    moe::domain_gather_compressed(w, S, q, group)  moe.domain_gather sending residual pairs; own experts exact;
                                                   backward: each copy's gradient summed to its owner (as if exact)
    moe::domain_gather_compressed_start(w, E, q, group, mean_group) -> key    the shared expert and the encode
    moe::domain_gather_compressed_wait(key, w, q, group) -> pairs, shared     done and the pairs' all-gathers
                                                   started where the distribute pass puts them (ahead of the
                                                   experts, as the exact gather's start/wait)
    moe::sr_decode(values, indices, shared, w, group)  the domain's copies of one weight from the pairs, whole
                                                   (the biases; the weights decode with use, one owner's experts
                                                   at a time: moe::expert_mlp_sr, sr_experts.py); marked to be
                                                   computed again in backward: only the pairs are kept

``parallelize(..., expert_domains=..., compress=q)`` (stacked or ``nn.ModuleList`` experts): it changes the forward
(the gathered copies are approximate), so it is never on by default and the report says so.
"""

from __future__ import annotations

import math
import time

import torch
import torch.distributed as dist
from torch.library import register_autograd, register_fake

from ..library import moe_op
from .domains import domain_reduce  # noqa: F401  (registers moe::domain_reduce, the backward)
from .domains import in_flight, new_key
from .exchange import resolve_group, wait_as_link
from .stats import COMM

Tensor = torch.Tensor


def kept(numel: int, q: float) -> int:
    """Entries kept of ``numel`` at fraction ``q`` (at least one)."""
    if not 0 < q <= 1:
        raise ValueError(f"compress={q!r}: the fraction of residual entries kept must be in (0, 1], e.g. 0.02")
    return max(1, math.ceil(q * numel))


def encode(w_EX: Tensor, shared_X: Tensor, q: float) -> tuple[Tensor, Tensor]:
    """Each expert's (row of ``w_EX``, flattened) residual against ``shared_X``, its ``q`` fraction of entries
    largest in magnitude as values and int32 indices."""
    residual = w_EX.reshape(w_EX.shape[0], -1) - shared_X.reshape(1, -1)
    k = kept(residual.shape[1], q)
    idx = residual.abs().topk(k, dim=1, sorted=False).indices
    return residual.gather(1, idx), idx.to(torch.int32)


def decode(values_Ek: Tensor, indices_Ek: Tensor, shared_X: Tensor) -> Tensor:
    """[E, X]: ``shared_X`` plus each expert's residual entries put back at their indices."""
    out = shared_X.reshape(1, -1).repeat(values_Ek.shape[0], 1)
    return out.scatter_add_(1, indices_Ek.long(), values_Ek.to(out.dtype))


def encoded_bytes(E: int, numel: int, q: float, elem: int) -> int:
    """Bytes of ``encode``'s output for E experts of ``numel`` entries: k values and k int32 indices each."""
    return E * kept(numel, q) * (elem + 4)


# ---- the compressed all-gather of a domain's experts ------------------------------------------------------------


def _mean(w: Tensor, num_experts: int, group_name: str, layer: str) -> Tensor:
    group = resolve_group(group_name)
    total = w.detach().sum(0)
    started = time.perf_counter()
    dist.all_reduce(total, group=group)
    W = dist.get_world_size(group)
    ring = 2 * (W - 1) * total.numel() * total.element_size() // W  # what a ring all-reduce sends per rank
    wait_as_link(group, ring, since=started)
    if layer:
        COMM.add_rows(layer, "expert_mean", group, [1] * W, 2 * total.numel() * total.element_size() // W)
    return total / num_experts


@moe_op("moe::expert_mean", mutates_args=())
def expert_mean(w: Tensor, num_experts: int, group_name: str, layer: str = "") -> Tensor:
    """The shared expert: the mean of the layer's ``num_experts`` experts, every rank's ``w`` [E_l, ...] summed over
    ``group`` (all the layer's ranks). Not differentiated: the residuals carry the gradient. Counted as a ring
    all-reduce sends: 2 (W - 1) / W of one expert's bytes per rank."""
    return _mean(w, num_experts, group_name, layer)


@register_fake("moe::expert_mean")
def _expert_mean_fake(w, num_experts, group_name, layer=""):
    return w.new_empty(w.shape[1:])


def _launch(w: Tensor, shared: Tensor, q: float, group) -> tuple:
    S = dist.get_world_size(group)
    values, indices = encode(w, shared, q)
    all_values = [torch.empty_like(values) for _ in range(S)]
    all_indices = [torch.empty_like(indices) for _ in range(S)]
    works = (dist.all_gather(all_values, values, group=group, async_op=True),
             dist.all_gather(all_indices, indices, group=group, async_op=True))
    return works, all_values, all_indices, shared, time.perf_counter()


def _receive(works, all_values, all_indices, shared, started, w: Tensor, group, layer: str) -> tuple:
    """The pairs of every rank of the domain, in rank order, once their all-gathers are done (and the link emulated
    and the bytes counted), and the shared expert."""
    for work in works:
        work.wait()
    S = dist.get_world_size(group)
    pair = all_indices[0].shape[1] * (all_values[0].element_size() + 4)  # one expert's (value, index) pairs
    wait_as_link(group, (S - 1) * w.shape[0] * pair, since=started)
    if layer:
        COMM.add_rows(layer, "domain_gather", group, [w.shape[0]] * S, pair)
    return torch.cat(all_values), torch.cat(all_indices), shared


def _decode_domain(values: Tensor, indices: Tensor, shared: Tensor, w: Tensor, rank: int) -> Tensor:
    """The domain's experts [S E_l, ...]: every other rank's decoded, this rank's own (``w``) exactly."""
    E_l = w.shape[0]
    out = decode(values, indices, shared).to(w.dtype).view(values.shape[0], *w.shape[1:])
    out[rank * E_l:(rank + 1) * E_l] = w
    return out


@moe_op("moe::domain_gather_compressed", mutates_args=())
def domain_gather_compressed(w: Tensor, shared: Tensor, q: float, group_name: str, layer: str = "") -> Tensor:
    """``moe.domain_gather`` with SR compression: each rank sends its experts' residual top-``q`` entries; the
    other ranks' experts come back as shared + residual, this rank's own exactly."""
    group = resolve_group(group_name)
    return _decode_domain(*_receive(*_launch(w, shared, q, group), w, group, layer), w, dist.get_rank(group))


@register_fake("moe::domain_gather_compressed")
def _domain_gather_compressed_fake(w, shared, q, group_name, layer=""):
    return w.new_empty((w.shape[0] * dist.get_world_size(resolve_group(group_name)), *w.shape[1:]))


def _compressed_setup(ctx, inputs, output):
    ctx.group_name, ctx.layer = inputs[3], inputs[4]


def _compressed_bwd(ctx, grad):  # straight through: each copy's gradient summed back to its owner
    return torch.ops.moe.domain_reduce(grad, ctx.group_name, ctx.layer), None, None, None, None


register_autograd("moe::domain_gather_compressed", _compressed_bwd, setup_context=_compressed_setup)


@moe_op("moe::domain_gather_compressed_start", mutates_args=())
def domain_gather_compressed_start(w: Tensor, num_experts: int, q: float, group_name: str, mean_group: str,
                                   layer: str = "") -> Tensor:
    """The shared expert (``expert_mean`` over ``mean_group``), this rank's residual pairs, and their all-gather
    over ``group_name`` started (asynchronously); returns the key ``domain_gather_compressed_wait`` takes."""
    shared = _mean(w, num_experts, mean_group, layer)
    key = new_key()
    in_flight[key] = _launch(w.detach(), shared, q, resolve_group(group_name))
    return torch.tensor([key], dtype=torch.int64)


@register_fake("moe::domain_gather_compressed_start")
def _compressed_start_fake(w, num_experts, q, group_name, mean_group, layer=""):
    return torch.empty(1, dtype=torch.int64)


@moe_op("moe::domain_gather_compressed_wait", mutates_args=())
def domain_gather_compressed_wait(key: Tensor, w: Tensor, q: float, group_name: str,
                                  layer: str = "") -> tuple[Tensor, Tensor, Tensor]:
    """What ``domain_gather_compressed_start`` started (its ``key``), waited for: every rank's residual pairs in
    rank order (values [S E_l, k], int32 indices [S E_l, k]) and the shared expert, for ``sr_decode``."""
    return _receive(*in_flight.pop(int(key[0])), w, resolve_group(group_name), layer)


@register_fake("moe::domain_gather_compressed_wait")
def _compressed_wait_fake(key, w, q, group_name, layer=""):
    rows, k = w.shape[0] * dist.get_world_size(resolve_group(group_name)), kept(w[0].numel(), q)
    return w.new_empty(rows, k), w.new_empty(rows, k, dtype=torch.int32), w.new_empty(w.shape[1:])


register_autograd("moe::domain_gather_compressed_wait", lambda ctx, *grads: (None,) * 5,
                  setup_context=lambda ctx, inputs, output: None)  # pairs and the shared expert: no gradient


@moe_op("moe::sr_decode", mutates_args=())
def sr_decode(values: Tensor, indices: Tensor, shared: Tensor, w: Tensor, group_name: str,
              layer: str = "") -> Tensor:
    """The domain's experts decoded from ``domain_gather_compressed_wait``'s pairs: shared + residual for the other
    ranks' experts, this rank's ``w`` exactly. Pure (no communication): the distribute pass marks it to be computed
    again in backward, so that the decoded copies are not kept from forward to backward; only the pairs are.
    Backward: each copy's gradient summed back to its owner (``moe.domain_reduce``), as for exact copies."""
    return _decode_domain(values, indices, shared, w, dist.get_rank(resolve_group(group_name)))


@register_fake("moe::sr_decode")
def _sr_decode_fake(values, indices, shared, w, group_name, layer=""):
    return w.new_empty((values.shape[0], *w.shape[1:]))


def _sr_decode_setup(ctx, inputs, output):
    ctx.group_name, ctx.layer = inputs[4], inputs[5]


def _sr_decode_bwd(ctx, grad):
    return None, None, None, torch.ops.moe.domain_reduce(grad, ctx.group_name, ctx.layer), None, None


register_autograd("moe::sr_decode", _sr_decode_bwd, setup_context=_sr_decode_setup)
