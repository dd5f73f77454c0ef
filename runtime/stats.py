"""Run-time counters of the canonical MoE ops.

The ops run opaque inside compiled graphs, so what they count at run time (tokens dropped by an expert capacity)
is kept here, keyed by the layer name the canonicalize pass gave the op. Read it with ``token_drops()``.
``recording_routing()`` keeps, while it is open, each layer's last routing (``moecompile.parallelize`` reads it to
choose a dedup level per layer from the example input).
"""

from __future__ import annotations

import contextlib
import threading

import torch

ROUTING: dict[str, torch.Tensor] | None = None  # layer -> [T, K] expert ids of its last call, while recording


@contextlib.contextmanager
def recording_routing():
    global ROUTING
    before, ROUTING = ROUTING, {}
    try:
        yield ROUTING
    finally:
        ROUTING = before


class DropCounter:
    """Tokens dropped by expert capacity, per MoE layer, since the last reset."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._dropped: dict[str, int | torch.Tensor] = {}  # summed where the op ran: read only by snapshot()
        self._routed: dict[str, int] = {}

    def add(self, layer: str, routed: int, dropped: int | torch.Tensor) -> None:
        """``dropped`` may be a tensor on the op's device: added there, so a forward never waits for the GPU."""
        with self._lock:
            self._routed[layer] = self._routed.get(layer, 0) + routed
            self._dropped[layer] = self._dropped.get(layer, 0) + dropped

    def snapshot(self) -> dict[str, dict[str, int]]:
        with self._lock:
            return {k: {"routed": self._routed[k], "dropped": int(self._dropped[k])} for k in self._routed}

    def reset(self) -> None:
        with self._lock:
            self._dropped.clear()
            self._routed.clear()


DROPS = DropCounter()


def token_drops() -> dict[str, dict[str, int]]:
    """``{layer: {"routed": n, "dropped": m}}`` for every capacity-limited layer that has run."""
    return DROPS.snapshot()
