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
whole world, in rank order (a mesh of some ranks only, expert parallelism inside a larger data-parallel world,
is refused: not built yet). A dimension named ``"tp"`` (tensor parallelism: ``tp_groups``) may sit among the levels.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from moecompile.runtime.comm import levels
from moecompile.runtime.comm.stats import COMM

# (mesh shape, the dimensions that vary) -> (the world it was made in, this rank's group)
_GROUPS: dict[tuple, tuple] = {}


TP = "tp"  # the mesh dimension of tensor parallelism: its ranks' MoE-block inputs are identical


def setup_mesh(mesh):
    """Check ``mesh`` and return its process group, with its levels known to the runtime."""
    group = _check_mesh(mesh)
    if mesh.ndim > 1:
        _set_layout(mesh, group)
    else:  # one level: every other rank is a "peer" (a mesh of levels set up before no longer names the links)
        COMM.set_levels({}, ())
    return group


def tp_dim(mesh) -> int | None:
    """The index of the mesh's ``"tp"`` dimension, or None."""
    names = tuple(mesh.mesh_dim_names or ())
    return names.index(TP) if TP in names else None


def tp_groups(mesh):
    """(this rank's tensor-parallel group: the ranks differing only in ``"tp"``; its data-parallel group: the ranks
    differing in the other dimensions, this rank alone on a mesh of ``"tp"`` only)."""
    d = tp_dim(mesh)
    return _group(mesh, (d,)), _group(mesh, tuple(i for i in range(mesh.ndim) if i != d))


def level_names(mesh) -> tuple[str, ...]:
    """The mesh's level names, outermost first (a 1-D mesh's, named or not: one level)."""
    return tuple(mesh.mesh_dim_names) if mesh.ndim > 1 else (mesh.mesh_dim_names or ("ep",))[:1]


def _check_mesh(mesh):
    from torch.distributed.device_mesh import DeviceMesh

    if not isinstance(mesh, DeviceMesh):
        raise ValueError(f"mesh must be a torch.distributed DeviceMesh (init_device_mesh), got {type(mesh).__name__}")
    levels.check_names(tuple(n for n in mesh.mesh_dim_names or () if n != TP))  # "tp" may sit anywhere
    ranks = mesh.mesh.flatten().tolist()
    if ranks != list(range(dist.get_world_size())):
        raise ValueError(f"the mesh's ranks {ranks} are not every rank of the default process group, in order "
                         f"(world size {dist.get_world_size()}): expert parallelism runs over the whole world; build "
                         "the mesh with init_device_mesh(device, shape) whose sizes multiply to the world size")
    return dist.group.WORLD


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
    names = level_names(mesh)
    return {level: tuple((levels.kind(names, dims), _group(mesh, dims))
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

    coords = {int(r): tuple(int(c) for c in torch.nonzero(mesh.mesh == r)[0]) for r in mesh.mesh.flatten()}
    COMM.set_levels(coords, level_names(mesh))
    register_group_kind(group.group_name, "flat")
    for level, ((cross_kind, cross_g), (inner_kind, inner_g)) in _dedup_groups(mesh).items():
        register_layout(group.group_name, level, cross_g.group_name, inner_g.group_name)
        register_group_kind(cross_g.group_name, cross_kind)
        register_group_kind(inner_g.group_name, inner_kind)
