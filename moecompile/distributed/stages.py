"""``moecompile.pipeline_stage``: one pipeline stage of a transformers model, for ``torch.distributed.pipelining``;
``moecompile.PipelineStage``: torch's ``PipelineStage`` reducing a sharded stage's gradients once a step.

    stage = moecompile.pipeline_stage(model, index, count)     # layers split evenly; or layers=[4, 5, 6]
    run = moecompile.PipelineStage(torch.compile(moecompile.parallelize(stage, mesh, example), backend="moe"),
                                   index, count, device, group=mesh.get_group("pp"))

The stage holds the model's own modules (nothing copied) under their names in the model (``model.layers.4.mlp``...,
so a ``torch.distributed.checkpoint`` of every stage is one of the model): the first stage its input embedding,
every stage its decoder layers, the last its final norm and head. It runs the model's own forward on them, which
makes the positions, rotary embeddings and causal masks from the sequence as the whole model does: the first stage
takes token ids, the others the previous stage's hidden states (as ``inputs_embeds``); the last returns the
logits, the others the hidden states before the final norm. What the model's forward reads per layer by position
(``config.layer_types``: sliding or full attention, linear attention, ...) is cut to the stage's layers in a
config of the stage's own.

A stage is a shallow copy of the model (its class a subclass of the model's, ``_Stage`` first: the stage's
forward) and of its decoder (``model.model``), each with lists of children of its own, so the model itself is
left as it was and stays whole; Dynamo traces the stage with the sources it would give the model.
Layers that hand on streams of hidden states (hyper-connections: DeepSeek-V4's and HY-V4's [B, T, 4, H], Qwen4-exp's
[B, T, 4 * H], collapsed by a head after the layers, ``_AFTER``, which goes with the final norm to the last stage)
have a stage hand its streams on as they are, and layers or a decoder that read the token ids (DeepSeek-V4's hash
routing, Qwen4-exp's per-layer embeddings) have every stage but the last hand on ``(hidden, ids)``: the next stage
runs its decoder's forward on the first stream (its masks and positions; the ids as ``ple_input_ids`` where the
decoder takes them), and a forward pre-hook on each of the model's layers (``_carried``: inert unless a stage
passes ``_CARRY`` through the decoder's keyword arguments) gives its first layer the streams and every layer the ids.
Decoders passing more than hidden states from layer to layer (Gemma 4's per-layer inputs, ZAYA's router states,
Inkling 2's block states) have every stage but the last hand that on beside them: ``stage_carry``.
Where the model cannot be cut so, a ``ValueError`` says why: no ``ModuleList`` of decoder layers, a decoder whose
forward runs weights beside its embedding, layers, final norm, hyper-connection head and those ``stage_carry``
places (``_check_cut``), the input embedding tied to the head (``tie_word_embeddings``) across two stages, whose
ranks would train two copies of it apart, a stage starting at a layer that reuses the top-k of the layer before it
(a "shared" indexer layer), or a stream model's last stage without a layer.

Not carried between stages: a padding mask (each stage makes the causal mask; pack sequences), the router logits
of ``output_router_logits`` (each stage sees its own layers only: a warning says so), key/value caches (training
only).
"""

from __future__ import annotations

import copy
import functools
import inspect
import warnings

import torch
from torch import nn
from torch.distributed import pipelining

from . import stage_carry
from .grads import holding
from .sharded_state import unwrapped

_LAYERS = ("layers", "blocks")  # the decoder's ModuleList of layers (transformers' name; dbrx's)
_AFTER = ("hc_head", "hyper_connection_mixer")  # weights a decoder runs after its layers beside the final norm, on the
# last stage: hyper-connection heads (its layers hand on the hidden states as streams, DeepSeek-V4's [B, T, 4, H],
# Qwen4-exp's [B, T, 4 * H], which they collapse)
_IDS = "ple_input_ids"  # a decoder's argument for the token ids where it is given inputs_embeds (Qwen4-exp's per-layer
# embeddings read them)
_CARRY = ("moe_stage_first", "moe_stage_hidden", "moe_stage_ids")  # (what a stage passes its layers: _carried)


