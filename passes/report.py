"""What the passes found and did, recorded where it happens and read by ``moecompile.explain``."""

from __future__ import annotations

from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field

from .spec import MoESpec


@dataclass
class LayerRecord:
    path: str
    spec: MoESpec
    candidates_tried: int = 1
    max_error: float = 0.0  # worst normwise error of the proof (forward and backward)
    lowering: str = "torch"  # the form it runs in: "original", "torch", "grouped" or "triton" (the lower pass)
    forms: dict = field(default_factory=dict)  # lowering="auto": form -> forms.Timing, what the choice compared
    lowering_notes: list[str] = field(default_factory=list)  # ops kept on torch in a Triton layer, and why
    lowering_error: float | None = None  # the Triton kernels against the references on probes (lower's proof)
    kernel_tiles: str = ""  # tile configuration of each grouped GEMM kernel, and where it comes from
    expert_weights: dict = field(default_factory=dict, repr=False)  # role -> the parameter (a list for ModuleList
    # experts), as verify found them: what moecompile.parallelize shards
    sharding: str = ""  # "E/W experts on each of W ranks (...)" when parallelize sharded the layer
    dedup: str = ""  # how its rows cross the mesh when sharded: "off" or the level it dedups at ("node"...)
    dedup_reason: str = ""  # why that level (dedup="auto": the predicted times)
    predicted_s: dict = field(default_factory=dict)  # dedup="auto": predicted seconds per level, example routing
    checkpointed: str = ""  # in an activation-checkpointed region: what backward runs again (passes/recompute.py)
    proved_as: str = ""  # proved by the proof of this earlier layer of the graph: the same code and shapes (verify)


@dataclass
class SkipRecord:
    region: str
    reason: str


@dataclass
class FailureRecord:
    """A pass (or the inner compiler) raised: the graph ran as it came in from Dynamo."""

    stage: str  # the pass name, or "inner" for the compiler after the passes
    region: str  # the MoE block being worked on when it raised, else the graph
    error: str  # "TypeName: message"

    @property
    def what(self) -> str:
        if self.stage == "first_run":
            return "the rewritten graph's first run"
        return "the inner compiler" if self.stage == "inner" else f"pass {self.stage!r}"


@dataclass
class PassReport:
    """Filled by the passes of one or more graphs (a model that breaks into several graphs has several)."""

    layers: list[LayerRecord] = field(default_factory=list)
    skipped: list[SkipRecord] = field(default_factory=list)
    graphs: list[tuple[str, str]] = field(default_factory=list)  # (stage, readable code)
    counters: Counter = field(default_factory=Counter)
    failures: list[FailureRecord] = field(default_factory=list)
    graphs_seen: int = 0  # graphs that entered the pipeline: "graph 1" in a failure is the second
    loops: dict[str, str] = field(default_factory=dict)  # forward traced with its nonzero() loop rewritten -> where

    def skip(self, region: str, reason: str) -> None:
        self.skipped.append(SkipRecord(region, reason))
        self.counters["skipped"] += 1


@contextmanager
def block(region: str):
    """Tag an exception raised while a pass works on one block with the block's path, for the failure record."""
    try:
        yield
    except Exception as exc:
        if getattr(exc, "moe_region", None) is None:
            exc.moe_region = region
        raise
