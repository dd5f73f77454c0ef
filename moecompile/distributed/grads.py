"""Data-parallel gradients of a model ``moecompile.parallelize`` sharded: what each rank's backward leaves in
``.grad`` so that every parameter holds the gradient of the mean loss over the data-parallel batches, as one
process training on all of them would.

    replicated parameters   each backward's incoming gradients are held back (the parameter accumulates zeros),
                            all-reduced together over the data-parallel group when backward ends, averaged, then
                            accumulated (gradient accumulation over several backwards stays right, as DDP's);
                            those FSDP2's ``fully_shard`` took over later are left to it (no second reduction)
    sharded experts         summed over every rank that routed rows to them already (the exchange's backward):
                            divided by the number of ranks whose rows repeat the same batch's tokens' share

Experts held by several ranks (a mesh's ``"dp_replicate"`` dimension: each expert-parallel group holds every
expert) are held back the same way and summed over those ranks, then divided by the copies times their divisor.
Under ``"dp_shard"`` each rank holds a piece of its copy's weights, whose gradient the gather's backward already
summed over the copies (``copies.py``): divided only; with ``"dp_replicate"`` too (HSDP) the ranks holding the same
piece sum it (held back as above, over ``piece_group``), then divide.
Inside ``no_sync`` (gradient accumulation, as DDP's) the held-back gradients wait, summed, for the first backward
after it, which reduces them all at once.

A tensor-parallel weight (a DTensor: torch's ``parallelize_module``) is averaged by its local shard, over the
data-parallel group, whose ranks hold the same shard. On a mesh with a ``"tp"`` dimension the data-parallel group is
the ranks of the other dimensions: the ranks of one tp group see the same tokens, so their replicated gradients are
equal (a replicated tensor's gradient is whole on every tp rank, as tensor parallelism keeps it, and a
sequence-sharded MoE block gives whole gradients back too: ``runtime/comm/tp.py``), and averaging over dp alone is
the mean. Expert divisors: the dp size where each token reaches its experts once over the tp group
(``moe_tp="ssmb"``), the mesh size where every tp rank routes all its tokens (``"off"``: each token's rows arrive tp
times).
"""

from __future__ import annotations

import contextlib
import warnings
import weakref

import torch
import torch.distributed as dist
from torch import nn

from .copies import cut_of


class GradientSync:
    """The gradient hooks of a model ``parallelize`` sharded. ``expert_divisors`` maps the name of each sharded
    expert parameter held here to what its gradient is divided by; every other parameter that takes a gradient is
    averaged over ``group`` (``size`` ranks; None or 1: nothing to average). ``copies`` > 1: each expert is held by
    that many ranks (``expert_group``, a mesh's ``"dp_replicate"``): its gradient is averaged over them too (a
    replicated expert's slots' gradients are divided by ``copies`` here, and summed over the copies by
    ``ExpertOptimizer`` as its master parts' gradients: each copy places its experts in its slots its own way).
    ``piece_group``: under HSDP, the ranks holding the same pieces of split experts (``mesh.piece_copies_group``).

    ``refresh()`` hooks each parameter that takes a gradient and has no hook yet: one added or unfrozen since
    (peft's adapters, a resized embedding, experts trained after a frozen start), which would otherwise keep each
    rank's own gradient and part the replicas. The backend calls it at every compile (Dynamo compiles again when a
    parameter is added or its ``requires_grad`` changes); ``late`` names those it hooked after ``parallelize``.
    Parameters FSDP2's ``fully_shard`` holds are its to reduce."""

    def __init__(self, model: nn.Module, expert_divisors: dict[str, int], group, size: int, expert_group=None,
                 copies: int = 1, piece_group=None):
        self.model, self.expert_divisors, self.size, self.copies = model, expert_divisors, size, copies
        self.replicated = _HeldBack(model, group) if size > 1 else None
        self.experts = _HeldBack(model, expert_group) if copies > 1 else None  # divided after the sum over copies
        self.pieces = _HeldBack(model, piece_group) if piece_group is not None else None  # (HSDP)
        self.hooked: dict[int, weakref.ref] = {}
        self.late: list[str] = []
        self.start = {n for n, _ in model.named_parameters()}  # the names parallelize saw
        self.refresh()
        self.late.clear()  # (those of parallelize itself)

    def refresh(self) -> list[str]:
        """Hook the parameters that take a gradient and have none; returns their names."""
        held = _fsdp_held(self.model)
        added = []
        for n, p in self.model.named_parameters():
            ref = self.hooked.get(id(p))
            if not p.requires_grad or (ref is not None and ref() is p) or id(p) in held:
                continue
            self.hooked[id(p)] = weakref.ref(p)
            added.append(n)
            if n not in self.expert_divisors:
                if self.replicated is not None:
                    self.replicated.add(p, self.size)
                continue
            divisor, piece = self.copies * self.expert_divisors[n], _split(self.model, n)
            if self.experts is not None and not getattr(p, "_moe_replicated", False) and not piece:
                self.experts.add(p, divisor)
            elif self.pieces is not None and piece:  # (HSDP: summed over the other dimension of copies)
                self.pieces.add(p, divisor)
            elif divisor > 1:  # (a replicated expert's slots: see above; a piece)
                p.register_hook(lambda grad, d=divisor: None if grad is None else grad / d)
        self.late += added
        return added

    def held_backs(self) -> list:
        """The ``_HeldBack`` of each kind of gradient this sync reduces when backward ends."""
        return [h for h in (self.replicated, self.experts, self.pieces) if h is not None]

    def added_to_experts(self, expert_names) -> list[str]:
        """Parameters added since ``parallelize`` inside a module holding expert weights (``expert_names``: the
        sharded experts' weight names, every rank's): peft's adapters on the experts, say, which cannot run where
        each rank holds some experts only."""
        owners = tuple(name.rpartition(".")[0] + "." for name in {*self.expert_divisors, *expert_names})
        return [n for n, _ in self.model.named_parameters() if n not in self.start and n.startswith(owners)]

    def __str__(self) -> str:
        names = ", ".join(self.late[:3]) + (", ..." if len(self.late) > 3 else "")
        return (f"{len(self.late)} parameter(s) taking a gradient since parallelize (added or unfrozen: {names}): "
                "averaged too")


