"""Alias tables: the different names model families give the same MoE attribute, and fixed explanations.

Detection itself reads the graph, not attributes; ``explain`` reads the model's config through these tables to
check what detection found (and ``models/hf.py`` to shrink configs), so that a new family's naming is a row
here, not a new function.
"""

from __future__ import annotations

CONFIG_ALIASES: dict[str, tuple[str, ...]] = {
    "num_experts": ("num_experts", "n_routed_experts", "num_local_experts", "moe_num_experts", "num_routed_experts",
                    "n_experts"),
    "top_k": ("num_experts_per_tok", "moe_topk", "top_k", "num_selected_experts", "moe_k"),
    # the shapes the planner (moecompile/plan) reads beside those; the first name present wins
    "hidden": ("hidden_size", "d_model", "n_embd", "model_dim"),
    "expert_intermediate": ("moe_intermediate_size", "expert_intermediate_size", "moe_ffn_hidden_size",
                            "intermediate_size", "ffn_hidden_size", "ffn_dim"),
    "dense_intermediate": ("intermediate_size", "ffn_hidden_size", "ffn_dim"),
    "layers": ("num_hidden_layers", "num_layers", "n_layer", "n_layers"),
    "shared_experts": ("n_shared_experts", "num_shared_experts", "moe_num_shared_experts"),
    "shared_intermediate": ("shared_expert_intermediate_size", "moe_shared_expert_intermediate_size"),
    "heads": ("num_attention_heads", "n_head", "num_heads", "n_heads"),
    "kv_heads": ("num_key_value_heads", "num_kv_heads", "n_kv_heads", "kv_n_heads"),
    "vocab": ("vocab_size", "padded_vocab_size"),
    # top-k names the planner reads after "top_k"'s (the family walk's config shrinking, models/hf.py, sets only
    # those: these families' own code reads theirs)
    "top_k_more": ("num_experts_per_token", "top_k_experts", "moe_top_k"),
    # per-layer kinds in a list: how many layers there are, and which are MoE (nemotron_h's "moe")
    "layer_kinds": ("layers_block_type",),
}

# Fields that make some layers dense, as the models read them: "below" (layers below it), "above" (layers above
# it), "step" (all but every step-th layer, (i + 1) % step == 0), "dense" (these layers), "moe" (all but these),
# "types" (a kind per layer, "dense" or another).
# model_type of families whose routed experts have two matrices (up, down: no gate); the planner prices the rest as
# gated (tests/test_plan.py checks this against the installed transformers' expert classes)
TWO_MATRIX_EXPERTS = frozenset({"nemotron_h"})

LAYER_LAYOUT = {"first_k_dense_replace": "below", "first_k_dense": "below", "num_dense_layers": "below",
                "n_dense_layers": "below", "moe_layer_start_index": "below", "moe_layer_end_index": "above",
                "decoder_sparse_step": "step", "moe_layer_interval": "step", "mlp_only_layers": "dense",
                "moe_layers": "moe", "mlp_layer_types": "types"}
_LAYOUT_LISTS = ("dense", "moe", "types")


def moe_layer_flags(values: dict, n: int) -> list[bool]:
    """Whether each of ``n`` layers is MoE by the ``LAYER_LAYOUT`` fields of ``values`` (a config's dict)."""
    def dense(i, kind, v):
        if kind in _LAYOUT_LISTS:
            return v[i] == "dense" if kind == "types" else (i in v) == (kind == "dense")
        return {"below": i < v, "above": 0 <= v < i, "step": v > 1 and (i + 1) % v != 0}[kind]

    fields = [(kind, v) for k, kind in LAYER_LAYOUT.items()
              if isinstance(v := values.get(k), list if kind in _LAYOUT_LISTS else int)
              and (kind != "types" or len(v) >= n)]
    return [not any(dense(i, kind, v) for kind, v in fields) for i in range(n)]


# detect's finding; moecompile/tracing/capture.py completes it with why and the fix (which depend on how Dynamo traced)
EAGER_EXPERTS_REASON = "a router was found but no expert weights are used in this graph"


def config_value(config, field: str, default=None):
    """The first attribute of ``config`` named by ``CONFIG_ALIASES[field]``."""
    for name in CONFIG_ALIASES[field]:
        v = getattr(config, name, None)
        if v is not None:
            return v
    return default
