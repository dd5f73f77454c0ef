"""The device mesh of expert parallelism: its check, and the process groups the runtime exchanges rows over.

``setup_mesh(mesh)`` returns the group of the whole mesh and, on a mesh of several levels (``("node",
"local")``, ``("rack", "node", "local")``...: ``runtime/comm/levels.py``), sets up the two collectives of dedup
at each level (the ranks of equal inner coordinates, one per group of the level; the ranks of one group of the
level), registers them with the runtime (``comm.dedup.register_layout``), tells the link emulation each group's
kind, and tells the byte counter each rank's coordinates.

The groups are made here with ``new_subgroups_by_enumeration`` and the timeout of the default process group, not
taken from the ``DeviceMesh``: the mesh's own sub-groups get torch's default timeout (30 minutes under gloo), so a
rank that died would leave the others waiting that long in an exchange inside a node. Each is made once per mesh
(every rank makes the same ones, in the same order, as ``new_group`` requires) and reused. The mesh must span the
whole world, in rank order (a mesh of some ranks only is refused). A dimension named ``"tp"`` (tensor parallelism:
``tp_groups``) may sit among the levels. An outermost dimension named ``"dp_replicate"`` holds ranks that keep the
same experts (expert data parallelism, as Megatron's and torchtitan's expert-parallel degree below the world
size): the experts are sharded over the other dimensions (the expert-parallel group, ``setup_mesh``'s group: one
per index of ``"dp_replicate"``), each rank exchanges rows only inside its group, and the experts' gradients are
averaged over ``"dp_replicate"`` (``replicate_group``); named ``"dp_shard"`` instead, the copies' ranks each hold a
piece of its copy's expert weights (``copies.py``); both, ``"dp_shard"`` right after ``"dp_replicate"`` (HSDP), the
weights are split over ``"dp_shard"`` and each piece kept whole over ``"dp_replicate"``. An outermost dimension
named ``"pp"`` holds pipeline stages: each index holds another part of the model (its stage module), whose experts
are sharded over the other dimensions (``setup_mesh``'s group again, the stage's ranks); nothing is reduced or
checked across stages but the gradient norm of ``clip_grad_norm_`` (``pipeline_group``), and the state_dict's
DTensors live on the stage's sub-mesh (``state_mesh``); a ``"tp"`` dimension's data-parallel group is then the
stage's ranks of one tp index, and a ``"dp_replicate"`` right after ``"pp"`` holds copies of each stage's experts.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from moecompile.runtime.comm import levels
from moecompile.runtime.comm.stats import COMM

# (mesh shape, the dimensions that vary) -> (the world it was made in, this rank's group)
_GROUPS: dict[tuple, tuple] = {}


TP = "tp"  # the mesh dimension of tensor parallelism: its ranks' MoE-block inputs are identical
REPLICATE = "dp_replicate"  # the outermost mesh dimension whose ranks hold the same experts
SHARD = "dp_shard"  # as REPLICATE, each of its ranks holding a part of each weight (FSDP over the copies)
COPIES = (REPLICATE, SHARD)
STAGES = "pp"  # the outermost mesh dimension whose ranks hold different parts of the model (pipeline stages)


def setup_mesh(mesh):
    """Check ``mesh`` and return this rank's expert-parallel process group (the whole mesh, or its ranks of this
    rank's ``"dp_replicate"`` index or ``"pp"`` stage), with its levels known to the runtime."""
    group = _check_mesh(mesh)
    pipeline_group(mesh)  # made now, every rank together: later, a stage that raised since would not make it
    if len(level_names(mesh)) > 1:
        _set_layout(mesh, group)
    else:  # one level: every other rank is a "peer" (a mesh of levels set up before no longer names the links)
        COMM.set_levels({}, ())
    return group


def device_of(mesh) -> torch.device:
    """The device the ranks of ``mesh`` compute on: the current CUDA device for a CUDA mesh."""
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)


def tp_dim(mesh) -> int | None:
    """The index of the mesh's ``"tp"`` dimension, or None."""
    names = tuple(mesh.mesh_dim_names or ())
    return names.index(TP) if TP in names else None


