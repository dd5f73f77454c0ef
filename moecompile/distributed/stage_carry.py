"""What a pipeline stage hands on beside its hidden states where the decoder passes more than them from layer to layer
(``stages.pipeline_stage`` cuts such a model into two or more stages; one stage runs the decoder as it is):

    "per_layer"  Gemma 4's per-layer inputs (``embed_tokens_per_layer``): made once from the token ids and the input
                 embedding before the layers, ``[B, T, L, P]``, each layer reading its slice. The first stage makes
                 them with the model's own methods (its config counts every layer), each stage gives its decoder
                 its layers' slices (``per_layer_inputs``, its ``project_per_layer_inputs`` left out) and hands the
                 later layers' slices on. Layers that reuse earlier layers' keys and values
                 (``num_kv_shared_layers``) are refused.
    "router"     ZAYA's router states: each layer's router adds the previous layer's (``prev_router_hidden_states``),
                 and the residual stream is float32 (``input_hidden_states_scale`` and ``_bias`` before the layers,
                 on the first stage). A stage hands on (float32 hidden states, router states); a later stage's
                 first layer takes both as they are (its decoder's inputs_embeds, for masks and positions, are the
                 hidden states in the router states' dtype).
    "blocks"     Inkling 2's block attention residuals: the decoder stacks the hidden states at each block boundary
                 (``block_states``, ``[B, T, n, H]``) and every layer, and ``final_input`` after the last (on the
                 last stage), attends over the stack. A stage hands on (hidden states, the stack so far); a later
                 stage's layers and ``final_input`` see the stack it received before its decoder's own.

The model's own layers (and ``final_input``) carry hooks (``hook``): a stage passes its layers what they take
through its decoder's keyword arguments (so a layer run again in backward by activation checkpointing takes it again),
and sets a ``Tap``, one per model, around its decoder's forward, for what they give and for ``final_input``; the
model called whole passes neither, and the hooks do nothing.
"""

from __future__ import annotations

import functools
import inspect

import torch
from torch import nn

# weights a decoder runs before its layers (on the first stage), with the values standing in for its own parameters
# on the other stages, where what they compute is replaced (ZAYA's input scaling: neutral, so that a last stage
# without layers gives its input as it came)
BEFORE = ("embed_tokens_per_layer", "per_layer_model_projection", "per_layer_projection_norm")
BEFORE_PARAMETERS = {"input_hidden_states_scale": 1.0, "input_hidden_states_bias": 0.0}
BLOCKS_AFTER = "final_input"  # Inkling 2's attention over the block stack after the layers (on the last stage)


class Tap:
    """Set by a stage around its decoder's forward: the stack it received (for ``final_input``), and what its layers
    give (ZAYA: the last layer's output; Inkling 2: the stack after the last layer)."""

    def __init__(self):
        self.clear()

    def clear(self) -> None:
        self.on, self.blocks, self.after, self.out = False, None, None, None


class LastOf(nn.Module):
    """Stands in for Inkling 2's ``final_input`` on a stage before the last: the hidden states as they are."""

    def forward(self, *args):
        return (args[-1],)


def kind(decoder: nn.Module, every: nn.ModuleList) -> str | None:
    """Which of the module docstring's carries the decoder's layers need, or None."""
    layer = inspect.signature(type(every[0]).forward).parameters if len(every) else {}
    if "per_layer_inputs" in inspect.signature(type(decoder).forward).parameters and getattr(
            decoder, "embed_tokens_per_layer", None) is not None:
        return "per_layer"
    if "prev_router_hidden_states" in layer:
        return "router"
    if "block_states" in layer and isinstance(getattr(decoder, BLOCKS_AFTER, None), nn.Module):
        return "blocks"
    return None


def check(decoder: nn.Module, what: str | None) -> None:
    if what == "per_layer" and getattr(decoder.config, "num_kv_shared_layers", 0):
        raise ValueError("pipeline_stage: the last config.num_kv_shared_layers layers reuse the keys and values of "
                         "earlier layers, which a stage does not hand on: cut it into stage modules by hand")


def prepare(node: nn.Module, what: str, first: bool, last: bool) -> None:
    """The stage's copy of the decoder (``node``, its modules before the layers, ``BEFORE``, on the first stage only:
    ``stages._shell``) made ready for ``what``: the decoder's own parameters before its layers on the first stage
    only (stand-in values on the others), stand-ins for what it runs after its layers on stages before the last."""
    for name, value in BEFORE_PARAMETERS.items():
        if name in node._parameters and not first:
            del node._parameters[name]
            object.__setattr__(node, name, value)
    if what == "per_layer":
        object.__setattr__(node, "project_per_layer_inputs", _given)
    if what == "blocks" and not last:
        node._modules[BLOCKS_AFTER] = LastOf()
    if what == "router" and not last:
        node._modules["norm"].weight = torch.empty(0)  # (its dtype: the float32 stream handed on as it is)


def _given(inputs_embeds, per_layer_inputs):
    return per_layer_inputs  # (a stage's decoder: its layers' slices of those made on the first stage, projected)


