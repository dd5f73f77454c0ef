"""The ``moe`` torch.compile backend: options -> MoE passes -> Inductor (or aot_eager) for the whole graph.

Registered under the ``torch_dynamo_backends`` entry point, so ``torch.compile(model, backend="moe")`` works
without importing moecompile first.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from moecompile.passes.report import PassReport

from .config import MoEOptions, parse_options
from .pipeline import run_passes


def moe_backend(gm: fx.GraphModule, example_inputs, options: dict | MoEOptions | None = None, **_ignored):
    """torch.compile backend entry: rewrite the MoE blocks of ``gm``, then hand it to the inner compiler."""
    config = parse_options(options)
    report = PassReport()
    gm = rewrite(gm, example_inputs, config, report)
    return compile_inner(gm, example_inputs, config)


def rewrite(gm, example_inputs, config: MoEOptions, report: PassReport) -> fx.GraphModule:
    with torch.enable_grad():  # verify differentiates probes even when the model runs under no_grad
        return run_passes(gm, example_inputs, config, report)


def compile_inner(gm: fx.GraphModule, example_inputs, config: MoEOptions):
    if config.inner == "inductor":
        from torch._inductor.compile_fx import compile_fx

        return compile_fx(gm, example_inputs)
    from torch._dynamo.backends.registry import lookup_backend

    return lookup_backend("aot_eager")(gm, example_inputs)
