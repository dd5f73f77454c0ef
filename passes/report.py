"""What the passes found and did, recorded where it happens and read by ``moecompile.explain``."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from .spec import MoESpec


@dataclass
class LayerRecord:
    path: str
    spec: MoESpec
    candidates_tried: int = 1
    max_error: float = 0.0  # worst normwise error of the proof (forward and backward)
    lowering: str = "torch"  # "triton" or "torch", chosen by the lower pass
    lowering_notes: list[str] = field(default_factory=list)  # ops kept on torch in a Triton layer, and why


@dataclass
class SkipRecord:
    region: str
    reason: str


@dataclass
class PassReport:
    """Filled by the passes of one or more graphs (a model that breaks into several graphs has several)."""

    layers: list[LayerRecord] = field(default_factory=list)
    skipped: list[SkipRecord] = field(default_factory=list)
    graphs: list[tuple[str, str]] = field(default_factory=list)  # (stage, readable code)
    counters: Counter = field(default_factory=Counter)

    def skip(self, region: str, reason: str) -> None:
        self.skipped.append(SkipRecord(region, reason))
        self.counters["skipped"] += 1
