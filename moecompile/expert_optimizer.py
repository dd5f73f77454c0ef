"""``moecompile.ExpertOptimizer(model, torch.optim.AdamW, lr=...)``: one optimizer for every parameter of a model
``moecompile.parallelize(..., replication=...)`` made. The parameters that are not replicated experts train with
``optimizer_class`` as usual, where they live; the replicated experts' fp32 master weights and optimizer state
are a fixed part of each expert on each rank's host (``runtime/expert_state.py``), stepped there by the same
class. Each ``step()``, per layer: the slot gradients are summed over each expert's instances (inside a rank,
then over its consecutive hosting ranks), each rank collects its part of every expert's gradient, steps it, and
sends the updated weights to the slots of the next placement (``"adaptive"``: the paper's Algorithm 1 on the
step's routing; ``"static"``: the same placement), which the next forward uses.
"""

from __future__ import annotations

import torch

from moecompile.runtime.ep_replicas import POPULARITY
from moecompile.runtime.expert_state import Groups, collect, distribute, reduce_instances
from moecompile.runtime.replication import schedule

from .mesh import _timeout


class ExpertOptimizer:
    def __init__(self, model, optimizer_class, **kwargs):
        info = getattr(model, "_moe_parallel", None)
        if info is None or not getattr(info, "replicas", None):
            raise ValueError("ExpertOptimizer trains the replicated experts of a model that moecompile.parallelize("
                             "model, mesh, ..., replication='adaptive', slots_per_rank=S) made; this model has "
                             "none: parallelize it so, or use a plain torch optimizer")
        if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)):
            raise ValueError(f"optimizer_class must be a torch.optim.Optimizer class (torch.optim.AdamW...); got "
                             f"{optimizer_class!r}")
        _check_steps_on_host(optimizer_class, kwargs)
        self.layers, self.group = info.replicas, info.group
        replicated = {id(p) for layer in self.layers for p in layer.slot_parameters()}
        dense = [p for p in model.parameters() if id(p) not in replicated and p.requires_grad]
        self.dense = optimizer_class(dense, **kwargs) if dense else None
        self.experts = optimizer_class([layer.part.master for layer in self.layers], **kwargs)
        self.groups = Groups(self.group, timeout=_timeout())
        self.steps = 0
        self.history: list[dict[str, list[int]]] = []  # per step: layer -> instances per expert it placed next

    def step(self) -> None:
        """Every rank calls it together, after backward."""
        for layer in self.layers:
            S = layer.slots_per_rank
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in layer.slot_parameters()]
            rows = torch.cat([g.reshape(S, -1) for g in grads], 1)
            reduced = reduce_instances(rows, layer.placement, self.groups)
            layer.part.master.grad = collect(reduced, layer.placement, layer.part, self.group)
        self.experts.step()
        placed = {}
        for layer in self.layers:
            world = self.groups.world
            nxt = layer.placement
            if layer.adaptive and layer.path in POPULARITY:
                nxt = schedule(POPULARITY[layer.path], world, layer.slots_per_rank)
            device = layer.slot_parameters()[0].device
            layer.write_slots(distribute(layer.part, nxt, self.group, device))
            layer.placement.copy_(nxt)
            placed[layer.path] = torch.bincount(nxt, minlength=layer.part.master.shape[0]).tolist()
        if self.dense is not None:
            self.dense.step()
        self.steps += 1
        self.history.append(placed)

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self.dense is not None:
            self.dense.zero_grad(set_to_none)
        self.experts.zero_grad(set_to_none)
        for layer in self.layers:
            for p in layer.slot_parameters():
                p.grad = None if set_to_none else (p.grad.zero_() if p.grad is not None else None)


def _check_steps_on_host(optimizer_class, kwargs) -> None:
    """ValueError unless ``optimizer_class(**kwargs)`` steps a host (CPU) tensor."""
    probe = torch.nn.Parameter(torch.zeros(2))
    probe.grad = torch.zeros(2)
    try:
        optimizer_class([probe], **kwargs).step()
    except Exception as exc:  # noqa: BLE001  (whatever stops it, said in the error)
        raise ValueError(f"{optimizer_class.__name__}({', '.join(f'{k}={v!r}' for k, v in kwargs.items())}) cannot "
                         f"step on the host, where ExpertOptimizer keeps the experts' state ({type(exc).__name__}: "
                         f"{exc}): choose one that runs on CPU tensors (torch.optim.AdamW, Adam, SGD; no "
                         "fused=True)") from exc
