"""Normwise comparison of tensors as large as a full-size expert weight, without a float64 copy of either.

``rel_error(a, b) = max |a - b| / max |b|`` over the finite elements, computed in float64 one slice of rows at a
time (at most ``CHUNK`` elements each): comparing the gradient of DeepSeek-V3's [256, 4096, 7168] gate_up
weights costs a 32 MiB float64 slice, not 60 GB.
"""

from __future__ import annotations

import torch

CHUNK = 1 << 22  # elements per float64 slice


def rel_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """Worst absolute difference relative to the largest magnitude of ``b`` (the reference); ``inf`` when the
    shapes differ or when the two disagree on which elements are finite."""
    a, b = a.detach(), b.detach()
    if a.shape != b.shape:
        return float("inf")
    if b.numel() == 0:
        return 0.0
    if a.dim() == 0:
        a, b = a.reshape(1), b.reshape(1)
    rows = max(1, CHUNK // max(1, b[0].numel()))
    diff, scale = 0.0, 0.0
    for i in range(0, b.shape[0], rows):
        x, y = a[i : i + rows].double(), b[i : i + rows].double()
        fx, fy = torch.isfinite(x), torch.isfinite(y)
        if not torch.equal(fx, fy):
            return float("inf")
        if not fy.all():
            x, y = x[fy], y[fy]
        if y.numel():
            diff = max(diff, (x - y).abs().max().item())
            scale = max(scale, y.abs().max().item())
    return diff / max(scale, 1e-30)


def grad_error(a: torch.Tensor | None, b: torch.Tensor | None) -> float:
    """``rel_error`` of two gradients, either of which may be None (an input one side does not use): then they
    agree only if the other is None or all zero (nothing allocated to stand for the missing one)."""
    if a is None or b is None:
        other = b if a is None else a
        return 0.0 if other is None or not other.any() else float("inf")
    return rel_error(a, b)
