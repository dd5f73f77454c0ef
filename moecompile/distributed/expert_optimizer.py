"""``moecompile.ExpertOptimizer(model, torch.optim.AdamW, lr=...)``: one optimizer for every parameter of a model
``moecompile.parallelize(..., replication=...)`` made. The parameters that are not replicated experts train with
``optimizer_class`` as usual, where they live; the replicated experts' fp32 master weights and optimizer state
are a fixed part of each expert on each rank's host (``runtime/placement/expert_state.py``), stepped there by the same
class. Each ``step()``, per layer: the slot gradients are summed over each expert's instances (inside a rank,
then over its consecutive hosting ranks), each rank collects its part of every expert's gradient, steps it, and
sends the updated weights to the slots of the next placement (``"adaptive"``: the paper's Algorithm 1 on the
step's routing; ``"static"``: the same placement), which the next forward uses. Beside copies (``"dp_replicate"``,
``"dp_shard"`` or both) each copy of the experts does so in its own group, placing by its own routing; the master
parts' gradients are summed over the copies (each slot's was divided by their number in backward), so every copy
steps the same master weights.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from moecompile.runtime.placement import expert_state
from moecompile.runtime.placement.replicas import DROPPED, POPULARITY, SLOT_ROWS, forget
from moecompile.runtime.placement.expert_state import collect, distribute, reduce_instances
from moecompile.runtime.placement.replication import schedule, uniform

from .grads import check_reduced
from .mesh import pipeline_group, shard_group
from .replicate import REPLICAS, from_slots


class ExpertOptimizer(torch.optim.Optimizer):
    """``place_every=N``: an adaptive layer re-places its experts every N steps only (1, the default: every step,
    the paper's scheme; 10, 50, 100: the coarser re-placing of FlexMoE-style systems, for comparison). Each
    step's history also says how many bytes a system that moves each expert's optimizer state with its
    instances would have moved for that re-placement (``coupled_state_bytes``: the slots whose expert changed x
    their master weights and optimizer state); this one moves none.

    A ``torch.optim.Optimizer`` to learning-rate schedulers: ``param_groups`` are the dense optimizer's groups
    and the experts' (the same dicts: a scheduler's lr reaches both). Clip gradients with ``clip_grad_norm_``
    (the norm of the whole model's gradient, as one process has it); ``torch.nn.utils.clip_grad_norm_`` over
    ``model.parameters()`` would see each rank's own instance gradients and clip each rank differently."""

    def __init__(self, model, optimizer_class, *, place_every: int = 1, **kwargs):
        from .sharded_state import parts_of  # (here: see check_not_moved's import below)

        listed = model if isinstance(model, (list, tuple)) else [model]
        infos = [getattr(m, "_moe_parallel", None) for m in listed]
        if not listed or any(info is None for info in infos) or not any(info.replicas for info in infos):
            raise ValueError("ExpertOptimizer trains the replicated experts of a model that moecompile.parallelize("
                             "model, mesh, ..., replication='adaptive', slots_per_rank=S) made (or of the stage "
                             "modules a rank runs, each parallelized so); this model has none: parallelize it so, "
                             "or use a plain torch optimizer")
        parts, infos = parts_of(model)  # (a compiled model's own module: it names the parameters; one mesh)
        paths = [layer.path for info in infos for layer in info.replicas]
        twice = sorted({p for p in paths if paths.count(p) > 1})
        if twice:
            raise ValueError(f"the stage modules hold replicated MoE layers of the same name {twice}: keep each "
                             "layer's name in the model (a ModuleDict of the stage's layers, as torchtitan cuts "
                             "stages), so that their routing and checkpoints stay apart")
        if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)):
            raise ValueError(f"optimizer_class must be a torch.optim.Optimizer class (torch.optim.AdamW...); got "
                             f"{optimizer_class!r}")
        if not isinstance(place_every, int) or place_every < 1:
            raise ValueError(f"place_every must be a whole number of steps >= 1; got {place_every!r}")
        self.place_every = place_every
        _check_steps_on_host(optimizer_class, kwargs)
        self._parts, self.layers, self.group = parts, [layer for info in infos for layer in info.replicas], \
            infos[0].group
        replicated = {id(p) for layer in self.layers for p in layer.slot_parameters()}
        # each part's dense optimizer (None where it trains no dense parameter)
        self.denses = [optimizer_class(dense, **kwargs) if dense else None for dense in
                       ([p for p in part.parameters() if id(p) not in replicated and p.requires_grad]
                        for part in parts)]
        self.experts = optimizer_class([layer.part.master for layer in self.layers], **kwargs)
        # the same parts in every copy of the experts ("dp_replicate", "dp_shard"), or None (every layer's: one mesh)
        self._copies = self.layers[0].hosts.copies
        self._stages = pipeline_group(infos[0].mesh)
        self._shard = shard_group(infos[0].mesh)  # ("dp_shard": the ranks splitting a copy of the other layers)
        self._syncs = [info.sync for info in infos]  # (check_reduced: no no_sync window left open at a step)
        self.defaults = dict(self.experts.defaults)
        self._local = []  # the sharded experts' weights held here (not replicated)
        for part, info in zip(parts, infos):
            sharded = {n for n, p in part.named_parameters() if getattr(p, "_moe_sharded", False)}
            sharded |= info.module_list_experts
            self._local += [p for n, p in part.named_parameters() if n in sharded and id(p) not in replicated]
        self._gathered: dict[str, dict] | None = None  # layer -> bytes, once the expert gradients are collected
        self.steps = 0
        self.history: list[dict[str, dict]] = []  # per step: layer -> what it routed, moved and placed (``step``)
        for layer in self.layers:  # (built on meta, initialized in place: the master weights from the slots)
            if layer.unset:
                from_slots(layer, self.group)
        for info in infos:
            info.expert_optimizer = self
        forget([layer.path for layer in self.layers])  # (counts another model with these layer names left)

    @property
    def dense(self):
        """The dense optimizer of the one model given (None where it trains no dense parameter); ``denses``: each
        part's, for a list of stage modules."""
        if len(self.denses) > 1:
            raise AttributeError("this ExpertOptimizer steps several stage modules: read .denses, one optimizer each")
        return self.denses[0]

    @property
    def param_groups(self) -> list[dict]:
        """The dense optimizers' parameter groups, then the experts' (the dicts they step with)."""
        return [g for d in self.denses if d is not None for g in d.param_groups] + self.experts.param_groups

    def step(self, closure=None):
        """Every rank calls it together, after backward (``closure``: as torch's optimizers take it, run first to
        compute the loss and gradients; its loss is returned). Appends to ``history``, per layer: ``instances`` (per
        expert, of the placement it made for the next step), ``popularity`` (rows routed to each expert, every
        rank's, in the forwards since the last ``step`` or ``zero_grad``: every micro-batch of an accumulated
        step), ``rows_per_slot`` (what each instance received), ``dropped`` (rows past a capacity) and ``bytes``:
        this rank's bytes per phase (``reduce``: its all-reduce inputs; ``collect``, ``distribute``: sent to
        other ranks; ``*.local``: the parts that stayed on the rank; ``distribute.copy``: the weights copied into
        the rank's further instances of an expert; ``copies``: the master gradient's all-reduce over copies of the
        experts; ``share``: under ``"dp_shard"``, the reduce-scatter and all-gather of the master part's shares)."""
        from .sharded_state import check_not_moved  # here: imported first, sharded_state meets its cycle via views

        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        check_reduced(self._syncs, "ExpertOptimizer.step")
        check_not_moved([(layer.module, REPLICAS, layer.placement) for layer in self.layers])
        moved = self._gather()
        self._gathered = None
        self.experts.step()
        placed = {}
        for layer in self.layers:
            before = dict(expert_state.BYTES)
            world = layer.hosts.groups.world
            nxt = layer.placement
            if layer.adaptive and layer.path in POPULARITY and (self.steps + 1) % self.place_every == 0:
                nxt = schedule(POPULARITY[layer.path], world, layer.slots_per_rank)
            coupled = int((nxt != layer.placement).sum()) * layer.part.numel * self._state_bytes(layer)
            device = layer.slot_parameters()[0].device
            layer.write_slots(distribute(layer.part, nxt, self.group, device))
            layer.placement.copy_(nxt)
            E = layer.part.master.shape[0]
            placed[layer.path] = {
                "instances": torch.bincount(nxt, minlength=E).tolist(),
                "popularity": POPULARITY.get(layer.path, torch.zeros(E, dtype=torch.long)).tolist(),
                "rows_per_slot": SLOT_ROWS.get(layer.path, torch.zeros(nxt.numel(), dtype=torch.long)).tolist(),
                "dropped": DROPPED.get(layer.path, 0), "bytes": {**moved[layer.path], **_delta(before)},
                "coupled_state_bytes": coupled}
        for dense in self.denses:
            if dense is not None:
                dense.step()
        self.steps += 1
        self.history.append(placed)
        forget(placed)
        return loss

    def _gather(self) -> dict[str, dict]:
        """Each layer's expert gradients summed over their instances and collected into the master parts (once
        per step: ``clip_grad_norm_`` may have done it); layer -> this rank's bytes of those phases."""
        if self._gathered is not None:
            return self._gathered
        moved = {}
        for layer in self.layers:
            before = dict(expert_state.BYTES)
            S = layer.slots_per_rank
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in layer.slot_parameters()]
            rows = layer.part.flatten([g.reshape(S, -1) for g in grads])
            reduced = reduce_instances(rows, layer.placement, layer.hosts.groups)
            # this rank's part ("dp_shard": its share, summed over the ranks splitting the part)
            layer.part.master.grad = layer.part.scatter(collect(reduced, layer.placement, layer.part, self.group))
            if layer.hosts.same is not None:  # every copy's (each divided by the copies in backward)
                dist.all_reduce(layer.part.master.grad, group=layer.hosts.same)
                expert_state.BYTES["copies"] += layer.part.master.grad.numel() * layer.part.master.grad.element_size()
            moved[layer.path] = _delta(before)
        self._gathered = moved
        return moved

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Scale every gradient the next ``step`` uses so that their total norm is at most ``max_norm``, as
        ``torch.nn.utils.clip_grad_norm_`` does on one process holding the whole model; returns the total norm
        (before clipping, the same on every rank). Call it after backward and before ``step``, every rank
        together: it sums the experts' gradients over their instances first (``step`` then does not again). The
        norm: the data-parallel parameters' gradients (the same on every rank) once, the expert shards held here
        (a layer's pieces split over ``"dp_shard"``: summed over the copies too) and this rank's part of every
        replicated expert's gradient summed over the ranks."""
        from .clip import clip_together, expert_grads

        check_reduced(self._syncs, "ExpertOptimizer.clip_grad_norm_")
        self._gather()
        local_ids = {id(p) for p in self._local}
        shared = [p.grad for d in self.denses if d is not None for g in d.param_groups for p in g["params"]
                  if p.grad is not None and id(p) not in local_ids]
        own, split = expert_grads(self._parts, self._local)
        own += [layer.part.master.grad for layer in self.layers if layer.hosts.split is None]
        split += [layer.part.master.grad for layer in self.layers if layer.hosts.split is not None]  # (shares)
        return clip_together(shared, own, self.group, max_norm, norm_type, stages=self._stages,
                             split=(split, self._shard))

    def _state_bytes(self, layer) -> int:
        """Bytes per expert parameter of its master weight and optimizer state (what a coupled design moves)."""
        master = layer.part.master
        state = self.experts.state.get(master, {})
        return master.element_size() + sum(v.element_size() for v in state.values()
                                           if isinstance(v, torch.Tensor) and v.shape == master.shape)

    def state_dict(self) -> dict:
        """For ``torch.distributed.checkpoint``: the dense optimizer's state by parameter name
        (``moecompile.get_optimizer_state_dict``), each replicated layer's master weights and their optimizer
        state, per weight a DTensor ``Shard(1)`` of its ``[E, R, ...]`` (each rank's rows), its current placement
        (a list: it is per slot; beside copies of the experts a list of every copy's, each copy placing its own), the
        experts' group hyperparameters (lr...) and the step count. An optimizer that has not stepped gives the
        state a zero step would make (so that a checkpoint loads into it) but keeps none itself: calling it before
        training (an initial checkpoint, accelerate's ``prepare``) leaves the first update as it was (a zero step
        would count in Adam's bias correction). Every rank calls it together."""
        from .sharded_state import get_optimizer_state_dict
        from .zero import state_made

        experts = {}
        with state_made(self.experts):
            for layer in self.layers:
                master = layer.part.master
                entry = {"master": self._global(layer, master.detach())}
                for key, value in self.experts.state[master].items():
                    part = isinstance(value, torch.Tensor) and value.shape == master.shape
                    entry[key] = self._global(layer, value) if part else value
                experts[layer.path] = entry
        placement = {layer.path: layer.placement.tolist() for layer in self.layers}
        if self._copies is not None:  # every copy's (a checkpoint keeps one value under the key)
            every = [None] * dist.get_world_size(self._copies)
            dist.all_gather_object(every, placement, group=self._copies)
            placement = {path: [theirs[path] for theirs in every] for path in placement}
        dense = [get_optimizer_state_dict(part, d) for part, d in zip(self._parts, self.denses)]  # (None: every
        # dense weight frozen; a list of stage modules: one entry each, by position, on every rank alike)
        return {"dense": dense[0] if len(dense) == 1 else {str(i): d for i, d in enumerate(dense)},
                "experts": experts, "placement": placement,
                "expert_groups": [{k: v for k, v in g.items() if k != "params"} for g in self.experts.param_groups],
                "steps": self.steps}

    def load_state_dict(self, state: dict) -> None:
        """Load what ``state_dict`` gave (through ``torch.distributed.checkpoint``): the master parts, their
        optimizer state and the placement, then this rank's slots from them, as the step that saved it left them:
        a resumed run continues bit for bit. Saved on another number of ranks or slots, the parts are cut anew
        (DCP reshards the DTensors) and the experts start evenly placed. A state saved before any step loads as one:
        the weights and placement, no optimizer state (what a zero step made for loading). The experts' state stays
        on the host whatever device the given tensors are on (accelerate's wrapper moves a state to the device and
        loads it back). Every rank calls it together."""
        from .sharded_state import set_optimizer_state_dict

        n = len(self._parts)
        denses = [state["dense"]] if n == 1 else [state["dense"][str(i)] for i in range(n)]
        for part, dense, entry in zip(self._parts, self.denses, denses):  # (every rank: they gather names)
            set_optimizer_state_dict(part, dense, entry)
        missing = [layer.path for layer in self.layers if layer.path not in state["experts"]]
        if missing:
            raise ValueError(f"the state holds no experts of {missing}: load a state saved from this model's "
                             "ExpertOptimizer")
        for layer in self.layers:
            entry, master = state["experts"][layer.path], layer.part.master

            def local(value):  # a per-weight dict (as _global made it): this rank's part; a scalar as it is
                if isinstance(value, dict):
                    return layer.part.part_of([value[a] for a in layer.attrs], layer.host_mesh).to(master.device)
                return value.to(master.device, copy=True) if isinstance(value, torch.Tensor) else value

            with torch.no_grad():
                master.copy_(local(entry["master"]))
            self.experts.state[master] = {k: local(v) for k, v in entry.items() if k != "master"}
            saved = state["placement"][layer.path]
            if saved and isinstance(saved[0], list):  # every copy's: this copy's, where as many copies saved it
                copies = dist.get_world_size(self._copies) if self._copies is not None else 1
                saved = saved[dist.get_rank(self._copies) if len(saved) == copies > 1 else 0]
            saved = torch.as_tensor(saved)
            if saved.numel() == layer.placement.numel():
                layer.placement.copy_(saved)
            else:  # saved with other slots: the experts start evenly placed here
                layer.placement.copy_(uniform(master.shape[0], layer.hosts.groups.world, layer.slots_per_rank))
            device = layer.slot_parameters()[0].device
            layer.write_slots(distribute(layer.part, layer.placement, self.group, device))
        for group, saved in zip(self.experts.param_groups, state.get("expert_groups", [])):
            group.update(saved)  # its hyperparameters as saved (a learning-rate schedule's lr)
        self.steps = int(state["steps"])
        if self.steps == 0:  # saved before any step: the state a zero step made for loading, not kept
            for opt in [self.experts, *(d for d in self.denses if d is not None)]:
                opt.state.clear()

    def _global(self, layer, part: torch.Tensor) -> dict:
        """This rank's ``[E, P_w]`` part (master weights or optimizer state) as one DTensor ``Shard(1)`` per
        weight, of its whole ``[E, R, ...]`` (R: its rows per expert), by the weight's name."""
        return dict(zip(layer.attrs, layer.part.dtensors(part, layer.host_mesh)))

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Also starts the routing counts anew: the next step places by the forwards after this call."""
        forget([layer.path for layer in self.layers])
        self._gathered = None
        for dense in self.denses:
            if dense is not None:
                dense.zero_grad(set_to_none)
        self.experts.zero_grad(set_to_none)
        for layer in self.layers:
            for p in layer.slot_parameters():
                p.grad = None if set_to_none else (p.grad.zero_() if p.grad is not None else None)


def _delta(before: dict) -> dict:
    return {k: v - before.get(k, 0) for k, v in expert_state.BYTES.items() if v != before.get(k, 0)}


def replication_report(model) -> str:
    """Per replicated layer: its placement mode and slots, and for the last step the popularity, instances per
    expert placed next, rows per instance, rows dropped and this rank's bytes of the gradient phases (reduce,
    collect) and the weight phase (distribute)."""
    info = getattr(model, "_moe_parallel", None)
    if info is None or not getattr(info, "replicas", None):
        return "no replicated experts (moecompile.parallelize(..., replication='adaptive', slots_per_rank=S))"
    opt = getattr(info, "expert_optimizer", None)
    last = opt.history[-1] if opt is not None and opt.history else {}
    lines = ["replicated experts (this rank's bytes; the last optimizer step):"]
    for layer in info.replicas:
        mode = "adaptive" if layer.adaptive else "static"
        now = torch.bincount(layer.placement, minlength=layer.part.master.shape[0]).tolist()
        line = f"  {layer.path}: {mode}, {layer.slots_per_rank} slots per rank, instances per expert {now}"
        step = last.get(layer.path)
        if step:
            rows = step["rows_per_slot"]
            line += (f"; routed per expert {step['popularity']}, rows per instance max {max(rows)} mean "
                     f"{sum(rows) / len(rows):.1f}, dropped {step['dropped']}; bytes "
                     + ", ".join(f"{k} {v}" for k, v in sorted(step["bytes"].items())))
        lines.append(line)
    return "\n".join(lines)


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
