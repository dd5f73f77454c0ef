"""``parallelize`` of a model built on the meta device (``with torch.device("meta"): model = ...``): the way a model
too large for one host (DeepSeek-V3: 1.3 TB of bf16 weights) is sharded, as torchtitan does, each rank allocating
only what it holds.

Detection proves what the code computes, not what the weights hold (``passes/verify.py`` probes each block with
random tokens). So each MoE block is traced alone (``find_blocks.py``) on random weights of its real shapes, made
on the mesh's device for that block and dropped after (``materialized``): one block at a time, as the stand-ins of
a sharded layer are (``passes/sharded.py``). The model runs the example once on shapes only to record each block's
inputs (``shapes_only``, ``recorded``: a KV cache as the call met it), each MoE block run on such random weights and
inputs, its output put back on meta.

Then, before anything holds a parameter (gradient hooks, views, guards), ``materialize`` makes the expert weights
the sharding will cut zero-stride views of one element on the mesh's device (``LAZY``) until the sharding copies this
rank's rows out of them (``realize``); ``finish`` allocates what the sharding left of them whole. Every other weight
stays on meta: the user allocates it with ``model.to_empty(device=...)``, after FSDP2's ``fully_shard`` where wanted
(torchtitan's order: the dense weights then allocated sharded); on this model ``to_empty`` keeps what ``parallelize``
allocated (``_to_empty``: torch's would give the experts and the placement tables their ops read new, uninitialized
memory), and a forward before it raises, naming it. Each rank so allocates its shard of the experts, never a layer's
whole experts. The weights hold no values after ``to_empty``: initialize them in place (transformers'
``init_weights()``), or load them (``moecompile.load_hf_checkpoint``, ``load_state_dict``,
``torch.distributed.checkpoint.load``).
"""

from __future__ import annotations

import collections
import contextlib
import copy
import functools
import sys

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily
from torch.utils._pytree import tree_map

from moecompile.passes.sharded import random_weight

from .mesh import device_of

LAZY = "_moe_lazy"  # a parameter of the mesh's device that holds one element, expanded: the sharding copies rows


def on_meta(model: nn.Module) -> bool:
    """Whether any parameter or buffer of ``model`` is on the meta device."""
    return any(t.is_meta for t in (*model.parameters(), *model.buffers()))


def check(model: nn.Module, mesh, dedup: str, domains) -> torch.device | None:
    """The device a model on meta is allocated on (``device_of``), None for a model not on meta; ValueError naming
    the fix for what a model on meta cannot ask (its weights hold no values to route by)."""
    if not on_meta(model):
        return None
    asked = [f"dedup={dedup!r}" if dedup == "auto" else "", "expert_domains='auto'" if domains == "auto" else ""]
    if any(asked):
        raise ValueError(f"{' and '.join(a for a in asked if a)} chooses from the routing of the example, which a "
                         "model on the meta device does not have (its weights hold no values): name the level "
                         "(dedup='node', expert_domains={level: size}) or build the model on a device")
    return device_of(mesh)


def _tensors(module: nn.Module, buffers: bool = True):
    """(the dict holding it, its name, the tensor) for each parameter (and buffer) of ``module`` and below."""
    for owner in module.modules():
        for store in (owner._parameters, owner._buffers) if buffers else (owner._parameters,):
            for name, t in list(store.items()):
                if t is not None:
                    yield store, name, t


def _random_like(t: torch.Tensor, device, gen: torch.Generator) -> torch.Tensor:
    """Values for a meta tensor while a block is proved: a weight's usual scale (probes neither vanish nor saturate),
    zeros for integers (expert ids of hash tables, positions), True for masks. A parameter's stacked experts as
    windows of one buffer (``random_weight``), an input whole."""
    if t.dtype == torch.bool:
        return torch.ones(t.shape, dtype=t.dtype, device=device)
    if not t.is_floating_point():
        return torch.zeros(t.shape, dtype=t.dtype, device=device)
    if t.dim() >= 2:
        return random_weight(t.shape, t.dtype, gen, windows=isinstance(t, nn.Parameter))  # (as verify's stand-ins)
    return torch.randn(t.shape, generator=gen, device=device, dtype=t.dtype).mul_(0.1)


