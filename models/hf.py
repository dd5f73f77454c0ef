"""Tiny random-weight HuggingFace MoE models (no downloads).

``FAMILIES`` maps a transformers ``model_type`` to the config kwargs of a tiny
model (vocab 128, hidden 32, 2 layers, 4 query / 2 kv heads of dim 8, 8 experts,
top-2, expert width 16).  ``tiny_model`` builds it with random weights and then
re-draws every router / expert tensor and every all-zero tensor (biases,
``e_score_correction_bias``, zero-centred norms) so routing is decisive and
every code path (biases included) changes the output.

``moe_families_in_transformers`` and ``walk_config`` cover *every* MoE causal
LM of the installed transformers, for tests that walk them all: ``shrink_config``
shrinks a family's default config, best effort; ``WRITTEN_CONFIGS`` holds the
tiny configs of the families whose default config cannot be built or has its
MoE switched off.
"""

from __future__ import annotations

import os

import torch
from transformers import AutoConfig, AutoModelForCausalLM, CONFIG_MAPPING, PretrainedConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from moecompile.passes.aliases import CONFIG_ALIASES, LAYER_LAYOUT, moe_layer_flags

_COMMON = dict(
    vocab_size=128, hidden_size=32, intermediate_size=16, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=8,
    num_experts_per_tok=2, max_position_embeddings=128, tie_word_embeddings=False,
    bos_token_id=1, eos_token_id=2, pad_token_id=None,
)
# MLA (DeepSeek): rotary part of each head = head_dim; q/k heads are nope + rope wide.
_MLA = dict(q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8, head_dim=4,
            num_key_value_heads=4)
# DeepSeek-style routed + 1 shared expert, every layer MoE.
_DEEPSEEK_MOE = dict(n_routed_experts=8, moe_intermediate_size=16, n_shared_experts=1, first_k_dense_replace=0)

FAMILIES: dict[str, dict] = {name: {**_COMMON, **kw} for name, kw in {
    # softmax -> top-k -> always renormalised
    "mixtral": dict(num_local_experts=8),
    # softmax -> top-k, NOT renormalised; sigmoid-gated shared expert
    "qwen2_moe": dict(num_experts=8, moe_intermediate_size=16, shared_expert_intermediate_size=16,
                      norm_topk_prob=False, decoder_sparse_step=1),
    # softmax -> top-k -> renormalised
    "qwen3_moe": dict(num_experts=8, moe_intermediate_size=16, norm_topk_prob=True, decoder_sparse_step=1),
    # hybrid: one gated-delta-net layer + one full-attention layer, both MoE with a shared expert
    "qwen3_next": dict(num_experts=8, moe_intermediate_size=16, shared_expert_intermediate_size=16,
                       norm_topk_prob=True, decoder_sparse_step=1,
                       layer_types=["linear_attention", "full_attention"],
                       linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                       linear_value_head_dim=8, linear_conv_kernel_dim=4),
    "olmoe": dict(num_experts=8, norm_topk_prob=False),
    # softmax, group-limited greedy (max score per group), scaled, not renormalised
    "deepseek_v2": dict(**_MLA, **_DEEPSEEK_MOE, topk_method="group_limited_greedy", n_group=2, topk_group=1,
                        routed_scaling_factor=2.0, norm_topk_prob=False),
    # sigmoid + e_score_correction_bias, group-limited (top-2 sum per group), renormalised, scaled
    "deepseek_v3": dict(**_MLA, **_DEEPSEEK_MOE, n_group=2, topk_group=1, routed_scaling_factor=2.5,
                        norm_topk_prob=True),
    "glm4_moe": dict(**_DEEPSEEK_MOE, n_group=2, topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True),
    # router with bias, top-k then softmax, experts with biases and clamped swiglu; sliding + full layers
    "gpt_oss": dict(num_local_experts=8, sliding_window=4,
                    rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, factor=4.0, beta_fast=32.0,
                                         beta_slow=1.0, truncate=False, original_max_position_embeddings=32)),
    "granitemoe": dict(num_local_experts=8),
    # sparsemixer routing
    "phimoe": dict(num_local_experts=8),
    # top-k -> sigmoid, input scaled before the experts, always one shared expert; rope + no-rope layer
    "llama4_text": dict(num_local_experts=8, intermediate_size_mlp=16, interleave_moe_layer_step=1,
                        no_rope_layers=[1, 0], attention_chunk_size=4),
}.items()}

