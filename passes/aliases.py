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
}

# detect's finding; moecompile/tracing/capture.py completes it with why and the fix (which depend on how Dynamo traced)
EAGER_EXPERTS_REASON = "a router was found but no expert weights are used in this graph"


def config_value(config, field: str, default=None):
    """The first attribute of ``config`` named by ``CONFIG_ALIASES[field]``."""
    for name in CONFIG_ALIASES[field]:
        v = getattr(config, name, None)
        if v is not None:
            return v
    return default
