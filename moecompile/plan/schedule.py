"""The pipeline schedule a plan with stages runs (``pp`` stages over the outermost level, each rank holding
``virtual`` of them): torch's ``Schedule1F1B`` with one stage a rank, ``ScheduleInterleaved1F1B`` with several (the
model cut into ``pp x virtual`` stages by ``moecompile.pipeline_stage``, rank r holding stages r, r + pp, ...;
Narayanan et al. 2021, the interleaved schedule: the bubble shrinks ``virtual`` times, each micro-batch crosses the
ranks ``virtual`` times as often, and the first rank holds more micro-batches' activations)."""

from __future__ import annotations

import dataclasses
import functools

from .shapes import MoEShape


@functools.lru_cache(maxsize=256)
def stage_shape(shape: MoEShape, pp: int) -> MoEShape:
    """The busiest rank's part of the model cut into stages as ``pipeline_stage`` cuts it (the first stages one layer
    more where they do not divide): ceil(L / pp) layers, also where it holds ``virtual`` of ``pp x virtual`` stages
    (rank 0's, 0, pp, 2 pp, ..., v (L // (pp v)) layers and one more for each below L % (pp v): ceil(L / pp)),
    ceil(L_moe / pp) of them MoE at most, the head (its compute) and one vocab x hidden matrix (the first stage's
    embedding or the last's head)."""
    if pp == 1:
        return shape
    layers = -(-shape.layers // pp)
    return dataclasses.replace(shape, layers=layers, moe_layers=min(layers, -(-shape.moe_layers // pp)), embeddings=1)


def runs(pp: int, virtual: int, micro: int) -> str | None:
    """Why torch's schedule cannot run ``micro`` micro-batches so, or None: the interleaved one runs them in
    max(1, micro // pp) rounds, whose number must divide them."""
    rounds = max(1, micro // pp)
    if virtual > 1 and micro % rounds:
        return (f"torch's ScheduleInterleaved1F1B runs {micro} micro-batches in {rounds} rounds, which do not divide "
                "them")
    return None


def slots(pp: int, virtual: int, micro: int) -> float:
    """A step's length in micro-batch times of the busiest rank: M, and the bubble, pp - 1 stages' share of one
    (1F1B), a ``virtual``-th of that interleaved."""
    return micro + (pp - 1) / virtual


def in_flight(pp: int, virtual: int, micro: int) -> float:
    """Micro-batches' activations the first rank holds at once, in units of all its layers: 1F1B's min(pp, M);
    interleaved, torch's warm-up forwards of one stage each before the first backward, (virtual - 1) x the
    micro-batches of a round + 2 (pp - 1), and one more, over ``virtual`` (at most M)."""
    if virtual == 1:
        return min(pp, micro)
    per_round = micro // max(1, micro // pp)
    return min(micro * virtual, (virtual - 1) * per_round + 2 * (pp - 1) + 1) / virtual
