"""MoESpec: what detection found in one MoE block, the contract between detection and rewrite.

A spec says what the block computes (routing function, expert MLP, shared experts) in the canonical vocabulary
of ``moecompile.runtime.ops``; a ``Binding`` says which graph values feed it. ``canonical.py`` turns the pair into
the padding-free form, which ``verify`` runs against the original region and ``canonicalize`` splices in.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch.fx as fx



@dataclass(frozen=True, kw_only=True)
class RoutingSpec:
    """The router after the logits: ``moe::route`` arguments plus how the weights are applied and dropped."""

    top_k: int
    score_fn: str = "softmax"  # softmax | sigmoid | sqrtsoftplus | topk_softmax | topk_sigmoid | sparsemixer
    renormalize: bool = False
    renorm_eps: float = 0.0
    scaling: float = 1.0
    n_group: int = 1  # group-limited top-k: experts in n_group groups, keep the best topk_group groups
    topk_group: int = 1
    group_score: str = "top2_sum"  # max | top2_sum (how a group is scored)
    jitter_eps: float = 0.0  # sparsemixer's relative threshold
    correction_bias: bool = False  # a per-expert bias added for choosing only (DeepSeek-V3)
    router_bias: bool = False
    weights_on_input: bool = False  # Llama4 scales the expert input, not its output
    capacity: int = -1  # max tokens per expert (-1: no capacity, nothing dropped)
    drop_order: str = "slot_major"  # which assignments an over-full expert keeps: slot_major | token_major | priority
    capacity_per_sequence: bool = False  # the capacity holds in each sequence (the [B, S, E] logits' S tokens;
    # Switch Transformers counts positions by a cumsum over S), not over all B * S tokens
    kept: str = ""  # why the model's own router stays (its top-k weights and ids feed build_pft); "": moe.route

    def route_args(self) -> tuple:
        return (
            self.top_k, self.score_fn, self.renormalize, self.renorm_eps, self.scaling,
            self.n_group, self.topk_group, self.group_score, self.jitter_eps,
        )


@dataclass(frozen=True, kw_only=True)
class ExpertSpec:
    """The routed experts' MLP and how their weights are stored."""

    num_experts: int  # experts with weights (ids 0..E-1)
    identity_experts: int = 0  # zero-computation experts routed after them (LongCat-Flash): ids E..E+Z-1 return
    # the token itself, scaled by its weight; the router scores E + Z experts
    hidden: int
    intermediate: int
    activation: str = "silu"
    gated: bool = True
    alpha: float = 1.702  # swiglu_clamp: sigmoid scale | swiglu_softcap: the gate's cap
    limit: float = 7.0  # swiglu_clamp: the clamp | swiglu_softcap: up's cap
    storage: str = "stacked"  # stacked: [E, ...] parameters | flat: [E * R, C] read as [E, R, C] | modulelist: one
    # nn.Linear per expert | rows: [E, C] read a row per expert, as [E, 1, C] (single-neuron experts)
    gate_up: str = "separate"  # separate | a fused gate/up weight's layout (runtime/layouts.py GATE_UP_LAYOUTS)
    up_transposed: bool = False  # stored [E, H, I] instead of [E, I, H]
    down_transposed: bool = False  # stored [E, I, H] instead of [E, H, I]
    biases: bool = False


@dataclass(frozen=True, kw_only=True)
class MoESpec:
    path: str  # module path of the MoE block, e.g. model.layers.0.mlp
    block_type: str
    routing: RoutingSpec
    experts: ExpertSpec
    shared_experts: tuple[str, ...] = ()  # module paths left as they are, beside the rewrite
    shared_gate: bool = False  # shared output scaled by sigmoid(linear(x)) (Qwen2-MoE)
    dtype: str = "float32"
    compute_dtype: str = ""  # the dtype the original's expert GEMMs ran in where it is not the weights' (its
    # nn.Linear experts under torch.autocast: bfloat16 with float32 weights); the canonical experts cast to it

    def replace(self, **changes) -> "MoESpec":
        return dataclasses.replace(self, **changes)

    def summary(self) -> str:
        r, e = self.routing, self.experts
        route = f"kept: the model's own router ({r.kept})" if r.kept else r.score_fn
        if r.n_group > 1 and not r.kept:
            route += f", group-limited {r.topk_group}/{r.n_group} ({r.group_score})"
        if r.correction_bias and not r.kept:
            route += ", correction bias"
        if r.renormalize:
            route += ", renormalized"
        if r.scaling != 1.0:
            route += f", x{r.scaling:g}"
        if r.weights_on_input:
            route += ", weights on input"
        if r.capacity >= 0:
            route += f", capacity {r.capacity}{' per sequence' if r.capacity_per_sequence else ''} ({r.drop_order})"
        act = ("gated " if e.gated else "") + e.activation + (" +bias" if e.biases else "")
        layout = e.storage if e.gate_up == "separate" else f"{e.storage}, gate_up {e.gate_up}"
        if e.up_transposed or e.down_transposed:
            layout += ", transposed"
        shared = f", shared experts {list(self.shared_experts)}" if self.shared_experts else ""
        if self.shared_gate:
            shared += " (sigmoid-gated)"
        return (
            f"E={e.num_experts}{f'+{e.identity_experts} identity' if e.identity_experts else ''} k={r.top_k} "
            f"H={e.hidden} I={e.intermediate} {self.dtype}"
            f"{f' (experts compute in {self.compute_dtype})' if self.compute_dtype else ''}; route: {route}; "
            f"experts: {act} [{layout}]{shared}"
        )


@dataclass(kw_only=True)
class Binding:
    """Graph values that feed the canonical form of one block."""

    x: fx.Node  # the block's token input, [..., H]
    logits: fx.Node  # the router logits, [..., E]
    correction_bias: fx.Node | None = None
    weights: dict[str, fx.Node | list[fx.Node]] = field(default_factory=dict)  # role -> node(s), see canonical.py
    routed: fx.Node | None = None  # the node the canonical output replaces
    topk_weights: fx.Node | None = None  # a kept router's [T, K] weights (RoutingSpec.kept)
    topk_ids: fx.Node | None = None  # ... and its [T, K] expert ids
