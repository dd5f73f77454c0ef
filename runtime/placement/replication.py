"""Adaptive expert replication: where each expert's instances live next iteration, which instance each routed row
goes to, and which instance each optimizer partition takes its gradient from (pure host-side functions; the
paper: ``../shared/papers/adaptive-expert-replication.md`` §3.4 and §4).

A layer has E experts and N = W x S slots (W ranks, S slots each; slot n lives on rank n // S). A placement,
``slot_expert_N``, names the expert each slot holds; every expert has at least one instance.

``schedule`` (the paper's Algorithm 1): the popularity of the iteration (routed rows per expert, summed over the
ranks) normalised to N slots, at least one instance each, rounded down, then corrected to exactly N (one
instance more to the most under-provisioned expert, or one fewer to the most over-provisioned one with several,
until the sum is N), and laid out contiguously: expert 0's instances in the first slots, then expert 1's... so
an expert's instances share a rank where they fit and the ranks hosting one expert are consecutive (the
gradient all-reduce then needs only the pre-registered groups of consecutive ranks, ``consecutive_groups``).

``route_to_instances``: the rows of each expert, taken in a global order (rank 0's first, each rank's in its
own order), are split over the expert's instances in contiguous runs of equal size (sizes differ by at most
one). With a capacity per instance, an expert with more rows than its instances hold fills them in that order
and the rest are dropped.

``gradient_source`` (the paper's get_source, Algorithm 2): the rank an optimizer partition on ``rank`` takes
expert e's reduced gradient from: itself if it hosts an instance of e, else the hosting ranks in turn over the
ranks that do not host e (no hosting rank serves more than its share).
"""

from __future__ import annotations

import math

import torch

Tensor = torch.Tensor


def check_slots(num_experts: int, world: int, slots_per_rank: int) -> None:
    """ValueError unless every expert can have an instance: slots_per_rank x ranks >= experts."""
    if not isinstance(slots_per_rank, int) or slots_per_rank < 1:
        raise ValueError(f"slots_per_rank must be a whole number >= 1; got {slots_per_rank!r}")
    if slots_per_rank * world < num_experts:
        raise ValueError(f"slots_per_rank={slots_per_rank} x {world} ranks = {slots_per_rank * world} slots cannot "
                         f"hold one instance of each of {num_experts} experts: use slots_per_rank >= "
                         f"{math.ceil(num_experts / world)}")


def instances(popularity_E: Tensor, num_slots: int) -> Tensor:
    """Instances per expert, [E] summing to ``num_slots``: proportional to ``popularity_E`` (rows routed to each;
    all zero: equal shares), at least one each."""
    E = popularity_E.numel()
    if num_slots < E:
        raise ValueError(f"{num_slots} slots cannot hold one instance of each of {E} experts")
    pop = popularity_E.detach().to(torch.float64).cpu().clamp(min=0)
    share = pop / pop.sum() * num_slots if pop.sum() > 0 else torch.full((E,), num_slots / E, dtype=torch.float64)
    count = share.floor().clamp(min=1).to(torch.int64)
    while int(count.sum()) < num_slots:  # the most under-provisioned expert first (the lowest id on ties)
        count[int(torch.argmax(share - count))] += 1
    while int(count.sum()) > num_slots:  # the most over-provisioned expert that has several instances
        over = torch.where(count > 1, count - share, torch.tensor(-math.inf, dtype=torch.float64))
        count[int(torch.argmax(over))] -= 1
    return count


def schedule(popularity_E: Tensor, world: int, slots_per_rank: int) -> Tensor:
    """The next placement, ``slot_expert_N`` (N = world x slots_per_rank): ``instances`` laid out contiguously,
    expert by expert."""
    check_slots(popularity_E.numel(), world, slots_per_rank)
    count = instances(popularity_E, world * slots_per_rank)
    return torch.repeat_interleave(torch.arange(popularity_E.numel()), count)


def uniform(num_experts: int, world: int, slots_per_rank: int) -> Tensor:
    """The static placement: each expert the same number of instances (as near as the slots allow), contiguous."""
    return schedule(torch.zeros(num_experts), world, slots_per_rank)


def route_to_instances(counts_WE: Tensor, slot_expert_N: Tensor, capacity: int | None = None) -> Tensor:
    """Rows each rank sends to each slot, ``[W, N]``: ``counts_WE[w, e]`` rows of expert e on rank w, split over
    e's instances in contiguous runs of the global order (rank 0's rows first) of equal size; with ``capacity``
    (rows per instance), runs of ``capacity`` rows while the expert has more than its instances hold, the rest
    dropped (what the matrix does not count)."""
    counts_WE = counts_WE.to(torch.int64).cpu()
    W, E = counts_WE.shape
    N = slot_expert_N.numel()
    out = torch.zeros(W, N, dtype=torch.int64)
    start_WE = torch.cumsum(counts_WE, 0) - counts_WE  # where each rank's rows begin in the expert's order
    total_E = counts_WE.sum(0)
    for e in range(E):
        slots = torch.nonzero(slot_expert_N == e).flatten()
        r, n = slots.numel(), int(total_E[e])
        if r == 0:
            if n:
                raise ValueError(f"expert {e} has {n} routed rows and no instance in the placement")
            continue
        if capacity is not None and n > r * capacity:
            bounds = torch.arange(r + 1) * capacity
        else:
            bounds = torch.div(torch.arange(r + 1) * n, r, rounding_mode="floor")
        first, last = start_WE[:, e:e + 1], start_WE[:, e:e + 1] + counts_WE[:, e:e + 1]  # [W, 1]
        out[:, slots] = (torch.minimum(last, bounds[1:]) - torch.maximum(first, bounds[:-1])).clamp(min=0)
    return out


def hosting_ranks(slot_expert_N: Tensor, expert: int, slots_per_rank: int) -> list[int]:
    """The ranks holding an instance of ``expert``, in order."""
    slots = torch.nonzero(slot_expert_N == expert).flatten()
    return sorted({int(s) // slots_per_rank for s in slots})


def gradient_sources(slot_expert_N: Tensor, expert: int, world: int, slots_per_rank: int) -> list[int]:
    """For each rank, the rank whose reduced gradient of ``expert`` its optimizer partition takes (Algorithm 2)."""
    hosts = hosting_ranks(slot_expert_N, expert, slots_per_rank)
    if not hosts:
        raise ValueError(f"expert {expert} has no instance in the placement")
    others = [r for r in range(world) if r not in hosts]
    return [r if r in hosts else hosts[others.index(r) % len(hosts)] for r in range(world)]


def gradient_source(slot_expert_N: Tensor, expert: int, rank: int, world: int, slots_per_rank: int) -> int:
    """The rank whose reduced gradient of ``expert`` the optimizer partition on ``rank`` takes."""
    return gradient_sources(slot_expert_N, expert, world, slots_per_rank)[rank]


def consecutive_groups(world: int) -> list[tuple[int, int]]:
    """Every run of at least two consecutive ranks, (first, last): the groups an expert's gradient all-reduce may
    need under a contiguous placement, W (W - 1) / 2 of them, registered once before training."""
    return [(a, b) for a in range(world) for b in range(a + 1, world)]
