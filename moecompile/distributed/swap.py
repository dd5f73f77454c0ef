"""Expert swap during training (``moecompile.parallelize(..., swap_every=N)``; HierMoE's HierD-ES).

After every N-th ``step()`` of an optimizer that trains the model's sharded experts (a global optimizer step
post-hook: the training loop is unchanged), every rank gathers each swapping layer's routing of its last forward
(``placement.swap.RECENT``), and all choose the same swap (``placement.swap.choose_swap``, on the gathered
routing; beside ``"dp_replicate"``, every copy's routing together, each token from its rank's place in its group,
so that every copy makes the same swap and the copies' experts stay alike). A chosen swap exchanges the two
experts' slots and moves their rows of the weights, of the gradients if any, and of the optimizer's per-parameter
state (tensors shaped like the parameter: Adam's moments, SGD's momentum) to their new ranks: rows of a stacked or
flat shard, or, in a ModuleList layer, the weights of the list entry of the slot (each a parameter of its own, with
its own state). What was swapped is kept in ``model._moe_parallel.swap.history``.

Without a link model the choice weighs bytes only (alpha 0, beta 1 for every kind of collective).
"""

from __future__ import annotations

import contextlib
import weakref

import torch
import torch.distributed as dist

from moecompile.runtime.comm.cost_model import LinkModel
from moecompile.runtime.placement.swap import RECENT, choose_swap, move_rows
from moecompile.runtime.comm.levels import kinds

from .mesh import ep_shape, level_names, stage_group
from .sharded_state import SLOTS, check_not_moved

_ACTIVE: "weakref.WeakSet[ExpertSwap]" = weakref.WeakSet()
_HOOK = None
_PAUSED = False  # within paused(): optimizer steps are not counted (a step that only makes the state)


@contextlib.contextmanager
def paused():
    global _PAUSED
    before, _PAUSED = _PAUSED, True
    try:
        yield
    finally:
        _PAUSED = before


class ExpertSwap:
    def __init__(self, layers, every: int, gamma: float, link, mesh, group, model):
        # [(LayerRecord, [per weight: its shard, or a ModuleList's local experts' weights of one role], slots_E)]
        self.layers = layers
        self.mesh_shape, self.names = ep_shape(mesh), level_names(mesh)  # (a "pp" stage's ranks)
        bytes_only = LinkModel({kind: (0.0, 1.0) for kind in kinds(self.names)})
        self.every, self.gamma, self.link, self.group = every, gamma, link or bytes_only, group
        self.together = stage_group(mesh)  # the ranks choosing together: every copy of the group ("dp_replicate")
        self.steps = 0
        self.holders = [(m, SLOTS, m._buffers[SLOTS]) for m in model.modules()
                        if SLOTS in m._buffers]  # the slot tables the graph reads (check_not_moved)
        self.history: list[tuple[int, str, int, int, float, float]] = []  # (step, layer, a, b, before, after)
        self._params = {id(p) for _, weights, _ in layers for w in weights for p in _listed(w)}
        _ACTIVE.add(self)
        _install_hook()

    def after_step(self, optimizer) -> None:
        if _PAUSED:
            return
        if not any(id(p) in self._params for g in optimizer.param_groups for p in g["params"]):
            return
        self.steps += 1
        if self.steps % self.every == 0:
            self.swap(optimizer)

    def swap(self, optimizer=None) -> None:
        """Choose and apply one swap per layer (every rank calls it at the same point)."""
        check_not_moved(self.holders)
        mine = {rec.path: _on_host(RECENT.get(rec.path)) for rec, _, _ in self.layers}
        every = [None] * dist.get_world_size(self.together)
        dist.all_gather_object(every, mine, group=self.together)
        W = dist.get_world_size(self.group)
        for rec, params, slots in self.layers:
            ids = [r[rec.path] for r in every]
            if any(i is None for i in ids):
                continue  # not run since the last swap on some rank
            # each token from its rank's place in its group: every copy's routing weighed together, so that the
            # copies choose the same swap (their experts stay alike)
            source = torch.cat([torch.full((len(i),), r % W) for r, i in enumerate(ids)])
            e = rec.spec.experts
            best = choose_swap(torch.cat(ids), source, slots, self.mesh_shape, e.hidden,
                               _listed(params[0])[0].element_size(), self.link, rec.dedup or "off", self.gamma,
                               names=self.names)
            if best is None:
                continue
            a, b, before, after = best
            new = slots.clone()
            new[a], new[b] = slots[b], slots[a]
            live = e.num_experts // W if e.identity_experts else None  # (the spare gate_up rows stay: shardable.py)
            for p in params:
                _move_param(p, slots, new, self.group, optimizer, live)
            slots.copy_(new)
            self.history.append((self.steps, rec.path, a, b, before, after))
        for rec, _, _ in self.layers:
            RECENT.pop(rec.path, None)


def _on_host(ids):
    return None if ids is None else ids.cpu()


def _listed(weight) -> list:
    return weight if isinstance(weight, list) else [weight]


def _move_param(weight, old, new, group, optimizer, live: int | None = None) -> None:
    """Re-place a stacked or flat shard (``weight``, its rows; its first ``live`` rows where it holds more, the
    spare rows of a layer with identity experts), or a ModuleList layer's local experts' weights of one role (a
    list, stacked to move: entry i goes with slot i), with their gradients and optimizer state. Every rank holds
    gradients, and state of the same keys, alike (they all step together)."""
    params, one_list = _listed(weight), isinstance(weight, list)

    def move(tensors):
        rows = torch.stack(tensors) if one_list else tensors[0][:live]
        moved = move_rows(rows, old, new, group)
        for t, m in zip(tensors, moved.unbind(0) if one_list else [moved]):
            (t if one_list else t[:live]).copy_(m)

    with torch.no_grad():
        move([p.detach() for p in params])
        if all(p.grad is not None for p in params):
            move([p.grad for p in params])
        states = [optimizer.state.get(p, {}) if optimizer is not None else {} for p in params]
        for key, value in states[0].items():
            if isinstance(value, torch.Tensor) and value.shape == params[0].shape:
                move([state[key] for state in states])


def _install_hook() -> None:
    global _HOOK
    if _HOOK is None:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        def after_step(optimizer, args, kwargs):
            for swap in list(_ACTIVE):
                swap.after_step(optimizer)

        _HOOK = register_optimizer_step_post_hook(after_step)