ROUTER_STD = 0.1   # router logits ~N(0, 0.57): decisive top-k, ties unlikely
EXPERT_STD = 0.1   # expert output comparable to the residual stream
BIAS_STD = 0.1     # zero-initialised biases / zero-centred norm weights
CORRECTION_BIAS = 0.1  # e_score_correction_bias ~ U(-0.1, 0.1)


def _check_family(family: str) -> None:
    if family not in FAMILIES:
        raise ValueError(f"unknown MoE family {family!r}; valid: {', '.join(sorted(FAMILIES))}")


def tiny_config(family: str, **overrides) -> PretrainedConfig:
    """The tiny config of ``family`` (a key of ``FAMILIES``), with ``overrides`` applied."""
    _check_family(family)
    return CONFIG_MAPPING[family](**{**FAMILIES[family], **overrides})


def _moe_role(path: str, module: torch.nn.Module) -> str | None:
    """'router', 'experts' (routed or shared) or None for the module at ``path``."""
    cls, last = type(module).__name__.lower(), path.rsplit(".", 1)[-1]
    if "router" in cls or last.endswith(("gate", "router")):
        return "router"
    if "expert" in cls or "expert" in path:
        return "experts"
    return None


@torch.no_grad()
def randomize_moe_(model: torch.nn.Module) -> torch.nn.Module:
    """Re-draw router/expert tensors and all-zero floating parameters in place, and all-zero hash tables of
    expert ids; rotary buffers untouched."""
    for path, module in model.named_modules():
        role = _moe_role(path, module)
        tensors = [(n, t, role is not None or not t.any()) for n, t in module.named_parameters(recurse=False)]
        tensors += [(n, t, role is not None) for n, t in module.named_buffers(recurse=False)]
        for name, t, redraw in tensors:
            if role == "router" and not t.is_floating_point() and t.dim() == 2 and not t.any() \
                    and isinstance(getattr(module, "num_experts", None), int):
                # a hash router's token -> experts table (DeepSeek-V4's tid2eid, zeros as built): K distinct each
                t.copy_(torch.rand(t.shape[0], module.num_experts).argsort(-1)[:, : t.shape[1]])
            if not redraw or not t.is_floating_point() or "inv_freq" in name:
                continue
            if "correction_bias" in name:
                t.uniform_(-CORRECTION_BIAS, CORRECTION_BIAS)
            elif t.dim() < 2 or "bias" in name:
                t.normal_(0.0, BIAS_STD)
            else:
                t.normal_(0.0, ROUTER_STD if role == "router" else EXPERT_STD)
    return model


def build_model(config: PretrainedConfig, *, seed: int = 0, dtype=torch.float32,
                experts_implementation: str | None = None) -> torch.nn.Module:
    """Random-weight causal LM for any config (see ``randomize_moe_``), cast to ``dtype``, in eval mode."""
    torch.manual_seed(seed)
    kw = {} if experts_implementation is None else {"experts_implementation": experts_implementation}
    model = AutoModelForCausalLM.from_config(config, **kw)
    randomize_moe_(model)
    return model.to(dtype).eval()


def tiny_model(family: str, *, seed: int = 0, dtype=torch.float32, experts_implementation: str | None = None,
               **overrides) -> torch.nn.Module:
    """Tiny random-weight causal LM of ``family``; ``experts_implementation`` in {"grouped_mm", "batched_mm", "eager"}."""
    return build_model(tiny_config(family, **overrides), seed=seed, dtype=dtype,
                       experts_implementation=experts_implementation)


