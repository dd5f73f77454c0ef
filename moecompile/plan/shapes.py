"""A model's MoE shapes from its ``config.json``: read through the alias tables detection uses
(``passes/aliases.py``: the names families give the number of experts, top-k, widths and which layers are MoE).

Multimodal configs keep the language model's fields in ``text_config`` (read from there when the top level has
no experts). Experts are priced as gated (gate, up and down projections: 3 matrices of H x I), but for the
families ``passes/aliases.py`` names in ``TWO_MATRIX_EXPERTS`` (up and down only). Attention: multi-head with
``kv_heads`` key/value heads, or DeepSeek's multi-head latent attention where the config gives ``kv_lora_rank`` (its low-rank
query and key/value projections, query/key heads of ``qk_nope_head_dim + qk_rope_head_dim``, value heads of
``v_head_dim``).
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass

from moecompile.passes.aliases import CONFIG_ALIASES, TWO_MATRIX_EXPERTS, moe_layer_flags

from .cluster import load_json


@dataclass(frozen=True)
class MoEShape:
    """What the planner prices. ``intermediate``: one routed expert's; ``dense_intermediate``: a dense layer's
    MLP; ``shared_intermediate``: all shared experts of a layer together (0: none)."""

    name: str
    hidden: int
    intermediate: int
    num_experts: int
    top_k: int
    layers: int
    moe_layers: int
    dense_intermediate: int
    shared_intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    gated: bool = True
    q_lora: int = 0  # multi-head latent attention (MLA) where kv_lora > 0: its ranks and head widths
    kv_lora: int = 0
    qk_nope: int = 0
    qk_rope: int = 0
    v_head: int = 0
    embeddings: int = 2  # vocab x hidden matrices held: the input embedding and the head (a pipeline stage's: 1)

    @property
    def mats(self) -> int:
        return 3 if self.gated else 2

    def expert_params(self) -> int:
        """One routed expert's weights."""
        return self.mats * self.hidden * self.intermediate

    def attention_params(self) -> int:
        H, n = self.hidden, self.heads
        if self.kv_lora:  # MLA: q (through its rank, if any), kv's down and up projections, o
            qk = self.qk_nope + self.qk_rope
            q = (H * self.q_lora + self.q_lora * n * qk) if self.q_lora else H * n * qk
            kv = H * (self.kv_lora + self.qk_rope) + self.kv_lora * n * (self.qk_nope + self.v_head)
            return q + kv + n * self.v_head * H
        q = n * self.head_dim
        kv = self.kv_heads * self.head_dim
        return H * (2 * q + 2 * kv)  # q, k, v and o projections

    def attention_core_flops(self, tokens: float, seq: int) -> float:
        """Scores and their weighted values of ``tokens`` queries over a causal ``seq`` (half the square):
        tokens x seq x heads x (query/key width + value width)."""
        qk, v = (self.qk_nope + self.qk_rope, self.v_head) if self.kv_lora else (self.head_dim, self.head_dim)
        return tokens * seq * self.heads * (qk + v)

    def dense_params(self) -> int:
        """Every weight but the routed experts': attention, dense MLPs, shared experts, routers, embeddings."""
        dense_layers = self.layers - self.moe_layers
        return (self.layers * self.attention_params() + dense_layers * self.mats * self.hidden *
                self.dense_intermediate + self.moe_layers * (self.mats * self.hidden * self.shared_intermediate +
                                                             self.hidden * self.num_experts)
                + self.embeddings * self.vocab * self.hidden)

    def as_dict(self) -> dict:
        return asdict(self)

    def zero_share(self, copies: int) -> float:
        """The busiest copy's share of a rank's expert weights under ZeRO-1 over ``copies`` copies
        (``moecompile.expert_zero_optimizer``: torch's ``ZeroRedundancyOptimizer`` gives each whole tensor, the
        largest first, to the rank holding least): each MoE layer's stacked gate_up (2 I x H; gate and up fused, as
        transformers holds them) and down (H x I), up and down for two-matrix experts."""
        sizes = sorted([self.mats - 1, 1] * self.moe_layers, reverse=True)
        held = [0] * copies
        for size in sizes:
            held[held.index(min(held))] += size
        return max(held) / sum(sizes)


MLA = {"q_lora": "q_lora_rank", "kv_lora": "kv_lora_rank", "qk_nope": "qk_nope_head_dim",
       "qk_rope": "qk_rope_head_dim", "v_head": "v_head_dim"}  # DeepSeek's config fields


def _get(values: dict, field: str, default=None):
    for name in CONFIG_ALIASES[field]:
        v = values.get(name)
        if v is not None:
            return v
    return default


def read_config(source) -> MoEShape:
    """A ``config.json`` path, a directory holding one, or its dict -> ``MoEShape``. A dense model (no experts
    field) or a config missing a width raises ``ValueError`` naming the fields it looked for."""
    name = "config"
    if isinstance(source, (str, os.PathLike)):
        path = os.path.join(source, "config.json") if os.path.isdir(source) else source
        values = load_json(path, "model config")
        name = values.get("_name_or_path") or values.get("model_type") or os.path.basename(os.path.dirname(
            os.path.abspath(path))) or name
    else:
        values = dict(source)
        name = values.get("model_type", name)
    if _get(values, "num_experts") is None and isinstance(values.get("text_config"), dict):
        values = {**values["text_config"], "model_type": values.get("model_type")}
    for nested in ("ffn_config", "attn_config"):  # dbrx keeps its experts' and attention's fields there
        if isinstance(values.get(nested), dict):
            values = {**values[nested], **values}
    experts, top_k = _get(values, "num_experts"), _get(values, "top_k", _get(values, "top_k_more"))
    if not isinstance(experts, int) or experts < 2 or not isinstance(top_k, int) or top_k < 1:
        raise ValueError(f"{name}: not an MoE config: no expert count ({'|'.join(CONFIG_ALIASES['num_experts'])}) "
                         f"and top-k ({'|'.join(CONFIG_ALIASES['top_k'])}) found; the planner plans MoE models")
    need = {f: _get(values, f) for f in ("hidden", "expert_intermediate", "layers", "heads", "vocab")}
    if need["layers"] is None and isinstance(_get(values, "layer_kinds"), list):
        need["layers"] = len(_get(values, "layer_kinds"))
    missing = [f"{f} ({'|'.join(CONFIG_ALIASES[f])})" for f, v in need.items() if not isinstance(v, int)]
    if missing:
        raise ValueError(f"{name}: the config lacks {', '.join(missing)}: add them to the config")
    H, layers, heads = need["hidden"], need["layers"], need["heads"]
    flags = moe_layer_flags(values, layers)
    kinds = _get(values, "layer_kinds")
    if isinstance(kinds, list) and "moe" in kinds:  # the list names every layer: MoE ones by kind
        flags = [k == "moe" for k in kinds]
    shared = _get(values, "shared_experts", 0) or 0
    shared_inter = _get(values, "shared_intermediate") or shared * need["expert_intermediate"]
    return MoEShape(name=str(name), hidden=H, intermediate=need["expert_intermediate"], num_experts=experts,
                    top_k=top_k, layers=layers, moe_layers=sum(flags),
                    dense_intermediate=_get(values, "dense_intermediate", need["expert_intermediate"]),
                    shared_intermediate=int(shared_inter), heads=heads,
                    kv_heads=_get(values, "kv_heads", heads) or heads,
                    head_dim=values.get("head_dim") or H // heads, vocab=need["vocab"],
                    gated=values.get("model_type") not in TWO_MATRIX_EXPERTS,
                    **{field: values.get(key) or 0 for field, key in MLA.items()})
