"""Bytes the expert-parallel ops send, counted where they are sent, per MoE layer (read by ``moecompile.comm_stats``).

Each exchange is split by what the rows cross: ``"self"`` (rows a rank keeps: no link), ``"local"`` (another rank
of the same node) and ``"node"`` (another node). Nodes are groups of ``ranks_per_node`` consecutive ranks of the
layer's process group, as a ``("node", "local")`` mesh lays them out; set per group by ``set_ranks_per_node``
(without it every other rank counts as ``"node"``).
"""

from __future__ import annotations

import threading
from collections import defaultdict

LINKS = ("self", "local", "node")


class CommCounter:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._bytes: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        self._per_node: dict[str, int] = {}

    def set_ranks_per_node(self, group_name: str, ranks_per_node: int) -> None:
        self._per_node[group_name] = ranks_per_node

    def _add(self, layer: str, phase: str, group, rows_per_rank: list[int], row_bytes: int) -> None:
        import torch.distributed as dist

        me = dist.get_rank(group)
        per_node = self._per_node.get(group.group_name, 1)
        with self._lock:
            stats = self._bytes[layer]
            stats["calls." + phase] += 1
            for peer, rows in enumerate(rows_per_rank):
                link = "self" if peer == me else ("local" if peer // per_node == me // per_node else "node")
                stats[f"{phase}.{link}"] += rows * row_bytes

    def add_dispatch(self, layer, group, rows_per_rank, row_bytes) -> None:
        self._add(layer, "dispatch", group, rows_per_rank, row_bytes)

    def add_combine(self, layer, group, rows_per_rank, row_bytes) -> None:
        self._add(layer, "combine", group, rows_per_rank, row_bytes)

    def snapshot(self) -> dict[str, dict[str, int]]:
        with self._lock:
            return {layer: dict(stats) for layer, stats in self._bytes.items()}

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