def pipeline_stage(model: nn.Module, index: int, count: int, layers: list[int] | None = None) -> nn.Module:
    """Stage ``index`` of ``count`` of a transformers causal LM (or its base model): its decoder layers ``layers``
    (default: the layers split evenly, the first stages taking one more where they do not divide; given, every
    rank's together must take each layer once, in order), its input embedding if ``index == 0``, its final norm and
    head if ``index == count - 1``; ``stage.stage_layers`` lists its layers. See the module docstring."""
    if not (isinstance(count, int) and count >= 1 and isinstance(index, int) and 0 <= index < count):
        raise ValueError(f"pipeline_stage: index={index!r} of count={count!r}: need 0 <= index < count")
    model = unwrapped(model)  # (torch.compile's wrapper: the stage is compiled after cutting)
    if any(hasattr(m, "_moe_parallel") for m in model.modules()):
        raise ValueError("pipeline_stage: the model was parallelized already: cut it first, then parallelize each "
                         "stage module over the whole mesh (its outermost dimension \"pp\")")
    path, decoder, attr = _decoder(model)
    every = getattr(decoder, attr)
    total = len(every)
    carry = stage_carry.kind(decoder, every) if count > 1 else None  # (one stage: the decoder as it is)
    stage_carry.check(decoder, carry)
    if layers is None:
        share, extra = divmod(total, count)
        start = index * share + min(index, extra)
        layers = list(range(start, start + share + (index < extra)))
    elif sorted(set(layers)) != list(layers) or any(not 0 <= i < total for i in layers):
        raise ValueError(f"pipeline_stage: layers={layers!r}: need increasing indices of the model's {total} "
                         "decoder layers")
    first, last = index == 0, index == count - 1
    if count > 1 and _tied(model):
        raise ValueError("pipeline_stage: the model's input embedding is tied to its head (tie_word_embeddings): "
                         "the first and last stages' ranks would train two copies of it apart. Build the model "
                         "with config.tie_word_embeddings=False (or copy lm_head.weight) before cutting it")
    if count > 1 and getattr(decoder.config, "output_router_logits", False):
        warnings.warn("pipeline_stage: config.output_router_logits is on, but the router logits stay in each stage "
                      "(a stage passes on its hidden states only): the last stage gives the logits, and no stage the "
                      "load-balancing loss of every layer's routers", UserWarning, stacklevel=2)
    if not first and layers and getattr(getattr(every[layers[0]], "self_attn", None), "skip_topk", False):
        raise ValueError(f"pipeline_stage: layer {layers[0]} reuses the top-k of the indexer layer before it "
                         "(config.indexer_types: 'shared'), which a stage does not hand on: start each stage at a "
                         "'full' layer (layers=[...])")
    streams = any(name in _AFTER for name, _ in decoder.named_children())
    if streams and count > 1 and last and not layers:
        raise ValueError("pipeline_stage: the last stage of a model whose layers hand on streams of hidden states "
                         f"({', '.join(_AFTER)}) needs a layer: give it one (layers=[...])")
    if carry:  # (the model's tap and hooks first: the stage's copy of the decoder shares the tap)
        stage_carry.hook(decoder, every, layers, carry)
    stage = _shell(model, path, decoder, attr, list(layers), first, last, carry)
    stage.__class__ = _stage_class(type(model))
    stage.stage_path, stage.stage_first, stage.stage_last, stage.stage_layers = path, first, last, list(layers)
    stage.stage_width = decoder.get_input_embeddings().embedding_dim
    stage.stage_streams, stage.stage_kind, stage.stage_attr = streams, carry, attr
    if carry:
        stage.__dict__["_moe_whole"] = decoder  # (not a child: the stage holds the decoder's copy)
    takes_ids = len(every) > 0 and "input_ids" in inspect.signature(type(every[0]).forward).parameters
    stage.stage_ple = bool(getattr(decoder.config, "ple_layer_ids", None))  # (per-layer inputs of the ids: _IDS)
    stage.stage_ids = count > 1 and not last and (takes_ids or stage.stage_ple)  # (every stage hands the ids on)
    for i in layers:
        if not every[i].__dict__.get("_moe_stage_hook"):  # (the model's own layer: hooked once, inert without _CARRY)
            every[i].register_forward_pre_hook(functools.partial(_carried, i, takes_ids), with_kwargs=True)
            every[i].__dict__["_moe_stage_hook"] = True
    return stage


