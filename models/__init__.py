"""Tiny MoE models for tests and benchmarks.

``hf``: tiny random-weight HuggingFace MoE causal LMs (one config per family, plus
a generic shrinker for every MoE family of the installed transformers).
``handwritten``: three plain-PyTorch MoE idioms (ModuleList, GShard, gpt-fast gather)
and a tiny LM that stacks them.
"""

from .handwritten import HANDWRITTEN, GatherMoE, GShardMoE, ModuleListMoE, TinyMoELM
from .hf import (
    FAMILIES,
    build_model,
    load_config,
    moe_families_in_transformers,
    randomize_moe_,
    shrink_config,
    tiny_config,
    tiny_model,
)

__all__ = [
    "FAMILIES", "tiny_config", "tiny_model", "build_model", "randomize_moe_", "load_config",
    "moe_families_in_transformers", "shrink_config",
    "HANDWRITTEN", "ModuleListMoE", "GShardMoE", "GatherMoE", "TinyMoELM",
]
