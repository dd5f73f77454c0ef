"""Layouts shared by several rooms. How a fused gate/up expert weight holds its two halves: the one definition
shared by the canonical form (which views the parameter) and the Triton lowering (which writes the gradient of the
whole parameter at once). And the row-major strides a DTensor made from local shards is given.

    chunk            [E, 2I, ...] = [gate; up]           (Mixtral, Qwen, DeepSeek in transformers 5)
    chunk_up_first   [E, 2I, ...] = [up; gate]
    interleave       rows 0, 2, 4, ... gate; 1, 3, 5, ... up   (GPT-OSS)
"""

from __future__ import annotations

import math

GATE_UP_LAYOUTS = ("chunk", "chunk_up_first", "interleave")


def split_gate_up(t, how: str, inter: int):
    """(gate, up): views of the rows of a fused [E, 2I, ...] tensor (works on tensors and FX proxies)."""
    if how not in GATE_UP_LAYOUTS:
        raise ValueError(f"gate/up layout {how!r} is not one of {list(GATE_UP_LAYOUTS)}")
    if how == "interleave":
        return t[:, 0::2], t[:, 1::2]
    first, second = t[:, :inter], t[:, inter:]
    return (second, first) if how == "chunk_up_first" else (first, second)


def gate_up_weights(w_gate, w_up, w_down_EHI, w_gate_up, layout: str, op: str):
    """(gate, up) weights of an op that takes either both, or ``w_gate_up`` (one fused [E, 2I, H] weight in
    ``layout``) whose views it makes here; ``op`` names the op in the error for both given."""
    if w_gate_up is None:
        return w_gate, w_up
    if w_gate is not None or w_up is not None:
        raise ValueError(f"moe::{op} takes w_gate_up or w_gate/w_up, not both")
    return split_gate_up(w_gate_up, layout, w_down_EHI.shape[2])


def contiguous_stride(shape) -> tuple[int, ...]:
    """Row-major strides of ``shape`` (``DTensor.from_local`` of a shard is told its whole tensor's)."""
    return tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