def tp_groups(mesh):
    """(this rank's tensor-parallel group: the ranks differing only in ``"tp"``; its data-parallel group: the ranks
    differing in the other dimensions but ``"pp"`` (a pipeline stage's), this rank alone on a mesh of ``"tp"``
    only; the data-parallel ranks of its copy of the experts, over which TED shards them: the same group without
    ``"dp_replicate"``, else its ranks differing neither in ``"pp"`` nor in ``"dp_replicate"``)."""
    d, first = tp_dim(mesh), int(_staged(mesh))
    dp = tuple(i for i in range(first, mesh.ndim) if i != d)
    copy = tuple(i for i in range(_offset(mesh), mesh.ndim) if i != d)
    dp_group = _group(mesh, dp)
    return _group(mesh, (d,)), dp_group, _group(mesh, copy) if copy != dp else dp_group


def _copy_dims(mesh) -> tuple[int, ...]:
    """The indices of the mesh's dimensions of expert copies (``"dp_replicate"``, ``"dp_shard"`` or both)."""
    outers = _outers(mesh)
    return tuple(i for i, name in enumerate(outers) if name in COPIES)


def expert_copies(mesh) -> int:
    """How many copies of each expert (the size of the mesh's ``"dp_replicate"`` and ``"dp_shard"`` dimensions
    together; 1 without them)."""
    return math.prod(mesh.shape[d] for d in _copy_dims(mesh))


def copies_split(mesh) -> bool:
    """Whether the copies of each expert split its weights over their ranks (a ``"dp_shard"`` dimension)."""
    return SHARD in _outers(mesh)


def shard_group(mesh):
    """With ``"dp_shard"``: this rank's group of the ranks that split one copy of its experts (differing only in
    ``"dp_shard"``), else None."""
    return _group(mesh, (_outers(mesh).index(SHARD),)) if copies_split(mesh) else None


def piece_copies_group(mesh):
    """With both ``"dp_replicate"`` and ``"dp_shard"`` (HSDP): this rank's group of the ranks holding the same
    pieces of the experts (differing only in ``"dp_replicate"``), over which their gradients are summed; else
    None."""
    outers = _outers(mesh)
    return _group(mesh, (outers.index(REPLICATE),)) if SHARD in outers and REPLICATE in outers else None


def stage_group(mesh):
    """The ranks holding the same part of the model, which average its dense gradients and are checked to hold the
    same weights: every rank (None), or with ``"pp"`` this rank's stage's (its expert-parallel group, and its
    copies where ``"dp_replicate"`` follows)."""
    return _group(mesh, tuple(range(1, mesh.ndim))) if _staged(mesh) else None


def pipeline_group(mesh):
    """With ``"pp"``: this rank's group of one rank per stage (its place in each), else None."""
    return _group(mesh, (0,)) if _staged(mesh) else None


def state_mesh(mesh):
    """The mesh a sharded expert weight's DTensor lives on: ``mesh``, or with ``"pp"`` this rank's stage's sub-mesh
    (each stage holds other weights; the sub-meshes were made with ``mesh``)."""
    return mesh[tuple(mesh.mesh_dim_names[1:])] if _staged(mesh) else mesh


def describe(mesh, world: int, copies: int, replicating: bool = False) -> str:
    """The first line of ``ParallelInfo``'s report (``replicating``: some layer's experts replicate, whole on each
    copy)."""
    where = f", the ranks of index {mesh.get_local_rank(STAGES)} of {STAGES!r} (a pipeline stage's)" if _staged(
        mesh) else ""
    split = f"{SHARD!r}: its weights split over them, gathered where the layer runs, its gradient reduce-scattered"
    how = split if copies_split(mesh) else f"{REPLICATE!r}: its gradient averaged over them"
    if copies_split(mesh) and REPLICATE in _outers(mesh):  # (HSDP)
        parts = mesh.shape[_outers(mesh).index(SHARD)]
        how = (f"{REPLICATE!r} x {SHARD!r}: its weights split over the {parts} of {SHARD!r}, gathered where the layer "
               f"runs, its gradient reduce-scattered over them and averaged over {REPLICATE!r}")
    how += "; a replicating layer's slots whole on each" if replicating and copies_split(mesh) else ""
    return f"expert parallelism over {world} rank(s){where}" + (
        f", each expert on {copies} ranks ({how})" if copies > 1 else "") + ":"


