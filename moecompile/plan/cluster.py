"""The cluster file of ``python -m moecompile plan``:

    {"gpu": {"name": "H100", "bf16_tflops": 800, "hbm_TBps": 3.35, "memory_GB": 80},
     "levels": [{"name": "node", "count": 128, "alpha_s": 1e-5, "GBps": 25},
                {"name": "local", "count": 8, "alpha_s": 3e-6, "GBps": 450}]}

``gpu`` may add ``pcie_GBps`` (its host link, 25 unless given: replication's host optimizer). Levels outermost
first; ``count``: workers of that level per worker of the level above; ``alpha_s`` (start-up
seconds) and ``GBps`` (10^9 bytes per second a GPU sends over that level) may instead come from a calibration
file (``python -m moecompile calibrate``'s JSON: a level's link is its kind of the same name).

How groups of ranks lay out over the levels, innermost first: ``group_counts`` (an expert-parallel group's ranks
per level), ``copy_counts`` (its copies'), ``tile``, ``stage_cluster`` (one pipeline stage's GPUs).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from dataclasses import dataclass

GPU_FIELDS = ("name", "bf16_tflops", "hbm_TBps", "memory_GB")


@dataclass(frozen=True)
class Level:
    name: str
    count: int
    alpha_s: float
    GBps: float

    def seconds(self, nbytes: float) -> float:
        """One message of ``nbytes`` over this level's link: alpha + bytes / bandwidth (0 bytes: nothing sent)."""
        return 0.0 if nbytes <= 0 else self.alpha_s + nbytes / (self.GBps * 1e9)


@dataclass(frozen=True)
class Cluster:
    gpu_name: str
    tflops: float
    hbm_TBps: float
    memory_GB: float
    levels: tuple[Level, ...]
    pcie_GBps: float = 25.0  # the GPU's link to its host (replication's host optimizer), gpu "pcie_GBps" if given

    @property
    def gpus(self) -> int:
        return math.prod(level.count for level in self.levels)

    @property
    def counts(self) -> tuple[int, ...]:
        return tuple(level.count for level in self.levels)


def read_cluster(source, calibration=None) -> Cluster:
    """A cluster JSON path or dict -> ``Cluster``; ``calibration``: a calibrate JSON (path or dict) whose
    ``params[level name] = [alpha, beta]`` fills each level's missing ``alpha_s``/``GBps``. A missing or bad field
    raises ``ValueError`` naming it."""
    values = load_json(source, "cluster")
    links = load_json(calibration, "calibration").get("params", {}) if calibration is not None else {}
    gpu = values.get("gpu")
    if not isinstance(gpu, dict):
        raise ValueError('the cluster file needs "gpu": {"name": ..., "bf16_tflops": ..., "hbm_TBps": ..., '
                         '"memory_GB": ...}')
    missing = [f for f in GPU_FIELDS if f not in gpu]
    if missing:
        raise ValueError(f"the cluster file's gpu lacks {', '.join(repr(f) for f in missing)}: add them")
    for f in GPU_FIELDS[1:]:
        _positive(gpu[f], f"gpu.{f}")
    raw = values.get("levels")
    if not isinstance(raw, list) or not raw:
        raise ValueError('the cluster file needs "levels": a list, outermost first, of {"name", "count", '
                         '"alpha_s", "GBps"}')
    levels = []
    for i, level in enumerate(raw):
        name = level.get("name") if isinstance(level, dict) else None
        if not isinstance(name, str):
            raise ValueError(f"the cluster file's level {i} needs a \"name\"")
        alpha, gbps = level.get("alpha_s"), level.get("GBps")
        if name in links and (alpha is None or gbps is None):
            a, beta = links[name]
            alpha = a if alpha is None else alpha
            gbps = (1e-9 / beta if beta > 0 else math.inf) if gbps is None else gbps
        for field, v in (("count", level.get("count")), ("alpha_s", alpha), ("GBps", gbps)):
            if v is None:
                raise ValueError(f"the cluster file's level {name!r} lacks {field!r}"
                                 + ("" if field == "count" else " (or give a calibration file measuring it)"))
        if not isinstance(level["count"], int) or level["count"] < 1:
            raise ValueError(f"level {name!r}: count must be a whole number >= 1, got {level['count']!r}")
        _positive(gbps, f"level {name!r} GBps")
        if not alpha >= 0:
            raise ValueError(f"level {name!r}: alpha_s must be >= 0, got {alpha!r}")
        levels.append(Level(name, level["count"], float(alpha), float(gbps)))
    pcie = gpu.get("pcie_GBps", 25.0)
    _positive(pcie, "gpu.pcie_GBps")
    return Cluster(str(gpu["name"]), float(gpu["bf16_tflops"]), float(gpu["hbm_TBps"]), float(gpu["memory_GB"]),
                   tuple(levels), float(pcie))


def load_json(source, what: str) -> dict:
    """A JSON object from a path (or the dict itself); a file that cannot be read raises ValueError naming it."""
    if isinstance(source, dict):
        return source
    try:
        with open(source) as f:
            values = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read the {what} file {source!r}: {e}") from None
    if not isinstance(values, dict):
        raise ValueError(f"the {what} file {source!r} must hold a JSON object")
    return values


def _positive(v, what: str) -> None:
    if not isinstance(v, (int, float)) or not v > 0:
        raise ValueError(f"{what} must be a number > 0, got {v!r}")


def group_counts(cluster: Cluster, size: int, stride: int = 1) -> list[int] | None:
    """A group of ``size`` ranks taken innermost first, every ``stride``-th rank of the innermost level: its size
    per level (outermost first); None where it does not tile the levels."""
    counts = list(cluster.counts)
    counts[-1] //= stride
    return tile(counts, size)


def copy_counts(cluster: Cluster, group: list[int], stride: int = 1) -> list[int]:
    """The copies of an expert-parallel group of ``group`` ranks per level (``group_counts``'s, every ``stride``-th
    rank of the innermost level: TED's, one tp index) per level of ``cluster``."""
    return [c // g // (stride if j == len(group) - 1 else 1) for j, (c, g) in enumerate(zip(cluster.counts, group))]


def tile(counts: list[int], size: int) -> list[int] | None:
    """A group of ``size`` ranks taken innermost first over levels of ``counts`` ranks: its size per level; None
    where it does not tile them."""
    out, left = [1] * len(counts), size
    for j in reversed(range(len(counts))):
        take = math.gcd(left, counts[j])
        if take < min(left, counts[j]):
            return None
        out[j], left = take, left // take
        if left == 1:
            break
    return out if left == 1 else None


@functools.lru_cache(maxsize=256)
def stage_cluster(cluster: Cluster, pp: int) -> Cluster | None:
    """The GPUs of one of ``pp`` pipeline stages: the outermost level's count divided by ``pp`` (None where it does
    not divide)."""
    if cluster.counts[0] % pp:
        return None
    return dataclasses.replace(cluster, levels=(dataclasses.replace(cluster.levels[0], count=cluster.counts[0] // pp),
                                                *cluster.levels[1:]))
