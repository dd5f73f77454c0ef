"""The canonical padding-free form of one MoE block, written once and used twice.

``canonical_moe`` runs eagerly on real tensors (``verify`` proves it equal to the original region) and on
``torch.fx.Proxy`` values (``canonicalize`` traces it into the graph), so what was proved is what is spliced in:

    x_TH      = x.reshape(-1, H)
    w_TK, ids = moe.route(logits.reshape(-1, E), correction_bias.reshape(E), ...)   (a kept router: its own
                                                                                       [T, K] weights and ids)
    tok, exp, counts, cw, src = moe.build_pft(ids, w_TK, E, capacity, drop_order, layer, group)
    y_BH      = moe.expert_mlp(x_TH, tok, counts, w_gate, w_up, w_down, biases..., activation)
    out_TH    = moe.combine(y_BH, tok, cw, T)
    out_TH   += x_TH * (w_TK * (ids >= E_w)).sum(-1)             (identity experts: ids E_w..E-1 compute nothing;
                                                                   their rows are the MLP's zero tail)

Weight roles in ``weights``: ``gate``, ``up``, ``down`` (or ``gate_up`` when fused) and the same with ``_bias``.
A role's value is a stacked ``[E, ...]`` tensor, a flat ``[E * R, C]`` one (every expert's rows one after the
other: dbrx; viewed as ``[E, R, C]`` here), an ``[E, C]`` one read a row per expert (single-neuron experts: Doge;
viewed as ``[E, 1, C]``), or a list of E per-expert tensors (ModuleList experts, stacked here).
Layouts are normalised with views: transposes and gate/up splits copy nothing.
"""

from __future__ import annotations

import torch

from moecompile.runtime import ops  # noqa: F401  (registers torch.ops.moe)
from moecompile.runtime.layouts import split_gate_up

from .spec import MoESpec


def _stacked(v, e):
    if isinstance(v, (list, tuple)):
        return torch.stack(v)
    if e.storage == "flat":
        return v.view(e.num_experts, -1, v.shape[-1])
    if e.storage == "rows":
        return v.unsqueeze(1)
    return v[: e.num_experts] if e.identity_experts else v  # rows some keep for identity experts: never read


def expert_tensors(spec: MoESpec, weights: dict):
    """(w_gate_EIH, w_up_EIH, w_down_EHI, b_gate_EI, b_up_EI, b_down_EH) in canonical layout."""
    e = spec.experts
    w = {k: _stacked(v, e) for k, v in weights.items()}
    if spec.compute_dtype:  # the fused weight cast whole: gate and up stay views of one tensor (the lower pass)
        w = {k: v.to(getattr(torch, spec.compute_dtype)) for k, v in w.items()}
    if e.gate_up != "separate":
        gu = w["gate_up"].transpose(1, 2) if e.up_transposed else w["gate_up"]
        gate, up = split_gate_up(gu, e.gate_up, e.intermediate)
        b_gate, b_up = (None, None)
        if "gate_up_bias" in w:
            b_gate, b_up = split_gate_up(w["gate_up_bias"], e.gate_up, e.intermediate)
    else:
        up = w["up"].transpose(1, 2) if e.up_transposed else w["up"]
        gate = w.get("gate")
        if gate is not None and e.up_transposed:
            gate = gate.transpose(1, 2)
        b_gate, b_up = w.get("gate_bias"), w.get("up_bias")
    down = w["down"].transpose(1, 2) if e.down_transposed else w["down"]
    return gate, up, down, b_gate, b_up, w.get("down_bias")


def routed_like_input(routed, x) -> bool:
    """Whether the routed output has the token input's shape (else it is [T, H]): the ``out_3d`` argument."""
    return routed.dim() == x.dim() and routed.dim() != 2


def canonical_moe(
    spec: MoESpec, x, logits, correction_bias, weights: dict, *, layer: str, out_dtype: torch.dtype, out_3d: bool,
    topk=None,
):
    """The routed-experts output of the block, [T, H] (or x's shape when ``out_3d``), in ``out_dtype``. ``topk``:
    a kept router's (weights, ids), each [T, K], used in place of ``moe.route`` (``spec.routing.kept``)."""
    r, e = spec.routing, spec.experts
    x_TH = x.reshape(-1, e.hidden)
    E = e.num_experts + e.identity_experts  # what the router scores
    if r.kept:
        weights_TK, ids_TK = topk[0].reshape(-1, r.top_k), topk[1].reshape(-1, r.top_k)
    else:
        if correction_bias is not None:  # one bias per expert, [E]: ERNIE keeps it as [1, E]
            correction_bias = correction_bias.reshape(E)
        routed = torch.ops.moe.route(logits.reshape(-1, E), correction_bias, *r.route_args())
        weights_TK, ids_TK = routed[0], routed[1]
    group = logits.shape[-2] if r.capacity_per_sequence else 0  # tokens per sequence: logits [B, S, E] (detect)
    pft = torch.ops.moe.build_pft(ids_TK, weights_TK, E, r.capacity, r.drop_order, layer, group)
    token_ids_B, tokens_per_expert_E, combine_weights_B = pft[0], pft[2], pft[3]
    if e.identity_experts:  # their rows sort after every computed one: the MLP leaves them 0, combine adds nothing
        tokens_per_expert_E = tokens_per_expert_E[: e.num_experts]
    gate, up, down, b_gate, b_up, b_down = expert_tensors(spec, weights)
    input_scale_B = combine_weights_B if r.weights_on_input else None
    x_in = x_TH
    if spec.compute_dtype:  # as autocast casts a linear's input (the combine weights keep theirs)
        x_in = x_TH.to(getattr(torch, spec.compute_dtype))
        input_scale_B = None if input_scale_B is None else input_scale_B.to(x_in.dtype)
    y_BH = torch.ops.moe.expert_mlp(
        x_in, token_ids_B, tokens_per_expert_E, gate if e.gated else None, up, down,
        b_gate if e.gated else None, b_up, b_down, input_scale_B, e.activation, e.alpha, e.limit,
    )
    out_TH = torch.ops.moe.combine(y_BH, token_ids_B, None if r.weights_on_input else combine_weights_B, x_TH.size(0))
    if e.identity_experts:  # each token once more, scaled by the weights it gave identity experts
        identity_T1 = (weights_TK * (ids_TK >= e.num_experts)).sum(-1, keepdim=True)
        out_TH = out_TH + x_TH * identity_T1
    out = out_TH.to(out_dtype)
    return out.reshape(x.shape) if out_3d else out