class _Stage:
    """Put before the model's class in the stage's own class (``_stage_class``): the model's forward, called on the
    stage's input (token ids on the first stage, hidden states after), giving the logits on the last stage of a
    causal LM and the hidden states before the final norm on the others. A model whose layers take the token ids
    (DeepSeek-V4's hash routing) has every stage but the last hand them on beside the hidden states (``ids``); one
    whose layers hand on streams of hidden states (DeepSeek-V4's hyper-connections, [B, T, n, H]) has them go to its
    next stage's first layer as they are (the decoder's own start makes them from one stream, ignored there)."""

    def forward(self, x: torch.Tensor, *carried: torch.Tensor):
        first, last = self.stage_first, self.stage_last
        if self.stage_kind:  # (stage_carry: a decoder passing more than hidden states from layer to layer)
            shell = self.get_submodule(self.stage_path) if self.stage_path else self
            if last and self.stage_path:  # a causal LM: the logits
                def call(**inputs):
                    return super(_Stage, self).forward(**inputs, use_cache=False).logits
            else:
                forward = shell.forward if self.stage_path else super().forward

                def call(**inputs):
                    return forward(**inputs, use_cache=False).last_hidden_state
            return stage_carry.run(self, shell, call, x, carried)
        ids = carried[0] if carried else None
        ids = x if first else ids
        streams = self.stage_streams and not first
        if streams and not self.stage_layers:  # (a middle stage without layers: handed on as it came)
            return (x, ids) if self.stage_ids else x
        inputs = {"input_ids": x} if first else {"inputs_embeds": x.flatten(2)[..., :self.stage_width] if streams
                                                 else x}  # (streams: the first one)
        if not first and ids is not None and self.stage_ple:
            inputs[_IDS] = ids
        if not first and self.stage_layers and (streams or ids is not None):
            inputs.update(moe_stage_first=self.stage_layers[0], moe_stage_hidden=x if streams else None,
                          moe_stage_ids=ids)
        if last and self.stage_path:  # a causal LM: its own forward applies the head (and logit scaling)
            return super().forward(**inputs, use_cache=False).logits
        decoder = self.get_submodule(self.stage_path) if self.stage_path else super()
        out = decoder.forward(**inputs, use_cache=False).last_hidden_state
        if not last and not self.stage_streams and out.shape != (*x.shape[:2], self.stage_width):
            raise ValueError(f"pipeline_stage: the decoder's layers pass a tensor of shape {tuple(out.shape)} on, "
                             f"not the hidden states ({tuple(x.shape[:2])} by {self.stage_width}) its next stage "
                             "takes as inputs_embeds: cut this model into stage modules by hand")
        return (out, ids) if self.stage_ids and not last else out


def _carried(index: int, takes_ids: bool, layer: nn.Module, args: tuple, kwargs: dict):
    """A forward pre-hook of decoder layer ``index`` (the model's own module): where a stage passes ``_CARRY``
    through its decoder's keyword arguments, it takes them out, gives the layer the token ids (``takes_ids``: its
    forward reads ``input_ids``), and the stage's first layer the hidden states it received (streams). Without them
    (the model called whole), nothing."""
    if _CARRY[0] not in kwargs:
        return None
    carried = {k: kwargs[k] for k in _CARRY}
    kwargs = {k: v for k, v in kwargs.items() if k not in _CARRY}
    if takes_ids and carried["moe_stage_ids"] is not None:
        kwargs["input_ids"] = carried["moe_stage_ids"]
    if index == carried["moe_stage_first"] and carried["moe_stage_hidden"] is not None:
        args = (carried["moe_stage_hidden"], *args[1:])
    return args, kwargs


@functools.cache
def _stage_class(cls: type) -> type:
    return type(f"{cls.__name__}Stage", (_Stage, cls), {"__module__": __name__})


def _decoder(model: nn.Module) -> tuple[str, nn.Module, str]:
    """The path and module of the model's decoder (the model itself, or one of its children, with a config and a
    ``ModuleList`` of layers: ``_LAYERS``) and that list's name."""
    for path, module in [("", model), *model.named_children()]:
        for attr in _LAYERS:
            if hasattr(module, "config") and isinstance(getattr(module, attr, None), nn.ModuleList):
                _check_cut(module, attr)
                return path, module, attr
    raise ValueError(f"pipeline_stage: neither {type(model).__name__} nor one of its children has a config and a "
                     f"ModuleList of decoder layers (named {' or '.join(_LAYERS)}): pass a causal LM or its base "
                     "model, or cut it into stage modules by hand (docs/expert-parallelism.md)")


def _check_cut(decoder: nn.Module, attr: str) -> None:
    """Refuse a decoder whose forward runs weights other than its input embedding, its layers, one final norm, a
    hyper-connection head (``_AFTER``) and, where ``stage_carry`` knows its kind, the weights it places (weights of its
    own, per-layer inputs made from the token ids): what passes from layer to layer may then be more than a stage
    hands on."""
    embedding = decoder.get_input_embeddings()
    weighted = [name for name, child in decoder.named_children()
                if child is not embedding and name != attr and any(True for _ in child.parameters())]
    norms = [name for name in weighted if "Norm" in type(getattr(decoder, name)).__name__]
    known = _AFTER
    if stage_carry.kind(decoder, getattr(decoder, attr)):  # (handed on between stages: stage_carry)
        known += (*stage_carry.BEFORE, *stage_carry.BEFORE_PARAMETERS, stage_carry.BLOCKS_AFTER)
    extra = [name for name in [*weighted, *decoder._parameters] if name not in norms[:1] and name not in known]
    if extra:
        raise ValueError(f"pipeline_stage: {type(decoder).__name__}'s forward runs weights beside its input "
                         f"embedding, its {attr} and one final norm ({', '.join(extra)}): what passes from layer to "
                         "layer may be more than the hidden states a stage hands on, so it cannot be cut between "
                         "layers here: cut it into stage modules by hand (docs/expert-parallelism.md)")