def hook(decoder: nn.Module, every: nn.ModuleList, layers: list[int], what: str) -> Tap:
    """The model's tap (made once) and the hooks of ``layers`` (and ``final_input``) for ``what`` (each once)."""
    tap = decoder.__dict__.setdefault("_moe_stage_tap", Tap())
    final = [(None, getattr(decoder, BLOCKS_AFTER))] if what == "blocks" else []
    for i, module in [(i, every[i]) for i in layers] + final:
        if module.__dict__.get("_moe_stage_carry"):
            continue
        module.__dict__["_moe_stage_carry"] = True
        module.__dict__["_moe_stage_tap"] = tap
        if what == "router":
            module.register_forward_pre_hook(functools.partial(_router_in, i), with_kwargs=True)
            module.register_forward_hook(_router_out)
        elif what == "blocks":
            module.register_forward_pre_hook(_blocks_in if i is not None else _final_in, with_kwargs=True)
    return tap


# What a layer takes reaches it through its decoder's keyword arguments (taken out by its hook): a layer that runs
# again in backward (activation checkpointing of the module, hooks included) takes the same again. What a layer gives
# goes to the tap, only while it is set (not when a layer runs again).
ROUTER, BLOCKS = ("moe_carry_first", "moe_carry_hidden", "moe_carry_router"), "moe_carry_blocks"


def _router_in(index: int, layer, args, kwargs):
    if ROUTER[0] not in kwargs:
        return None
    first, hidden, router = (kwargs[k] for k in ROUTER)
    kwargs = {k: v for k, v in kwargs.items() if k not in ROUTER}
    if index == first:
        args = (hidden, router, *args[2:])
    return args, kwargs


def _router_out(layer, args, output):
    tap = layer.__dict__["_moe_stage_tap"]
    if tap.on:
        tap.out = output


def _blocks_in(layer, args, kwargs):
    """The layer's stack: the one the stage received, then its decoder's own; and the stack after the layer, as
    the decoder's loop makes it (the layer's input added at a block boundary)."""
    if BLOCKS not in kwargs:
        return None
    received = kwargs[BLOCKS]
    kwargs = {k: v for k, v in kwargs.items() if k != BLOCKS}
    hidden, stack = args[0], args[1]
    if received is not None:
        stack = torch.cat([received, stack], dim=-2)
    tap = layer.__dict__["_moe_stage_tap"]
    if tap.on:
        tap.after = torch.cat([stack, hidden.unsqueeze(-2)], dim=-2) if layer.is_block_boundary else stack
    return (hidden, stack, *args[2:]), kwargs


def _final_in(module, args, kwargs):
    tap = module.__dict__["_moe_stage_tap"]  # (the decoder calls it directly, never again in backward)
    if tap.on and tap.blocks is not None:
        return (torch.cat([tap.blocks, args[0]], dim=-2), *args[1:]), kwargs
    return None


def run(stage, decoder: nn.Module, call, x: torch.Tensor, carried: tuple):
    """The stage's output for the carry kinds: ``call(**inputs)`` runs the decoder (or the causal LM on the last
    stage) and gives its last hidden states (or logits)."""
    what, first, last, layers = stage.stage_kind, stage.stage_first, stage.stage_last, stage.stage_layers
    tap, n = decoder.__dict__["_moe_stage_tap"], len(layers)
    extra = carried[0] if carried else None
    if not first and len(carried) != 1:
        raise ValueError(f"pipeline_stage: a later stage of this model takes (hidden states, {_TAKES[what]}), as the "
                         f"stage before it gives them; got {1 + len(carried)} tensors")
    inputs = {"input_ids": x} if first else {"inputs_embeds": x}
    if what == "per_layer":
        if first:
            whole = stage.__dict__["_moe_whole"]  # (the model's decoder: its config counts every layer)
            embeds = decoder.get_input_embeddings()(x)
            extra = whole.project_per_layer_inputs(embeds, whole.get_per_layer_inputs(x, embeds))
            inputs = {"inputs_embeds": embeds}
        elif not n and not last:
            return x, extra
        out = call(**inputs, per_layer_inputs=extra[:, :, :n])
        return out if last else _sent(out, extra[:, :, n:])
    if what == "router" and not first and not n:
        return call(**inputs) if last else (x, extra)
    if what == "blocks" and not first and not n and not last:
        return x, extra
    tap.clear()
    tap.on, tap.blocks = True, extra if what == "blocks" else None
    if what == "blocks":
        inputs[BLOCKS] = extra
    elif not first:
        inputs = {"inputs_embeds": x.to(extra.dtype), **dict(zip(ROUTER, (layers[0], x, extra)))}
    try:
        out = call(**inputs)
        if last:
            result = out
        elif what == "router":  # (a first stage without layers: the scaled stream, no router states yet)
            result = _sent(*tap.out) if tap.out is not None else _sent(out, out.new_zeros(
                *out.shape[:-1], decoder.config.router_hidden_size, dtype=decoder.get_input_embeddings().weight.dtype))
        else:
            empty = out.new_zeros(*out.shape[:-1], 0, out.shape[-1])  # (a first stage without layers: no blocks)
            result = _sent(out, tap.after if tap.after is not None else empty)
    finally:
        tap.clear()
    return result


_TAKES = {"per_layer": "per-layer inputs", "router": "router states", "blocks": "block states"}


def _sent(*tensors: torch.Tensor) -> tuple:
    return tuple(t.contiguous() for t in tensors)  # (torch's pipeline schedules send and receive contiguous tensors)
