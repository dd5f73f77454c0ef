"""Expert activations, by name.

An expert MLP is ``down(act(gate(x)) * up(x))`` when gated and ``down(act(up(x)))`` when not. The names here are
the values of ``MoESpec.activation`` and of the ``activation`` argument of ``moe::expert_mlp``.

``swiglu_clamp`` is GPT-OSS's gated unit: ``gate`` clamped above at ``limit``, ``up`` clamped to ``[-limit, limit]``,
``(up + 1) * gate * sigmoid(alpha * gate)``.

``silu_clamp`` is DeepSeek-V4's: ``silu(min(gate, limit)) * clamp(up, -limit, limit)``.

``swiglu_softcap`` is Inkling2's: ``softcap(gate, alpha) * sigmoid(gate) * softcap(up, limit)``, with
``softcap(x, c) = tanh(x / c) * c`` (the sigmoid sees the raw gate; the caps bound the linear factors).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

ACTIVATIONS = ("silu", "gelu", "gelu_tanh", "relu", "relu2", "swiglu_clamp", "swiglu_softcap", "silu_clamp")
GATED_ONLY = ("swiglu_clamp", "swiglu_softcap", "silu_clamp")


def check_activation(name: str, gated: bool) -> None:
    if name not in ACTIVATIONS:
        raise ValueError(f"unknown expert activation {name!r}; valid: {', '.join(ACTIVATIONS)}")
    if name in GATED_ONLY and not gated:
        raise ValueError(f"activation {name!r} needs a gate projection (gated=True)")


def _act(name: str, h: torch.Tensor) -> torch.Tensor:
    if name == "silu":
        return F.silu(h)
    if name == "gelu":
        return F.gelu(h)
    if name == "gelu_tanh":
        return F.gelu(h, approximate="tanh")
    if name == "relu":
        return F.relu(h)
    if name == "relu2":  # squared ReLU (Nemotron-H)
        return F.relu(h).square()
    raise ValueError(f"activation {name!r} has no ungated form")


def apply_activation(
    name: str, gate: torch.Tensor | None, up: torch.Tensor, *, alpha: float = 1.702, limit: float = 7.0
) -> torch.Tensor:
    """The expert's hidden activation from its gate and up projections (``gate`` is None when ungated)."""
    if gate is None:
        return _act(name, up)
    if name == "swiglu_clamp":
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
        return (up + 1) * (gate * torch.sigmoid(gate * alpha))
    if name == "silu_clamp":
        return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)
    if name == "swiglu_softcap":  # alpha: the gate's cap, limit: up's
        return torch.tanh(gate / alpha) * alpha * torch.sigmoid(gate) * (torch.tanh(up / limit) * limit)
    return _act(name, gate) * up