def replicate_group(mesh):
    """This rank's group of the ranks holding the same experts (differing only in ``"dp_replicate"`` and
    ``"dp_shard"``), or None."""
    dims = _copy_dims(mesh)
    return _group(mesh, dims) if dims else None


def replicate_groups(mesh) -> list[list[int]]:
    """Every group of ranks holding the same experts (differing only in ``"dp_replicate"`` and ``"dp_shard"``;
    global ranks, in order), or [] without them."""
    dims = _copy_dims(mesh)
    return levels.partition(mesh.mesh, dims) if dims else []


def ep_groups(mesh) -> list[list[int]]:
    """Every expert-parallel group of ``mesh`` (its global ranks, in order): one per index of the outer dimensions
    (a pipeline stage's ranks, or one copy of the experts), or the whole mesh's ranks. Groups that every rank makes
    together (``new_group``) are made for each of them, in this order."""
    return levels.partition(mesh.mesh, tuple(range(_offset(mesh), mesh.ndim)))


def ep_shape(mesh) -> tuple[int, ...]:
    """The expert-parallel group's shape: the mesh's, ``"dp_replicate"`` left out."""
    return tuple(mesh.shape)[_offset(mesh):]


def _outers(mesh) -> tuple[str, ...]:
    """The mesh's outer dimensions: ``("pp", "dp_replicate")``, ``("pp",)``, ``("dp_replicate",)`` or ``()``
    (the names its first dimensions have, in that order; ``"dp_shard"`` where ``"dp_replicate"`` would be, or
    right after it: HSDP)."""
    names = tuple(mesh.mesh_dim_names or ())
    for outers in ((STAGES, REPLICATE, SHARD), (STAGES, REPLICATE), (STAGES, SHARD), (STAGES,), (REPLICATE, SHARD),
                   (REPLICATE,), (SHARD,)):
        if names[:len(outers)] == outers:
            return outers
    return ()


def _staged(mesh) -> bool:
    """Whether the mesh's first dimension is ``"pp"`` (pipeline stages)."""
    return _outers(mesh)[:1] == (STAGES,)


def _offset(mesh) -> int:
    """How many outer dimensions (``"pp"``, ``"dp_replicate"``) the mesh has: the expert-parallel levels start
    after them."""
    return len(_outers(mesh))


def level_names(mesh) -> tuple[str, ...]:
    """The expert-parallel levels' names, outermost first (``"dp_replicate"`` left out; a single level's, named
    or not: one level)."""
    names = tuple(mesh.mesh_dim_names or ())[_offset(mesh):]
    return names if len(names) > 1 else (names or ("ep",))[:1]


def _check_mesh(mesh):
    from torch.distributed.device_mesh import DeviceMesh

    if not isinstance(mesh, DeviceMesh):
        raise ValueError(f"mesh must be a torch.distributed DeviceMesh (init_device_mesh), got {type(mesh).__name__}")
    names = tuple(mesh.mesh_dim_names or ())
    offset = _offset(mesh)
    for outer, size in ((REPLICATE, "copies"), (SHARD, "copies"), (STAGES, "stages")):
        if outer in names[offset:]:
            after = f", or right after {STAGES!r}" if outer in COPIES else ""
            after += f"; {SHARD!r} right after {REPLICATE!r} where both are" if outer in COPIES else ""
            raise ValueError(f"mesh dimension {outer!r} must come first (outermost{after}: the expert-parallel "
                             f"groups are consecutive ranks); got {names}: e.g. init_device_mesh(device, ({size}, "
                             f"nodes, gpus_per_node), mesh_dim_names=({outer!r}, 'node', 'local'))")
    if offset and mesh.ndim == offset:
        raise ValueError(f"a mesh of {' and '.join(map(repr, names))} alone shards no expert: add the expert-parallel "
                         f"dimensions after it, e.g. mesh_dim_names=({', '.join(map(repr, names))}, 'ep')")
    levels.check_names(tuple(n for n in names[offset:] if n != TP))  # "tp" may sit anywhere
    ranks = mesh.mesh.flatten().tolist()
    if ranks != list(range(dist.get_world_size())):
        raise ValueError(f"the mesh's ranks {ranks} are not every rank of the default process group, in order "
                         f"(world size {dist.get_world_size()}): expert parallelism runs over the whole world; build "
                         "the mesh with init_device_mesh(device, shape) whose sizes multiply to the world size (a "
                         f"smaller expert-parallel group: an outermost {REPLICATE!r} dimension; a pipeline stage's "
                         f"ranks: pass the whole mesh, its outermost dimension named {STAGES!r})")
    return ep_group(mesh)