class _HeldBack:
    """Each backward's incoming gradients of the parameters ``add``ed held back (the parameter accumulates zeros),
    summed over ``group`` in one all-reduce when backward ends, divided by the parameter's divisor, then accumulated.
    A parameter to which no rank's backward sent a gradient (a routing bias that only chooses experts: its hook gets
    None) keeps its ``.grad`` as it was, as in one process: the all-reduce carries, beside the gradients, how many
    ranks had one for each parameter (a rank without one sends zeros, so the ranks' reductions keep the same size),
    read back to the host once per backward. A parameter frozen since, or replaced (FSDP2's), is left out.

    A backward that raises after some gradients were held (an out-of-memory error caught, the batch retried
    smaller) never ends: the callback it queued is released with it. The next backward sees that (a weak reference
    to the callback), drops what the failed one held, as ``zero_grad()`` drops a failed backward's partial ``.grad``
    in one process, and warns; before, its reduction stayed queued on the dead backward and no later one reduced."""

    def __init__(self, model: nn.Module, group):
        self.model, self.group = model, group
        self.params: list[nn.Parameter] = []
        self.divisor: dict[int, int] = {}
        self.pending: dict[int, torch.Tensor] = {}  # the running backward's gradients
        self.held: dict[int, torch.Tensor] = {}  # those of backwards inside no_sync, summed, for the next that syncs
        self.sync = True  # False inside moecompile.no_sync: backward holds its gradients for the next that syncs
        self.ending = None  # a weak reference to the callback queued on the running backward (None: none queued)
        self.reductions = 0  # all-reduces made (one per backward, or per no_sync window)
        self.failed = 0  # backwards that raised after holding gradients (theirs dropped)

    def add(self, p: nn.Parameter, divisor: int) -> None:
        self.params.append(p)
        self.divisor[id(p)] = divisor
        p.register_hook(self._hold(p))

    def waiting(self) -> bool:
        """Whether gradients wait for a backward that reduces them (a no_sync window's)."""
        self._drop_failed()
        return bool(self.held)

    def _drop_failed(self) -> None:
        if self.ending is None or self.ending() is not None:
            return  # no backward holds gradients, or it is running
        self.ending = None
        if self.pending:
            self.failed += 1
            warnings.warn("moecompile: a backward raised after holding gradients of replicated parameters for their "
                          "data-parallel all-reduce; they are dropped, as zero_grad() drops a failed backward's "
                          "partial .grad (the gradients held by moecompile.no_sync before it are kept)", stacklevel=3)
        self.pending.clear()

    def _end(self) -> None:
        self.ending = None
        for key, g in self.pending.items():
            self.held[key] = g if key not in self.held else self.held[key] + g
        self.pending.clear()
        if self.sync:
            self._reduce()

    def _reduce(self) -> None:
        live = {id(p) for p in self.model.parameters() if p.requires_grad}  # FSDP2 replaced those it manages
        mine = [p for p in self.params if id(p) in live]
        grads = [self.held.pop(id(p), None) for p in mine]
        self.held.clear()
        if not mine:
            return
        had = torch.tensor([g is not None for g in grads], dtype=mine[0].dtype, device=_local(mine[0]).device)
        flat = torch.cat([_local(g if g is not None else torch.zeros_like(p)).reshape(-1)
                          for g, p in zip(grads, mine)] + [had])
        dist.all_reduce(flat, group=self.group)
        self.reductions += 1
        offset, sent = 0, flat[-len(mine):].tolist()
        for p, ranks in zip(mine, sent):
            local = _local(p)
            g = _like(p, flat[offset:offset + local.numel()].view_as(local) / self.divisor[id(p)])
            offset += local.numel()
            if ranks:
                p.grad = g if p.grad is None else p.grad + g

    def _hold(self, p):
        def hook(grad):
            if grad is None:  # nothing flows to it in this backward
                return None
            if self.ending is None or self.ending() is None:  # this backward's first held gradient
                self._drop_failed()
                ending = _Ending(self)
                torch.autograd.Variable._execution_engine.queue_callback(ending)
                self.ending = weakref.ref(ending)
            self.pending[id(p)] = grad.detach().clone() if id(p) not in self.pending else self.pending[id(p)] + grad
            return torch.zeros_like(grad)
        return hook