def _tied(model: nn.Module) -> bool:
    inputs, outputs = model.get_input_embeddings(), model.get_output_embeddings()
    return outputs is not None and inputs is not None and outputs.weight is inputs.weight


def _copy(module: nn.Module) -> nn.Module:
    """A shallow copy of ``module`` with dicts of its own (children, parameters, buffers, hooks): changing one of the
    copy's children leaves the module as it was."""
    shell = copy.copy(module)
    for name, value in vars(module).items():
        if name.startswith("_") and isinstance(value, (dict, set)):
            object.__setattr__(shell, name, copy.copy(value))
    return shell


def _shell(model: nn.Module, path: str, decoder: nn.Module, attr: str, layers: list[int], first: bool, last: bool,
           carry: str | None = None):
    """The stage's copy of ``model``: it and its decoder copied (``_copy``), the decoder's layers cut to ``layers``
    (kept under their indices), its embedding (and the weights it runs before its layers: ``carry``) dropped unless
    ``first``, every other child with weights (the final norm) an ``nn.Identity`` unless ``last``, the modules beside
    the decoder (the head) dropped unless ``last``; ``stage_carry.prepare`` for ``carry``."""
    root = node = _copy(model)
    if path:  # a causal LM: its decoder one of its children
        node = root._modules[path] = _copy(model._modules[path])
    kept, every = nn.ModuleList(), getattr(decoder, attr)
    for i in layers:
        kept.add_module(str(i), every[i])
    node._modules[attr] = kept
    node.config = _stage_config(decoder.config, layers, len(every))
    embedding = decoder.get_input_embeddings()
    for name, child in list(node._modules.items()):
        if name == attr or child is None:
            continue
        if child is embedding or (carry and name in stage_carry.BEFORE):
            node._modules[name] = child if first else None
        elif not last and any(True for _ in child.parameters()):  # the final norm (_check_cut)
            node._modules[name] = nn.Identity()
    if carry:
        stage_carry.prepare(node, carry, first, last)
    if path and not last:  # the head and any other weights beside the decoder
        root._parameters.clear()
        for name in root._modules:
            root._modules[name] = node if name == path else None
    return root


def _stage_config(config, layers: list[int], total: int):
    """A copy of the decoder's config for the stage's forward: ``num_hidden_layers`` the stage's count, each list of
    one name or flag per layer (``layer_types``...) cut to the stage's layers."""
    config = copy.deepcopy(config)
    for name, value in vars(config).items():
        if (isinstance(value, (list, tuple)) and len(value) == total and name != "architectures"
                and all(isinstance(v, (str, bool)) for v in value)):
            setattr(config, name, type(value)(value[i] for i in layers))
    for name in ("num_hidden_layers", "num_layers", "n_layers", "n_layer"):
        if getattr(config, name, None) == total:
            setattr(config, name, len(layers))
    return config


class PipelineStage(pipelining.PipelineStage):
    """``torch.distributed.pipelining.PipelineStage`` for a stage module ``moecompile.parallelize`` sharded (or its
    ``torch.compile`` wrapper): the same arguments and schedule, its data-parallel gradient reductions made once a
    step, in the backward of the last microbatch, as torch's schedules do for a DistributedDataParallel or FSDP2
    stage module (``moecompile.no_sync`` around every other microbatch's backward). With torch's own class every
    microbatch's backward reduces the stage's replicated gradients: the same gradients, n_microbatches all-reduces a
    step where one does. A stage module ``parallelize`` did not shard runs as under torch's class."""

    def _to_tensor(self, arg):
        """torch's metadata inference runs a stage on tensors made from the previous stage's metadata, uninitialized:
        integer ones are made zeros here, valid token ids (a stage handed DeepSeek-V4's ids indexes with them)."""
        out = super()._to_tensor(arg)
        if not isinstance(arg, torch.Tensor) and type(out) is torch.Tensor and not out.is_floating_point():
            out = out.zero_()
        return out

    def backward_maybe_with_nosync(self, backward_type, bwd_kwargs: dict, last_backward: bool = False):
        if last_backward:
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
        with holding(self.submod, stage=True):  # (an FSDP2 stage module: the schedule defers its reduce-scatter)
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
