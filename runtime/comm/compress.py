"""Shared + residual (SR) compression of the experts an expert domain all-gathers (hybridep.md §IV-B).

Experts of one layer differ in few parameters: with the *shared expert* S (the mean of the layer's experts), each
expert's residual W_e - S is sparse. A rank sends, for each of its experts, only the ``q`` fraction of residual
entries largest in magnitude, as (value, index) pairs; a receiver decodes S + the scattered residual.

    encode(W_EX, S_X, q)            -> values [E, k], indices [E, k] (int32), k = ceil(q X) of the X entries
    decode(values, indices, S_X)    -> [E, X]: S plus each expert's kept residual entries (q = 1: W exactly)
    encoded_bytes(E, X, q, elem)    what encode's output costs on the wire, against E X elem uncompressed

WIP (issue 25 item 5): not wired into ``parallelize`` yet (``compress=`` is refused there).
"""

from __future__ import annotations

import math

import torch

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
