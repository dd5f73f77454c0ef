"""Bytes the expert-parallel ops send, counted where they are sent, per MoE layer (read by ``moecompile.comm_stats``).

Each exchange is split by what the rows cross: ``"self"`` (rows a rank keeps: no link), the outermost level of the
mesh the two ranks differ in (``"local"``: another rank of the same node; ``"node"``: another node; ``"rack"``...:
``runtime/comm/levels.py``), or ``"peer"`` (another rank of a mesh with one level, whose ranks are not placed on
nodes). ``moecompile.parallelize`` tells the counter each global rank's coordinates on a mesh of several levels
(``set_levels``). Phases: ``dispatch`` (token rows to the experts), ``combine`` (expert outputs back) and
``routing`` (the expert ids and routing weights that hierarchical dispatch sends with its rows). Hierarchical
dedup also counts, per layer, the rows that would have crossed into other groups of its level without it
(``dedup.remote_assignments``: routed (token, expert) pairs on another node, for dedup at "node") and the rows
that did (``dedup.remote_pairs``: distinct (token, remote node) pairs). ``seconds``: the wall time of the layer's
forward exchanges (dispatch, routing and combine; backward is not timed). On CUDA only with
``MOECOMPILE_COMM_TIMING=1``: the exchanges run on the device's streams, so timing one waits for the device after
it, and the compute after it could no longer overlap it.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections import defaultdict

from .levels import link as level_link


class CommCounter:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._bytes: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        self._coords: dict[int, tuple[int, ...]] = {}
        self._levels: tuple[str, ...] = ()

    def set_levels(self, coords: dict[int, tuple[int, ...]], names: tuple[str, ...]) -> None:
        """The coordinates of each global rank on a mesh of levels ``names`` (ranks not named here are on no known
        node). The last mesh set up wins."""
        self._coords, self._levels = dict(coords), tuple(names)

    def links(self) -> tuple[str, ...]:
        """Every link name bytes may be counted under, innermost first."""
        return ("self", *reversed(self._levels), "peer")

    def link(self, me: int, peer: int) -> str:
        """The kind of link between two global ranks."""
        if peer == me:
            return "self"
        kind = level_link(self._coords[me], self._coords[peer], self._levels) if me in self._coords and \
            peer in self._coords else "peer"
        return "peer" if kind == "self" else kind  # (ranks differing only outside the expert-parallel group share
        # its coordinates: copies of its experts, a "dp_shard" gather's peers)

    def add_rows(self, layer: str, phase: str, group, rows_per_rank: list[int], row_bytes: int) -> None:
        """``rows_per_rank[r]`` rows of ``row_bytes`` each sent by this rank to rank r of ``group``."""
        import torch.distributed as dist

        me = dist.get_rank()
        with self._lock:
            stats = self._bytes[layer]
            stats["calls." + phase] += 1
            for peer, rows in enumerate(rows_per_rank):
                stats[f"{phase}.{self.link(me, dist.get_global_rank(group, peer))}"] += rows * row_bytes

    def add(self, layer: str, key: str, value) -> None:
        """``value``: an int, or a one-element tensor summed where it lives until a snapshot reads it (a count the
        device computed is not waited for)."""
        with self._lock:
            self._bytes[layer][key] += value

    @contextlib.contextmanager
    def timed(self, layer: str, device):
        """Adds the seconds the block takes (the forward exchanges of a layer) to ``seconds`` (on CUDA only with
        MOECOMPILE_COMM_TIMING=1: it waits for the device)."""
        if device.type == "cuda" and os.environ.get("MOECOMPILE_COMM_TIMING") != "1":
            yield
            return
        start = time.perf_counter()
        yield
        if device.type == "cuda":
            import torch

            torch.cuda.synchronize(device)
        with self._lock:
            self._bytes[layer]["seconds"] += time.perf_counter() - start

    def snapshot(self) -> dict[str, dict[str, int]]:
        with self._lock:
            return {layer: {k: int(v) if hasattr(v, "item") else v for k, v in stats.items()}
                    for layer, stats in self._bytes.items()}

    def reset(self) -> None:
        with self._lock:
            self._bytes.clear()


COMM = CommCounter()


def comm_stats(reset: bool = False) -> dict[str, dict[str, int]]:
    """``{layer: {"dispatch.node": bytes, "dispatch.local": ..., "combine.node": ..., "calls.dispatch": n, ...}}``
    for every expert-parallel layer that has run since the last reset (``reset=True`` starts again after reading)."""
    stats = COMM.snapshot()
    if reset:
        COMM.reset()
    return stats
