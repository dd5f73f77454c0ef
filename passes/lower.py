"""lower: choose the implementation of every canonical MoE op, per layer.

For now one implementation exists: the torch reference ops (``moecompile.runtime.reference``), which run on CPU
and GPU. The choice is recorded per layer so that ``explain()`` shows it; ``lowering="triton"`` is accepted by the
options once the Triton kernels land.

    before: y = moe.expert_mlp(...)      after: y = moe.expert_mlp(...)   meta["moe_lowering"] = "torch"
"""

from __future__ import annotations

import torch.fx as fx

from .report import PassReport


def lower_moe_pass(gm: fx.GraphModule, example_inputs, *, config, report: PassReport) -> fx.GraphModule:
    lowered = {}
    for n in gm.graph.nodes:
        layer = n.meta.get("moe_layer")
        if layer is not None:
            n.meta["moe_lowering"] = "torch"
            lowered[layer] = "torch"
    for rec in report.layers:
        if rec.path in lowered:
            rec.lowering = lowered[rec.path]
    report.counters["lower.torch"] += len(lowered)
    return gm
