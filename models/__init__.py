"""Tiny MoE models for tests and benchmarks.

``hf``: tiny random-weight HuggingFace MoE causal LMs (one config per family, plus
a generic shrinker for every MoE family of the installed transformers).
``handwritten``: plain-PyTorch MoE idioms (``HANDWRITTEN``: ModuleList, GShard, gpt-fast
gather, a where/index_add_ loop, a bmm capacity buffer, top-1 with the gate on the input) and
a tiny LM that stacks them.

Beside the three floors, for tests, benchmarks and the CLI's demo: may import ``moecompile.passes`` (the alias
tables), never the front end; only the CLI (``moecompile/__main__.py``) of the package imports these models.
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