class _Ending:
    """The callback a backward runs when it ends (an object: ``_HeldBack`` keeps a weak reference, which dies with
    a backward that raised)."""

    def __init__(self, held: _HeldBack):
        self.held = held

    def __call__(self) -> None:
        self.held._end()


@contextlib.contextmanager
def no_sync(model):
    """``with moecompile.no_sync(model): loss.backward()``: gradient accumulation without the data-parallel
    reductions, as ``DistributedDataParallel.no_sync``. ``model``: a model ``moecompile.parallelize`` sharded (or
    its ``torch.compile`` wrapper, or a list of a rank's pipeline stage modules). Inside, each backward holds its
    gradients of the replicated parameters (and of experts held by several ranks, ``"dp_replicate"``) on the rank,
    summed over the backwards, and FSDP2's ``fully_shard`` modules skip their reduce-scatter
    (``set_requires_gradient_sync(False)``); the first backward after it reduces all of them at once, so every
    parameter then holds what one process would after the same backwards. Until that backward the held gradients
    are not in ``.grad`` (the replicated parameters' read zero there): step the optimizer after it, on every rank.
    The experts' own gradients cross the ranks inside each backward (the exchange's), with or without it."""
    with holding(model):
        yield


@contextlib.contextmanager
def holding(model, stage: bool = False):
    """``no_sync``; with ``stage`` (``moecompile.PipelineStage``'s), FSDP2's modules left as they are (torch's
    schedule defers theirs itself) and a module ``parallelize`` did not shard left to run as it does."""
    syncs, wrapped = _syncs_and_fsdp(model, required=not stage)
    wrapped = wrapped if not stage else []
    held = [h for sync in syncs for h in sync.held_backs()]
    before = [h.sync for h in held]
    for h in held:
        h.sync = False
    for module in wrapped:
        module.set_requires_gradient_sync(False, recurse=False)
    try:
        yield
    finally:
        for h, was in zip(held, before):
            h.sync = was
        for module in wrapped:
            module.set_requires_gradient_sync(True, recurse=False)


def check_reduced(syncs, what: str) -> None:
    """Refuse ``what`` (clipping, a step) while a ``no_sync`` window's held gradients wait for the backward that
    reduces them: each rank would read its own sum, not the mean."""
    held = [h for sync in syncs if sync is not None for h in sync.held_backs()]
    if any(h.waiting() for h in held):
        raise ValueError(f"{what}: gradients held by moecompile.no_sync are not reduced yet (not in .grad): run the "
                         "backward that reduces them first, outside no_sync (the last micro-batch's), on every rank")