def load_config(path: str | os.PathLike) -> PretrainedConfig:
    """Config from a user's ``config.json`` (the file or its directory), unchanged; never downloads."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(path)
    return AutoConfig.from_pretrained(path)


# ---------------------------------------------------------------- every MoE family of transformers

_EXPERT_COUNT_KEYS = CONFIG_ALIASES["num_experts"]
_TOPK_KEYS = CONFIG_ALIASES["top_k"]


def _default_config(family: str) -> PretrainedConfig | None:
    try:
        return CONFIG_MAPPING[family]()
    except Exception:
        return None


def _get(cfg: PretrainedConfig, name: str):
    try:
        return getattr(cfg, name, None)
    except Exception:  # e.g. per-layer attributes of heterogeneous configs
        return None


def _int(cfg: PretrainedConfig, name: str) -> int:
    v = _get(cfg, name)
    return v if isinstance(v, int) and not isinstance(v, bool) else 0


def _is_moe_config(cfg: PretrainedConfig) -> bool:
    return any(_int(cfg, k) > 1 for k in _EXPERT_COUNT_KEYS) or _int(cfg, "num_experts_per_tok") > 0


def _sub_configs(cfg: PretrainedConfig) -> list[PretrainedConfig]:
    return [v for v in vars(cfg).values() if isinstance(v, PretrainedConfig)]


def _is_moe_family_config(cfg: PretrainedConfig) -> bool:
    """MoE settings on ``cfg`` itself or in a nested sub-config (dbrx: ``ffn_config.moe_num_experts``).

    A composite multimodal wrapper (gemma4, llama4, qwen3_5_moe, qwen4_exp, dots3_note) nests the config of its
    text model, a causal LM family of its own that the walk takes under its own name (``*_text``): the wrapper
    is left out (so is dots3_note's vision-tower MoE, which token ids never reach).
    """
    subs = _sub_configs(cfg)
    if any(s.model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES for s in subs):
        return False
    return _is_moe_config(cfg) or any(_is_moe_config(s) for s in subs)


def moe_families_in_transformers() -> list[str]:
    """Sorted model_types of the installed transformers that are MoE causal LMs: MoE by their default config
    (nested sub-configs included), or MoE by the config written for them in ``WRITTEN_CONFIGS``."""
    out = {family for family in WRITTEN_CONFIGS if family in CONFIG_MAPPING}
    for family in CONFIG_MAPPING.keys():
        if family not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
            continue
        cfg = _default_config(family)
        if cfg is not None and _is_moe_family_config(cfg):
            out.add(family)
    return sorted(out)


# Families the walk cannot take from their shrunk default config, with the tiny sizes of ``FAMILIES``.
WRITTEN_CONFIGS: dict[str, dict] = {
    # MoE settings nested in ffn_config; its attention reads attn_config.rope_theta, which has no default, and
    # clamps q/k/v by attn_config.clip_qkv, whose default None fails in torch.clamp
    "dbrx": dict(vocab_size=128, d_model=32, n_heads=4, n_layers=2, max_seq_len=128, tie_word_embeddings=False,
                 attn_config=dict(kv_n_heads=2, rope_theta=10000.0, clip_qkv=8.0),
                 ffn_config=dict(ffn_hidden_size=16, moe_num_experts=8, moe_top_k=2)),
    # routed experts are off by default (n_routed_experts / num_experts_per_tok None)
    "dots1": {**_COMMON, **_DEEPSEEK_MOE},
    # MoE block off by default (enable_moe_block False, num_experts / top_k_experts / moe_intermediate_size None);
    # it runs beside the dense MLP of every layer; one sliding and one full-attention layer, small per-layer input
    "gemma4_text": dict(vocab_size=128, hidden_size=32, intermediate_size=16, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=8, global_head_dim=8,
                        max_position_embeddings=128, sliding_window=4,
                        layer_types=["sliding_attention", "full_attention"],
                        vocab_size_per_layer_input=128, hidden_size_per_layer_input=8, tie_word_embeddings=False,
                        enable_moe_block=True, num_experts=8, top_k_experts=2, moe_intermediate_size=16),
    # MoE off by default (is_moe False): product-key retrieval experts, single-neuron experts read from two [E, H]
    # embeddings; E a perfect square (sqrt(E) keys per side)
    "doge": {**_COMMON, **dict(is_moe=True, num_experts=16, num_experts_per_tok=2)},
    # mlp_only_layers defaults to the first layers, which are every layer at two: no dense-only layer here
    "flint": {**_COMMON, **dict(num_experts=8, moe_intermediate_size=16, mlp_only_layers=[])},
    # layer_types defaults to None, which the decoder layers index: one short-conv and one attention layer
    "lfm2_moe": {**_COMMON, **dict(num_experts=8, moe_intermediate_size=16, num_dense_layers=0,
                                   layer_types=["conv", "full_attention"])},
    # the indexed-attention layers need the QSA indexer sizes (all None by default); one layer of each kind
    "qwen4_exp_text": {**_COMMON, **dict(num_experts=8, moe_intermediate_size=16, shared_expert_intermediate_size=16,
                                         layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2,
                                         linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
                                         hc_lowrank=8, indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=8,
                                         indexer_budget=4, indexer_compress_ratio=2)},
}


def walk_config(family: str) -> PretrainedConfig | None:
    """The config the walk builds for ``family``: its tiny config (``FAMILIES``), else its written config
    (``WRITTEN_CONFIGS``), else its shrunk default config (None if that fails)."""
    if family in FAMILIES:
        return tiny_config(family)
    if family in WRITTEN_CONFIGS:
        return CONFIG_MAPPING[family](**WRITTEN_CONFIGS[family])
    return shrink_config(family)


# (attribute names, tiny value): every name present on the default config with a number is set.
_SHRINK = [
    (("vocab_size",), 128),
    (("hidden_size", "d_model", "n_embd", "model_dim"), 32),
    (("intermediate_size", "ffn_dim", "ffn_hidden_size", "moe_intermediate_size", "expert_intermediate_size",
      "shared_expert_intermediate_size", "shared_intermediate_size", "intermediate_size_mlp",
      "moe_ffn_hidden_size", "dense_intermediate_size", "moe_dim", "expert_dim", "router_hidden_size",
      "shared_experts_intermediate_size", "moe_shared_expert_intermediate_size", "expert_ffn_hidden_size"), 16),
    (("num_hidden_layers", "num_layers", "n_layer", "n_layers"), 2),
    (("num_attention_heads", "n_head", "n_heads", "swa_num_attention_heads"), 4),
    (("num_key_value_heads", "n_kv_heads", "num_kv_heads", "swa_num_key_value_heads"), 2),
    (("head_dim", "v_head_dim", "kv_channels", "attention_head_dim", "swa_head_dim"), 8),
    (_EXPERT_COUNT_KEYS, 8),
    (_TOPK_KEYS, 2),
    (("n_shared_experts", "num_shared_experts", "moe_num_shared_experts"), 1),
    (("first_k_dense_replace", "first_k_dense", "num_dense_layers", "n_dense_layers"), 0),
    (("decoder_sparse_step", "moe_layer_freq"), 1),
    (("n_group", "num_expert_group"), 2),
    (("topk_group",), 1),
    (("q_lora_rank", "kv_lora_rank", "o_lora_rank"), 16),
    (("zero_expert_num",), 2),
    (("qk_rope_head_dim", "qk_nope_head_dim"), 4),
    (("index_n_heads",), 2),
    (("index_head_dim",), 8),
    (("index_topk",), 4),
    (("max_position_embeddings", "n_positions", "model_max_length"), 128),
    (("sliding_window", "sliding_window_size", "attention_chunk_size"), 4),
    (("linear_num_key_heads", "linear_num_heads"), 2),
    (("linear_num_value_heads",), 4),
    (("linear_key_head_dim", "linear_value_head_dim", "linear_head_dim"), 8),
    (("mamba_d_state", "ssm_state_size", "state_size"), 8),
    (("mamba_n_heads", "mamba_num_heads"), 4),
    (("mamba_n_groups", "n_groups"), 1),
    (("mamba_d_head", "mamba_head_dim"), 16),
    (("mamba_dt_rank", "time_step_rank"), 4),
    (("attn_layer_period",), 2),
    (("attn_layer_offset",), 1),
]
_SET_EVEN_IF_NONE = {"head_dim", *_TOPK_KEYS}


def _per_layer_lists(cfg: PretrainedConfig, num_layers: int) -> dict[str, list]:
    """The attributes of ``cfg`` that hold one kind per layer (layer_types, mlp_layer_types, ...)."""
    return {k: v for k, v in cfg.to_dict().items()
            if isinstance(v, list) and len(v) == num_layers > 2 and all(isinstance(x, (str, int)) for x in v)
            and len(set(v)) <= 4}


_ROUTING_KEYS = {*_EXPERT_COUNT_KEYS, *_TOPK_KEYS, "n_group", "num_expert_group", "topk_group"}
def _dense_layout(values: dict, keep: list[int]) -> dict:
    """The ``LAYER_LAYOUT`` fields of a user's config shrunk to its layers ``keep``, each dense or MoE as it was."""
    flags = moe_layer_flags(values, max(keep) + 1)
    out = {}
    for k, kind in LAYER_LAYOUT.items():
        v = values.get(k)
        if isinstance(v, list) and kind in ("dense", "moe"):
            out[k] = [j for j, i in enumerate(keep) if flags[i] == (kind == "moe")]
        elif isinstance(v, list) and kind == "types" and len(v) > max(keep):
            out[k] = [v[i] for i in keep]
        elif isinstance(v, int) and kind == "below":  # the kept layers below it
            out[k] = sum(i < v for i in keep)
        elif isinstance(v, int) and kind == "above" and v >= 0:  # the last kept layer at or below it
            out[k] = sum(i <= v for i in keep) - 1
    steps = [k for k, kind in LAYER_LAYOUT.items() if kind == "step" and isinstance(values.get(k), int)]
    want = [flags[i] for i in keep]  # a step of 1 where the fields above now say which layers are dense, else 2
    step = next((s for s in (1, 2)
                 if moe_layer_flags({**values, **out, **dict.fromkeys(steps, s)}, len(keep)) == want), 1)
    return {**out, **dict.fromkeys(steps, step)}


def shrink_config(family: str, base: PretrainedConfig | None = None) -> PretrainedConfig | None:
    """Best-effort tiny config of any transformers MoE family (its defaults, sizes shrunk); None if it fails.

    With ``base`` (a user's config), that config is shrunk instead and its routing is kept: number of experts,
    top-k and expert groups stay as they are, so the tiny model routes like the real one.
    Per-layer lists (``layer_types``, ``mlp_layer_types``...) keep the first layer of every kind they
    contain, so hybrid models keep one layer of each kind (2 layers at least). A user's config with dense layers
    (``first_k_dense_replace``, ``mlp_only_layers``...: ``LAYER_LAYOUT``) keeps its first one and its first two MoE
    layers; a default config's are made MoE (``_SHRINK``), as the family walk builds it.
    """
    default = _default_config(family) if base is None else base
    if default is None:
        return None
    values = default.to_dict()
    present = set(values) | set(getattr(default, "attribute_map", {}))
    kw = {}
    for names, value in _SHRINK:
        for name in names:
            if base is not None and (name in _ROUTING_KEYS or name in LAYER_LAYOUT):
                continue
            v = _get(default, name)
            if name in present and (isinstance(v, (int, float)) and not isinstance(v, bool)
                                    or v is None and name in _SET_EVEN_IF_NONE):
                kw[name] = value
    if "qk_rope_head_dim" in kw:  # MLA: the rotary dim is the head_dim, one kv head per query head
        kw["head_dim"] = kw["qk_rope_head_dim"]
        if "num_key_value_heads" in kw and "num_attention_heads" in kw:
            kw["num_key_value_heads"] = kw["num_attention_heads"]
    layer_key = next((k for k in ("num_hidden_layers", "num_layers", "n_layer", "n_layers") if k in kw), None)
    per_layer = _per_layer_lists(default, _int(default, layer_key)) if layer_key else {}
    flags = moe_layer_flags(values, _int(default, layer_key)) if base is not None and layer_key else []
    moe = [i for i, f in enumerate(flags) if f][:2] if not all(flags) else []  # dense, then 2 MoE as tiny models
    keep = sorted({lst.index(x) for lst in [*per_layer.values(), flags] for x in lst} | {0, *moe})
    keep = keep if len(keep) > 1 else [0, 1]
    if per_layer or len(set(flags)) > 1:
        kw.update({k: [lst[i] for i in keep] for k, lst in per_layer.items()}, **{layer_key: len(keep)})
    if flags:
        kw.update(_dense_layout(values, keep))
    if isinstance(values.get("per_layer_config"), dict):  # heterogeneous per-layer overrides: drop them
        kw["per_layer_config"] = {}
    kw.update(tie_word_embeddings=False, use_cache=False)  # no KV cache: all-Mamba stacks cannot build one
    for name in ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id"):
        if _int(default, name) > 127:
            kw[name] = 127
    attempts = (kw, {k: v for k, v in kw.items() if k not in _TOPK_KEYS},  # some insist on their top-k
                {k: v for k, v in kw.items() if k != "per_layer_config"})  # or on their per-layer overrides
    for attempt in attempts:
        try:
            return CONFIG_MAPPING[family](**attempt) if base is None else type(base)(**{**values, **attempt})
        except Exception:
            pass
    return None


__all__ = ["FAMILIES", "tiny_config", "tiny_model", "build_model", "randomize_moe_", "load_config",
           "moe_families_in_transformers", "shrink_config", "WRITTEN_CONFIGS", "walk_config"]
