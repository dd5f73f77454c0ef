"""MoE blocks traced once per code and shapes: a block whose call would trace to the graph of a block explained
before takes that block's report, its paths and expert weights renamed to its own, without a trace of its own.

parallelize explains each MoE block alone (``find_blocks.py``), and a model's MoE layers are mostly one block
repeated (DeepSeek-V3: 58 layers of one code and shapes). Each trace costs Dynamo's time: a tiny Mixtral's block
about 0.34 s alone, 0.8 s on 4 ranks sharing 2 cores, where parallelize's traces took 40% of a training test.

What Dynamo reads of a module's call is the key (``key``): the class of every submodule (their code), every
attribute of theirs other than parameters and buffers (Python scalars and strings by value, containers entry by
entry, any other object by identity), and the shape, stride, dtype, device and requires_grad of every parameter,
buffer and recorded input tensor, with which of them are one tensor. Two calls of one key trace to one graph, but
for values read from tensors that steer Python (a graph break, then an ``if`` on the value): a report is taken
only from a block traced to one graph with no graph break, retrace, failure or skip (``clean``). Where something
in the key cannot be described (a tensor attribute that is no parameter or buffer, a tensor subclass: a DTensor),
the block is traced as before. The proof goes with the graph, as verify's ``SHARED_PROOFS`` shares a proof
between layers of one code and shapes: the record says ``proved_as`` the first block's layer.

Off where the example's routing of each layer is read (``dedup="auto"``, ``expert_domains="auto"``): a block not
run records none.
"""

from __future__ import annotations

import dataclasses
import enum
import itertools

import torch
from torch import nn

# attributes of a module that its call never reads: hooks of its state dict (per instance in transformers)
_NOT_READ = {"_parameters", "_buffers", "_modules", "_state_dict_hooks", "_state_dict_pre_hooks",
             "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks"}
_PLAIN = (bool, int, str, bytes, type, torch.dtype, torch.device, torch.layout, torch.memory_format, enum.Enum)


class _Opaque(Exception):
    """Something a trace may read that the key cannot describe: trace the block."""


class Twins:
    """The clean reports explained so far, by key: ``key`` of a block before it is explained (a trace leaves
    attributes on it: Dynamo's ``_is_torch_compile``), ``report`` of a key seen, ``add`` of a block explained."""

    def __init__(self, model: nn.Module, enabled: bool = True):
        self.model, self.enabled, self.first = model, enabled, {}  # key -> (path, its report)

    def key(self, path: str, inputs: tuple):
        """The key of the block at ``path`` called with ``inputs``; None: not to be shared."""
        return key(self.model.get_submodule(path), inputs) if self.enabled else None

    def report(self, k, path: str):
        """The report of the block at ``path`` of key ``k``, from the clean report of a block of its key explained
        before; None: trace it."""
        if k is None or k not in self.first:
            return None
        first_path, first = self.first[k]
        try:
            return renamed(first, self.model.get_submodule(first_path), first_path,
                           self.model.get_submodule(path), path)
        except _Opaque:
            return None

    def add(self, k, path: str, report) -> None:
        if k is not None and clean(report):
            self.first.setdefault(k, (path, report))


def clean(report) -> bool:
    """Whether the block traced to one graph and was proved, nothing broken, traced again, failed or skipped."""
    return bool(report.layers) and report.num_graphs == 1 and not (
        report.skipped or report.failures or report.graph_breaks or report.retraced or report.lost_to_recompiles)


def key(module: nn.Module, inputs: tuple):
    """What a trace of ``module(*args, **kwargs)`` (``inputs = (args, kwargs)``) reads besides tensor values
    (module docstring); None where something cannot be described."""
    tensors: dict[int, int] = {}  # id -> the index of its first appearance: which tensors are one
    try:
        parts = []
        for name, m in module.named_modules(remove_duplicate=False):
            attrs = tuple((k, _value(v)) for k, v in sorted(vars(m).items()) if k not in _NOT_READ)
            held = tuple((k, None if t is None else _tensor(t, tensors))
                         for k, t in itertools.chain(m._parameters.items(), m._buffers.items()))
            parts.append((name, type(m), attrs, held))
        return tuple(parts), _value(inputs, tensors)
    except Exception:  # _Opaque, or a tensor without strides (sparse): traced, as without twins
        return None


def _tensor(t: torch.Tensor, tensors: dict) -> tuple:
    if type(t) not in (torch.Tensor, nn.Parameter, nn.Buffer) or t.layout != torch.strided:
        raise _Opaque(f"{type(t).__name__} ({t.layout})")
    index = tensors.setdefault(id(t), len(tensors))
    return (type(t), tuple(t.shape), t.stride(), t.storage_offset(), t.dtype, t.device, t.layout, t.requires_grad,
            t._is_view(), index)


def _value(v, tensors: dict | None = None, depth: int = 0):
    """A hashable description of an attribute or input: tensors only among the inputs (``tensors`` given)."""
    if depth > 8:
        raise _Opaque("nested too deep")
    if v is None or isinstance(v, _PLAIN):
        return type(v), v
    if isinstance(v, float):
        return float, repr(v)  # (nan equal to nan)
    if isinstance(v, torch.Tensor):
        if tensors is None:
            raise _Opaque("a tensor attribute that is no parameter or buffer")
        return _tensor(v, tensors)
    if isinstance(v, (tuple, list)):
        return type(v), tuple(_value(x, tensors, depth + 1) for x in v)
    if type(v) in (dict, set, frozenset) or (isinstance(v, dict) and not v):  # (an empty hook dict)
        items = v.items() if isinstance(v, dict) else ((x, None) for x in sorted(v, key=repr))
        return type(v), tuple((_value(k, None, depth + 1), _value(x, tensors, depth + 1)) for k, x in items)
    return object, id(v)  # (held by the module, so alive: no other object has its id meanwhile)


def renamed(report, first: nn.Module, first_path: str, module: nn.Module, path: str):
    """``report`` of the block ``first`` at ``first_path``, for the block ``module`` of its key at ``path``: layer
    paths moved, expert weights the module's own of the same names, proved as the first block's layers."""
    names = {id(t): n for n, t in itertools.chain(first.named_parameters(remove_duplicate=False),
                                                   first.named_buffers(remove_duplicate=False))}
    own = dict(itertools.chain(module.named_parameters(remove_duplicate=False),
                               module.named_buffers(remove_duplicate=False)))

    def move(p: str) -> str:
        if p != first_path and not p.startswith(first_path + "."):
            raise _Opaque(f"{p} outside {first_path}")
        return path + p[len(first_path):]

    def weight(w):
        if w is None:
            return None
        if id(w) not in names:
            raise _Opaque("an expert weight the block does not hold")
        return own[names[id(w)]]

    layers = []
    for rec in report.layers:
        spec = rec.spec.replace(path=move(rec.spec.path), shared_experts=tuple(map(move, rec.spec.shared_experts)))
        weights = {role: [weight(x) for x in w] if isinstance(w, list) else weight(w)
                   for role, w in rec.expert_weights.items()}
        layers.append(dataclasses.replace(rec, path=move(rec.path), spec=spec, expert_weights=weights,
                                          forms=dict(rec.forms), lowering_notes=list(rec.lowering_notes),
                                          proved_as=rec.proved_as or rec.path))
    return dataclasses.replace(report, layers=layers, graphs=[], num_graphs=0, counters={"blocks.twins": 1},
                               config_mismatches=[], loops={})