def gradient_syncs(modules) -> list[tuple]:
    """(ParallelInfo, GradientSync) of each of ``modules`` that ``moecompile.parallelize`` sharded."""
    infos = [getattr(m, "_moe_parallel", None) for m in modules]
    return [(info, info.sync) for info in infos if getattr(info, "sync", None) is not None]


def _syncs_and_fsdp(model, required: bool = True) -> tuple[list[GradientSync], list[nn.Module]]:
    """The GradientSync of every module ``parallelize`` sharded in ``model`` (a module or a list of them; none:
    ValueError if ``required``), and the modules FSDP2's ``fully_shard`` wrapped there."""
    from torch.distributed.fsdp import FSDPModule

    from .sharded_state import unwrapped  # (here: sharded_state meets its import cycle via views first)

    parts = [unwrapped(part) for part in (model if isinstance(model, (list, tuple)) else [model])]
    modules = [m for part in parts for m in part.modules()]
    syncs = [sync for _, sync in gradient_syncs(modules)]
    if not syncs and required:
        raise ValueError(f"moecompile.no_sync: no module of {', '.join(type(p).__name__ for p in parts)} was "
                         "sharded by moecompile.parallelize; for DistributedDataParallel use model.no_sync()")
    return syncs, [m for m in modules if isinstance(m, FSDPModule)]


def fsdp_wraps(model: nn.Module) -> bool:
    """Whether FSDP2's ``fully_shard`` wrapped ``model`` or a module in it."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return False
    return any(isinstance(m, FSDPModule) for m in model.modules())


def fsdp_param_dtypes(model: nn.Module) -> dict[str, torch.dtype]:
    """Layer path -> ``param_dtype`` of FSDP2's ``MixedPrecisionPolicy`` above the layer (``param_dtype_above``),
    for each layer of a model in ``model`` that ``parallelize`` sharded, where FSDP2 leaves its expert shards out
    (``views.leave_out_of_fsdp``). FSDP2 computes in that dtype with the weights it holds; the sharded experts
    compute in it too (``passes/distribute.py``), not in their float32."""
    out = {}
    for info, sync in gradient_syncs(model.modules()):
        if not info.fsdp_left_out:
            continue
        for rec in info.report.layers:
            parts = rec.path.split(".")
            dtype = param_dtype_above([sync.model.get_submodule(".".join(parts[:i])) for i in range(len(parts) + 1)])
            if dtype is not None:
                out[rec.path] = dtype
    return out


def param_dtype_above(modules) -> torch.dtype | None:
    """The ``param_dtype`` of FSDP2's ``MixedPrecisionPolicy`` on the innermost of ``modules`` (a module's
    ancestors, the root first; None for one gone) that ``fully_shard`` wrapped, or None."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return None
    for module in reversed(modules):
        if isinstance(module, FSDPModule):
            return getattr(getattr(module._get_fsdp_state(), "_mp_policy", None), "param_dtype", None)
    return None


def _fsdp_held(model: nn.Module) -> set[int]:
    """The parameters FSDP2's ``fully_shard`` holds in ``model`` (sharded, or unsharded mid-forward): those under a
    module it wrapped, but for the modules ``parallelize`` marked for it to leave out (expert shards)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return set()
    info = getattr(model, "_moe_parallel", None)
    left = {id(_submodule(model, path)) for path in getattr(info, "fsdp_left_out", [])}
    held: set[int] = set()

    def walk(module: nn.Module, under: bool) -> None:
        if id(module) in left:
            return
        under = under or isinstance(module, FSDPModule)
        if under:
            held.update(id(p) for p in module.parameters(recurse=False))
        for child in module.children():
            walk(child, under)

    walk(model, False)
    return held


def _split(model: nn.Module, name: str) -> bool:
    """Whether expert weight ``name`` is this rank's piece of its copy's (``copies.py``): its gradient is already
    summed over the copies (the gather's backward reduce-scatters it), to be divided only."""
    module_name, _, attr = name.rpartition(".")
    return cut_of(model.get_submodule(module_name), attr) is not None


def _submodule(model: nn.Module, path: str) -> nn.Module | None:
    try:
        return model.get_submodule(path)
    except AttributeError:
        return None


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor (a tensor-parallel weight or its gradient); a plain tensor as it is."""
    return t.to_local() if hasattr(t, "to_local") else t


def _like(p: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """``local`` as a gradient of ``p``: a DTensor with ``p``'s mesh and placements where ``p`` is one."""
    if not hasattr(p, "to_local"):
        return local
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(local, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())