def ep_group(mesh):
    """This rank's expert-parallel group: the world, or its ranks of its ``"pp"`` stage or ``"dp_replicate"`` index
    (made with every rank's, on first use)."""
    offset = _offset(mesh)
    return _group(mesh, tuple(range(offset, mesh.ndim))) if offset else dist.group.WORLD


def _timeout():
    """The default process group's timeout (what init_process_group was given), or None (torch's default)."""
    world = dist.group.WORLD
    for device in ("cpu", "cuda"):
        try:
            return world._get_backend(torch.device(device)).options._timeout
        except (AttributeError, RuntimeError):
            continue
    return None


def _group(mesh, dims: tuple[int, ...]):
    """This rank's group of the ranks of ``mesh`` that differ only in ``dims`` (made on first use: every rank
    makes all of them)."""
    key = (tuple(mesh.mesh.shape), dims)
    world = dist.group.WORLD
    if key not in _GROUPS or _GROUPS[key][0] is not world:  # none yet, or made in a process group since destroyed
        mine, _ = dist.new_subgroups_by_enumeration(levels.partition(mesh.mesh, dims), timeout=_timeout())
        _GROUPS[key] = (world, mine)
    return _GROUPS[key][1]


def _dedup_groups(mesh) -> dict[str, tuple[tuple[str, object], tuple[str, object]]]:
    """Per dedup level of ``mesh``: ((cross kind, this rank's cross group), (inner kind, its inner group))."""
    names, offset = level_names(mesh), _offset(mesh)
    return {level: tuple((levels.kind(names, dims), _group(mesh, tuple(d + offset for d in dims)))
                         for dims in levels.split(names, level))
            for level in levels.dedup_levels(names)}


def level_groups(mesh) -> dict[str, object]:
    """This rank's process group of each collective kind the runtime uses on ``mesh`` (``levels.kinds``):
    ``flat`` and each dedup level's two, the same groups the layers exchange over."""
    groups = {"flat": setup_mesh(mesh)}
    for pair in _dedup_groups(mesh).values():
        groups.update(pair)
    return groups


def _set_layout(mesh, group) -> None:
    """The coordinates of each rank (for the byte counts) and each level's two groups (for dedup there)."""
    from moecompile.runtime.comm.exchange import register_group_kind
    from moecompile.runtime.comm.dedup import register_layout

    offset = _offset(mesh)  # coordinates in the expert-parallel group
    coords = {int(r): tuple(int(c) for c in torch.nonzero(mesh.mesh == r)[0])[offset:] for r in mesh.mesh.flatten()}
    COMM.set_levels(coords, level_names(mesh))
    register_group_kind(group.group_name, "flat")
    for level, ((cross_kind, cross_g), (inner_kind, inner_g)) in _dedup_groups(mesh).items():
        register_layout(group.group_name, level, cross_g.group_name, inner_g.group_name)
        register_group_kind(cross_g.group_name, cross_kind)
        register_group_kind(inner_g.group_name, inner_kind)


def check_dedup(dedup, mesh) -> None:
    """ValueError unless ``dedup`` is "off", "auto" or a level of ``mesh`` it can dedup at."""
    named = levels.dedup_levels(level_names(mesh))
    if dedup in ("off", "auto", *named):
        return
    if not named:
        raise ValueError(f"dedup={dedup!r} needs a mesh of several levels, e.g. init_device_mesh(device, (nodes, "
                         f"gpus_per_node), mesh_dim_names=('node', 'local')); got a {mesh.ndim}-D mesh: build one, "
                         "or use dedup='off'")
    raise ValueError(f"dedup={dedup!r} is not available on the mesh {tuple(mesh.mesh_dim_names)}: choose one of "
                     f"{['off', *named, 'auto']}")
