"""``expert_mlp_ref`` without a Python loop over experts: each projection one ``torch._grouped_mm`` over the
padding-free rows (grouped by expert, in order), the biases gathered per row. Used by the ``moe::expert_mlp`` op
and its backward where the tensors are not on CUDA's Triton path; the loop of ``reference.py`` stays the meaning.

    x_BH = x_TH[token_ids_B]                    rows of each expert contiguous, offs = cumsum(tokens_per_expert_E)
    up_BI = grouped_mm(x_BH, W_up^T, offs)      (+ gate_BI likewise; + bias[expert of row])
    y_BH  = grouped_mm(act(gate, up), W_down^T, offs)

``torch._grouped_mm`` takes float32, bfloat16 and float16 on CPU, rows whose byte strides are multiples of 16 (its
backward checks that), and no float64: ``usable`` says whether it applies, else the caller runs the loop.
"""

from __future__ import annotations

import torch

from .activations import apply_activation, check_activation

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def usable(x_TH: torch.Tensor, w_up_EIH: torch.Tensor, w_down_EHI: torch.Tensor) -> bool:
    """Whether ``grouped_mm`` takes these sizes and dtype (forward and backward)."""
    dtype = w_up_EIH.dtype
    per16 = 16 // dtype.itemsize if dtype in DTYPES else 0
    H, I = w_down_EHI.shape[1], w_up_EIH.shape[1]
    return bool(per16) and hasattr(torch, "_grouped_mm") and H % per16 == 0 and I % per16 == 0


def expert_mlp_grouped(x_TH, token_ids_B, tokens_per_expert_E, w_gate_EIH, w_up_EIH, w_down_EHI, b_gate_EI=None,
                       b_up_EI=None, b_down_EH=None, input_scale_B=None, *, activation="silu", alpha=1.702,
                       limit=7.0) -> torch.Tensor:
    """The same rows as ``reference.expert_mlp_ref``, through grouped GEMMs (``usable`` must hold)."""
    check_activation(activation, gated=w_gate_EIH is not None)
    dtype = w_up_EIH.dtype
    counts = tokens_per_expert_E.to(torch.int64)
    offs = counts.cumsum(0).to(torch.int32)
    n = int(offs[-1]) if offs.numel() else 0  # rows computed; dropped ones (a capacity) sit after them
    B, E = token_ids_B.shape[0], counts.shape[0]
    if n == 0:  # no rows at all (an idle rank), or all dropped
        return x_TH.new_zeros(B, w_down_EHI.shape[1], dtype=dtype)
    x_BH = x_TH[token_ids_B[:n]].to(dtype)
    if input_scale_B is not None:
        x_BH = x_BH * input_scale_B[:n].to(dtype).unsqueeze(-1)
    expert_B = torch.repeat_interleave(torch.arange(E, device=counts.device), counts, output_size=n) \
        if any(b is not None for b in (b_gate_EI, b_up_EI, b_down_EH)) else None

    def project(rows, w, b):
        if w.stride(-1) != 1 or w.stride(-2) != w.shape[-1]:  # a strided view (interleaved gate/up): rows apart
            w = w.contiguous()
        out = torch._grouped_mm(rows, w.transpose(-2, -1), offs=offs)
        return out if b is None else out + b[expert_B]

    up = project(x_BH, w_up_EIH, b_up_EI)
    gate = None if w_gate_EIH is None else project(x_BH, w_gate_EIH, b_gate_EI)
    y = project(apply_activation(activation, gate, up, alpha=alpha, limit=limit), w_down_EHI, b_down_EH)
    if n < B:
        y = torch.cat([y, y.new_zeros(B - n, y.shape[1])])
    return y
