"""Expected traffic of one MoE layer's exchanges under uniform routing, per link level: what the planner
(``moecompile/plan``) prices where no routing has been measured (the passes price a measured routing:
``cost_model.messages``, ``stream.predict``).

A group of ranks laid out over the levels (outermost first) is given by its size at each level (``counts``:
product = the group's size). A uniformly chosen member differs from a given rank first at level j with
probability ``(g_j - 1) * prod(g_i, i > j) / prod(g)`` (``level_fractions``); bytes for it cross level j's link.

    distinct_groups(E, K, R)   expected distinct groups among a token's K experts drawn without replacement from
                               E experts in R equal groups: R (1 - C(E - E/R, K) / C(E, K))
    duplication_rate(E, K, R)  1 - distinct / K: the fraction of a token's K rows that go to a group another of
                               its rows already goes to (hiermoe.md Table II's quantity)
    dispatch_bytes(...)        per phase of one dispatch, the bytes a rank sends over each level: plain (one row
                               per (token, expert)) or deduplicated at a level (one row per distinct (token, group
                               of that level) across it, then copies to the experts inside the group)
    domain_bytes(...)          expert domains (hybridep.md): the all-gather of the domain's experts, and the rows
                               for other domains' experts over the exchange group
"""

from __future__ import annotations

import math


def distinct_groups(num_experts: int, top_k: int, groups: int) -> float:
    if groups <= 1:
        return 1.0
    per = num_experts // groups
    miss = math.comb(num_experts - per, top_k) / math.comb(num_experts, top_k)
    return groups * (1.0 - miss)


def duplication_rate(num_experts: int, top_k: int, groups: int) -> float:
    return 1.0 - distinct_groups(num_experts, top_k, groups) / top_k


def level_fractions(counts) -> list[float]:
    """Per level, the fraction of a group's members (itself included in the denominator) first differing from a
    given rank there."""
    total = math.prod(counts)
    out = []
    for j, g in enumerate(counts):
        out.append((g - 1) * math.prod(counts[j + 1:]) / total)
    return out


def _spread(total: float, fractions: list[float], levels: range) -> list[float]:
    """``total`` bytes that leave a rank, split over ``levels`` in proportion to their fractions."""
    share = sum(fractions[j] for j in levels)
    return [total * fractions[j] / share if j in levels and share > 0 else 0.0 for j in range(len(fractions))]


def dispatch_bytes(rows: float, row_bytes: float, counts, num_experts: int, top_k: int,
                   dedup_level: int | None = None, meta_bytes: float = 12.0) -> list[list[float]]:
    """Phases of one dispatch (the combine sends the same back), each the bytes per level one rank sends.
    ``rows``: the rank's (token, expert) rows (tokens x K); ``counts``: the expert-parallel group per level;
    ``dedup_level``: the level index across which one row per distinct (token, group) goes (groups: the
    subgroups below that level), None for plain; ``meta_bytes``: an assignment's expert id and weight."""
    n = len(counts)
    fractions = level_fractions(counts)
    if dedup_level is None:
        return [[rows * row_bytes * f for f in fractions]]
    groups = math.prod(counts[:dedup_level + 1])
    tokens = rows / top_k
    pairs = tokens * distinct_groups(num_experts, top_k, groups) * (groups - 1) / groups  # remote (token, group)
    outer = range(0, dedup_level + 1)
    inner_counts = counts[dedup_level + 1:]
    inner = level_fractions(inner_counts)
    copies = [0.0] * (dedup_level + 1) + [rows * row_bytes * f for f in inner]
    cross = _spread(pairs * row_bytes + rows * (1 - 1 / groups) * meta_bytes, fractions, outer)
    return [cross, copies] if n > dedup_level + 1 else [cross]


def domain_bytes(rows: float, row_bytes: float, counts, domain_counts, expert_bytes: float
                 ) -> tuple[list[float], list[float]]:
    """(all-gather bytes per level a rank receives: its domain's other ranks' experts, ``expert_bytes`` each;
    rows bytes per level it sends: the rows for experts outside its domain, over the exchange group)."""
    D = math.prod(domain_counts)
    gather = [expert_bytes * D * f for f in level_fractions(domain_counts)]
    exchange = [g // d for g, d in zip(counts, domain_counts)]
    sent = [rows * row_bytes * f for f in level_fractions(exchange)]
    return gather, sent
