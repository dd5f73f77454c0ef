"""Expert domains (HybridEP, hybridep.md §IV-A): which ranks all-gather experts and which all-to-all tokens, as
data (pure: no process group).

A multilevel description lists, outermost first, each level's scaling factor ``sizes[l]`` (workers of level l per
worker of the level above; ``sizes[0]``: the workers of the outermost level) and its expert domain size
``domain_sizes[l]`` (workers of level l that form one domain; it divides ``sizes[l]``). A rank's global index m
(row-major, as torch numbers a ``DeviceMesh``) renumbers into one location per level (Eq. 13):

    f(m) = (x_0, ..., x_{L-1}),   x_i = (m // prod_{j > i} sizes[j]) mod sizes[i]

and at level l its domain is x_l // domain_sizes[l], its offset in it x_l mod domain_sizes[l]. Algorithm 1: two
ranks talk at level l only where their locations differ at level l alone (the levels above and below equal: ranks
of different datacenters never meet at the GPU level); then they all-gather experts ("AG") when they share the
domain (at different offsets) and all-to-all tokens ("A2A") when their domains differ at the same offset; other
pairs do not talk. Domain size 1 everywhere is plain expert parallelism (every pair that talks, A2A); one domain
spanning a level gathers every expert over it (AG only).
"""

from __future__ import annotations

import functools
import math


def check(sizes, domain_sizes) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The description as tuples of ints, or ValueError naming what is wrong."""
    sizes, domain_sizes = tuple(sizes), tuple(domain_sizes)
    if not sizes or len(sizes) != len(domain_sizes):
        raise ValueError(f"expert domains need one domain size per level: got sizes {list(sizes)} and domain sizes "
                         f"{list(domain_sizes)}; give as many of each, outermost level first")
    for level, (n, s) in enumerate(zip(sizes, domain_sizes)):
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"level {level} has {n!r} workers: give each level's workers as a whole number >= 1")
        if not isinstance(s, int) or s < 1 or n % s:
            raise ValueError(f"level {level} has {n} workers and domain size {s!r}: a domain size is a whole number "
                             f"that divides its level's workers, one of {[d for d in range(1, n + 1) if n % d == 0]}")
    return sizes, domain_sizes


def locations(m: int, sizes) -> tuple[int, ...]:
    """Eq. 13: rank ``m``'s worker number at each level, outermost first."""
    return tuple((m // math.prod(sizes[i + 1:])) % n for i, n in enumerate(sizes))


def link(m: int, n: int, level: int, sizes, domain_sizes) -> str | None:
    """Algorithm 1 for ranks ``m`` and ``n`` at ``level``: "AG", "A2A" or None."""
    a, b = locations(m, sizes), locations(n, sizes)
    if a[level] == b[level] or a[:level] != b[:level] or a[level + 1:] != b[level + 1:]:
        return None
    s = domain_sizes[level]
    same_domain, same_offset = a[level] // s == b[level] // s, a[level] % s == b[level] % s
    if same_domain:
        return "AG"  # (different offsets: the locations differ)
    return "A2A" if same_offset else None


def hybrid_topology(sizes, domain_sizes) -> list[tuple[int, int, int, str]]:
    """Every ordered pair of ranks that talks, with its level and kind: ``(m, n, level, "AG" | "A2A")``, in order
    of m, then n. ``moecompile.hybrid_topology(sizes=[4, 4], domain_sizes=[2, 4])`` is Fig. 8(b): 4 datacenters
    of 4 GPUs, datacenters in domains of 2, each datacenter's GPUs one domain."""
    sizes, domain_sizes = check(sizes, domain_sizes)
    world = math.prod(sizes)
    out = []
    for m in range(world):
        for n in range(world):
            for level in range(len(sizes)):
                kind = link(m, n, level, sizes, domain_sizes) if m != n else None
                if kind is not None:
                    out.append((m, n, level, kind))
    return out


def groups(m: int, sizes, domain_sizes) -> tuple[list[int], list[int]]:
    """(the ranks whose experts rank ``m`` gathers: the same domain at every level, itself included; the ranks it
    exchanges tokens with: the same offset at every level, itself included), each in rank order. Chained over the
    levels, Algorithm 1's all-gathers reach the first set and its all-to-alls the second."""
    gather, exchange = _groups(m, *check(sizes, domain_sizes))
    return list(gather), list(exchange)


@functools.lru_cache(maxsize=4096)  # (the planner asks for the same meshes' groups thousands of times)
def _groups(m: int, sizes: tuple, domain_sizes: tuple) -> tuple[tuple[int, ...], tuple[int, ...]]:
    mine = locations(m, sizes)
    gather, exchange = [], []
    for n in range(math.prod(sizes)):
        loc = locations(n, sizes)
        if all(x // s == y // s for x, y, s in zip(loc, mine, domain_sizes)):
            gather.append(n)
        if all(x % s == y % s for x, y, s in zip(loc, mine, domain_sizes)):
            exchange.append(n)
    return tuple(gather), tuple(exchange)
