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
    expected_messages(...)     ``cost_model.messages``' all-to-alls, kind by kind, for uniform routing (or a
                               measured one's per-rank shares and per-group hits: ``moecompile/plan/routing.py``):
                               the planner prices them with the same link model the dedup choice uses
    domain_bytes(...)          expert domains (hybridep.md): the all-gather of the domain's experts, and the rows
                               for other domains' experts over the exchange group
"""

from __future__ import annotations

import math

from .levels import dedup_levels, inner_size, level_kinds


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


def offrank_shares(counts) -> list[float]:
    """Per level, the share of the bytes a rank sends to the group's other members that crosses that level's link
    (``level_fractions`` without the rank itself)."""
    total = math.prod(counts)
    return [f / (1 - 1 / total) for f in level_fractions(counts)]


def domain_bytes(rows: float, row_bytes: float, counts, domain_counts, expert_bytes: float
                 ) -> tuple[list[float], list[float]]:
    """(all-gather bytes per level a rank receives: its domain's other ranks' experts, ``expert_bytes`` each;
    rows bytes per level it sends: the rows for experts outside its domain, over the exchange group)."""
    D = math.prod(domain_counts)
    gather = [expert_bytes * D * f for f in level_fractions(domain_counts)]
    exchange = [g // d for g, d in zip(counts, domain_counts)]
    sent = [rows * row_bytes * f for f in level_fractions(exchange)]
    return gather, sent


def busiest_offrank(shares) -> float:
    """Of W ranks whose shares of the routed rows are ``shares``, the busiest one's rows sent to or received from
    the others, per routed row of one rank: rank d receives (W - 1) P_d and sends 1 - P_d (ranks start alike)."""
    W = len(shares)
    return max(max(1 - p, (W - 1) * p) for p in shares)


def expected_messages(tokens: float, top_k: int, num_experts: int, counts, names, row_bytes: float,
                      weight_bytes: float = 4, shares=None, hits=None) -> dict[str, list[tuple[str, float]]]:
    """``cost_model.messages`` for a routing known by its statistics: per dedup choice (``off`` and each level of
    ``names`` but the innermost), the (collective kind, busiest rank's bytes sent or received off-rank) of each
    all-to-all of one dispatch and combine, in the runtime's order. ``tokens``: a rank's tokens (every rank
    starts alike); ``counts``: the mesh's size per level, named ``names`` (outermost first). ``shares``: each
    rank's share of the routed rows (its E / W contiguous experts'), ``hits(G)``: per group of G contiguous
    ones, the fraction of tokens with a row there; uniform routing where not given (1 / W; the expected distinct
    groups / G). Rank d of W receives (W - 1) T K P_d rows and sends T K (1 - P_d): the busiest is the larger."""
    names, counts = tuple(names), tuple(counts)
    ranks = math.prod(counts)
    E, T, K = num_experts, tokens, top_k
    P = list(shares) if shares is not None else [1 / ranks] * ranks
    rows = T * K * busiest_offrank(P)
    plan = {"off": [("flat", (ranks - 1) * (E // ranks) * 8), ("flat", rows * row_bytes), ("flat", rows * row_bytes)]}
    for level in dedup_levels(names):
        cross, inner = level_kinds(names, level)
        n = inner_size(counts, names, level)
        G = ranks // n
        q = hits(G) if hits is not None else [distinct_groups(E, K, G) / G] * G
        P_g = [sum(P[g * n:(g + 1) * n]) for g in range(G)]
        pairs = T * max(max(sum(q) - h, (G - 1) * h) for h in q) * row_bytes  # one row a (token, other group)
        routed = T * K * busiest_offrank(P_g)  # a 16-byte entry per routed row off-group
        copies = G * T * K * max(max(P_g[d // n] - P[d], (n - 1) * P[d]) for d in range(ranks)) * row_bytes
        plan[level] = [(cross, (G - 1) * 16), (cross, pairs), (cross, routed * 16), (cross, routed * weight_bytes),
                       (inner, (n - 1) * (E // ranks) * 8), (inner, copies), (inner, copies), (cross, pairs)]
    return plan


COMBINE_PHASES = {"off": 1}  # per dedup choice, how many of the last messages are the combine's (dedup: 2)


def split_dispatch_combine(mode: str, msgs: list) -> tuple[list, list]:
    """(the dispatch's messages, the combine's) of one dedup choice's list, in the runtime's order."""
    k = COMBINE_PHASES.get(mode, 2)
    return msgs[:-k], msgs[-k:]
