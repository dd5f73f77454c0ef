"""The levels of an expert-parallel device mesh, and the collectives of dedup at each (pure: no process group).

A mesh of more than one dimension names its levels outermost first, each one of ``LEVELS`` in that order, the
innermost ``"local"`` (the ranks of one node, or of the finest group a fast link joins): ``("node", "local")``
is 2 nodes x 2 GPUs; ``("rack", "node", "local")`` adds racks. Ranks are numbered row-major (``init_device_mesh``).

Dedup at a level L (any but the innermost) sends a token into each group of level L at most once (HierMoE's
HierD-AlltoAll, X-MoE's RBD): the mesh splits after L into an outer part (the dimensions up to L) and an inner
part (the ones after). Two collectives run it:

    cross  the ranks of equal inner coordinates, one per outer group: the token's rows go to the rank of the
           token's own inner coordinates in each group of level L its experts are in
    inner  the ranks of one group of level L: that relay copies each row to its experts' ranks

A collective's *kind* (the link model's key, ``cost_model.LinkModel``) names the dimensions its ranks differ
in, joined by ``+``; ``"flat"`` is every rank. On ``("rack", "node", "local")``: dedup at "rack" runs over
``rack`` and ``node+local``, at "node" over ``rack+node`` and ``local``; on ``("node", "local")``: ``node`` and
``local``. The link between two ranks (where ``stats.py`` counts bytes) is the outermost level they differ in.
"""

from __future__ import annotations

import math

LEVELS = ("pod", "rack", "node", "local")  # outermost first


def check_names(names) -> None:
    """A mesh of 2 dimensions or more: its names must be levels of ``LEVELS``, in order, the last ``"local"``."""
    names = tuple(names or ())
    if len(names) < 2:
        return  # a 1-D mesh may have any name: it has one level
    order = [LEVELS.index(n) for n in names if n in LEVELS]
    if len(order) < len(names) or order != sorted(set(order)) or names[-1] != "local":  # known, in order, once
        example = LEVELS[-len(names):] if len(names) <= len(LEVELS) else LEVELS
        raise ValueError(f"mesh dimension names {names} are not known: an expert-parallel mesh of {len(names)} "
                         f"dimensions names its levels outermost first from {LEVELS}, the last 'local' (the ranks "
                         f"of one node), e.g. init_device_mesh(device, shape, mesh_dim_names={example}); a 1-D mesh "
                         "may have any name")


def dedup_levels(names) -> tuple[str, ...]:
    """The levels a mesh can dedup at: every one but the innermost (none on a 1-D mesh)."""
    names = tuple(names or ())
    return names[:-1] if len(names) > 1 else ()


def split(names, level: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(outer dimensions, inner dimensions) of dedup at ``level``: the ones up to it, the ones after."""
    names = tuple(names)
    if level not in dedup_levels(names):
        raise ValueError(f"dedup={level!r} is not a level of the mesh {names} to dedup at: choose one of "
                         f"{list(dedup_levels(names)) or 'none (a 1-D mesh has one level)'}, or 'off'")
    i = names.index(level)
    return tuple(range(i + 1)), tuple(range(i + 1, len(names)))


def kind(names, dims) -> str:
    """The link-model kind of a collective whose ranks differ in ``dims`` (indices into ``names``)."""
    names = tuple(names)
    return "flat" if len(dims) == len(names) else "+".join(names[d] for d in dims)


def level_kinds(names, level: str) -> tuple[str, str]:
    """(cross kind, inner kind) of dedup at ``level``."""
    outer, inner = split(names, level)
    return kind(names, outer), kind(names, inner)


def kinds(names) -> list[str]:
    """Every collective kind the runtime may use on a mesh of these levels: ``flat``, then each level's two."""
    out = ["flat"]
    for level in dedup_levels(names):
        out += [k for k in level_kinds(names, level) if k not in out]
    return out


def inner_size(shape, names, level: str) -> int:
    """Ranks in one group of ``level`` (the relay of a row is ``dest // n * n + src % n`` for this ``n``)."""
    return math.prod(shape[d] for d in split(names, level)[1])


def partition(mesh_ranks, dims) -> list[list[int]]:
    """The groups of ranks that differ only in ``dims`` (each in increasing rank order), of a mesh given as its
    tensor of global ranks (``DeviceMesh.mesh``)."""
    others = [d for d in range(mesh_ranks.dim()) if d not in dims]
    size = math.prod(mesh_ranks.shape[d] for d in dims)
    return mesh_ranks.permute(*others, *dims).reshape(-1, size).tolist()


def link(coords_a, coords_b, names) -> str:
    """The link between two ranks of the mesh (their coordinates): ``self``, or the outermost level they differ in."""
    for name, a, b in zip(names, coords_a, coords_b):
        if a != b:
            return name
    return "self"