def real(args, kwargs, device, seed: int = 0):
    """``args``, ``kwargs`` with each meta tensor replaced by random values on ``device`` (``_random_like``), those
    of a KV cache too (``recorded``)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    make = lambda t: _random_like(t, device, gen) if isinstance(t, torch.Tensor) and t.is_meta else t  # noqa: E731
    deep = lambda leaf: _copied(leaf, make) if _call_state(leaf) else make(leaf)  # noqa: E731
    return tree_map(deep, args), tree_map(deep, kwargs)


def as_meta(out):
    """``out`` with each tensor an empty one of its shape on the meta device (a plain one, not a fake tensor)."""
    with unset_fake_temporarily():
        return tree_map(lambda t: torch.empty(t.shape, dtype=t.dtype, device="meta")
                        if isinstance(t, torch.Tensor) else t, out)


def recorded(out):
    """``as_meta(out)`` (a module's call, recorded), each per-call state object in it copied as it is now: a KV cache
    or KV-sharing dict the model fills as it runs (``_call_state``), which the block run alone again must meet as its
    first call did, not as the rest of the model left it (Gemma 4's sliding-window cache: 6 tokens more)."""
    return as_meta(tree_map(lambda leaf: _copied(leaf, as_meta) if _call_state(leaf) else leaf, out))


def _call_state(leaf) -> bool:
    """A transformers ``Cache``, or a dict-like object pytree does not open (Gemma 4's ``KVSharingDict``)."""
    caches = sys.modules.get("transformers.cache_utils")  # (loaded by any transformers model that has one)
    return isinstance(leaf, collections.UserDict) or (caches is not None and isinstance(leaf, caches.Cache))


def _copied(state, make):
    """A deep copy of ``state`` whose tensors are ``make(tensor)`` (never copied themselves: a fake tensor's copy
    reads its data pointer)."""
    found: dict[int, torch.Tensor] = {}
    todo, seen = [state], set()
    while todo:  # (the objects, lists, tuples and dicts that hold a cache's tensors)
        obj = todo.pop()
        if isinstance(obj, torch.Tensor):
            found[id(obj)] = obj
        elif id(obj) not in seen and (isinstance(obj, (list, tuple, dict, collections.UserDict)) or (
                hasattr(obj, "__dict__") and not isinstance(obj, (type, nn.Module)))):
            seen.add(id(obj))
            todo.extend(obj.values() if isinstance(obj, (dict, collections.UserDict)) else
                        obj if isinstance(obj, (list, tuple)) else vars(obj).values())
    return copy.deepcopy(state, {key: make(t) for key, t in found.items()})


def shapes_only():
    """Where a model on meta runs the example: tensors with shapes, no values, that transformers' code takes for a
    trace (a fake tensor: it then skips the checks that read values, as its packed-sequence test of the positions),
    each MoE block run on random weights (``run_materialized``)."""
    return FakeTensorMode(allow_non_fake_inputs=True)


@contextlib.contextmanager
def materialized(module: nn.Module, device, seed: int = 0):
    """While inside: each meta parameter and buffer of ``module`` holds random values on ``device``
    (``_random_like``); yields {id(the random parameter): the meta one} to map what was found back. The meta
    tensors are put back after."""
    gen = torch.Generator(device=device).manual_seed(seed)
    saved, standing, made = [], {}, {}  # (made: a tensor held twice, tied weights, gets one value)
    try:
        for store, name, t in _tensors(module):
            if not t.is_meta:
                continue
            if id(t) not in made:
                value = _random_like(t, device, gen)
                if isinstance(t, nn.Parameter):
                    value = nn.Parameter(value, t.requires_grad)
                    standing[id(value)] = t
                made[id(t)] = value
            saved.append((store, name, t))
            store[name] = made[id(t)]
        yield standing
    finally:
        for store, name, t in saved:
            store[name] = t


def run_materialized(module: nn.Module, device, seed: int = 0):
    """A forward for ``module`` inside a model running on the meta device: the module runs on random weights and
    inputs on ``device`` (``materialized``), its output given back on meta."""
    forward = module.forward

    def run(*args, **kwargs):
        with unset_fake_temporarily():
            args, kwargs = real(args, kwargs, device, seed)
            with torch.no_grad(), materialized(module, device, seed):
                return as_meta(forward(*args, **kwargs))
    return run


def materialize(model: nn.Module, device, lazy: set[int]) -> None:
    """The parameters of ``lazy`` (ids of the meta parameters the sharding cuts) become zero-stride views of one
    element on ``device`` (``LAZY``); every other weight stays on meta for the user's ``model.to_empty()`` (after
    FSDP2's ``fully_shard`` where wanted), which then keeps what ``parallelize`` allocated (``_to_empty``). Called
    before the sharding, so that what holds a parameter (gradient hooks, views, guards) holds the allocated one.
    ``device`` None: nothing to do (the model is not on meta)."""
    if device is None:
        return
    model.to_empty = functools.partial(_to_empty, model, device)
    model._moe_unallocated = model.register_forward_pre_hook(_refuse_unallocated)
    made: dict[int, torch.Tensor] = {}  # a tensor held twice (tied weights) stays one
    for store, name, t in _tensors(model, buffers=False):
        if id(t) in lazy:
            if id(t) not in made:
                one = torch.empty((1,) * t.dim(), dtype=t.dtype, device=device)
                made[id(t)] = nn.Parameter(one.expand(t.shape), t.requires_grad)
                setattr(made[id(t)], LAZY, True)
            store[name] = made[id(t)]


def _to_empty(model: nn.Module, allocated_on: torch.device, *, device, recurse: bool = True) -> nn.Module:
    """``model.to_empty(device=...)`` of a model ``parallelize`` sharded on meta: torch's, then each tensor
    ``parallelize`` allocated (the experts' shards, the placement tables its ops read) put back as it was (torch's
    would give them new, uninitialized memory, the placement tables too)."""
    if torch.device(device).type != allocated_on.type:
        raise ValueError(f"to_empty(device={device!r}): moecompile.parallelize allocated this model's experts on "
                         f"{allocated_on} (the mesh's device); give that device")
    kept = [(store, name, t) for store, name, t in _tensors(model) if not t.is_meta]
    nn.Module.to_empty(model, device=device, recurse=recurse)
    for store, name, t in kept:
        store[name] = t
    return model


def _refuse_unallocated(model: nn.Module, args) -> None:
    """Before the first forward of a model ``parallelize`` sharded on meta: ValueError, naming the fix, if weights
    are still on meta (else the hook goes)."""
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise ValueError(f"{len(left)} weight(s) of a model moecompile.parallelize sharded on the meta device are "
                         f"still on meta ({left[0]}{', ...' if len(left) > 1 else ''}): allocate them with "
                         "model.to_empty(device=...) (after FSDP2's fully_shard where wanted), then initialize or "
                         "load them")
    unset = [layer for layer in getattr(getattr(model, "_moe_parallel", None), "replicas", []) if layer.unset]
    if unset:
        raise ValueError(f"the expert weights of {unset[0].path} (replicating, in a model moecompile.parallelize "
                         "sharded on the meta device) hold no values: load them (load_state_dict, "
                         "torch.distributed.checkpoint, moecompile.load_hf_checkpoint), or initialize its slot "
                         f"weights in place ({', '.join(unset[0].names)}: transformers' init_weights() does for "
                         "stacked experts) and then build moecompile.ExpertOptimizer, which makes each expert's "
                         "instances agree")
    model._moe_unallocated.remove()


def realize(module: nn.Module, attr: str, made: dict | None = None) -> None:
    """A lazy parameter (``materialize``) this rank keeps whole: allocated, uninitialized (``made``: id(lazy) -> its
    allocation, for one held twice)."""
    p = module._parameters[attr]
    if getattr(p, LAZY, False):
        made = {} if made is None else made
        if id(p) not in made:
            made[id(p)] = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=p.device), p.requires_grad)
        module._parameters[attr] = made[id(p)]


def finish(model: nn.Module, device) -> None:
    """Allocate the lazy parameters the sharding left whole (``realize``); ``device`` None: nothing to do (the
    model is not on meta)."""
    if device is None:
        return
    made: dict[int, nn.Parameter] = {}
    for owner in model.modules():
        for name, p in list(owner._parameters.items()):
            if p is not None:
                realize(owner, name, made)
