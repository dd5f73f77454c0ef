"""The ``moe`` torch.compile backend: options -> MoE passes -> Inductor (or aot_eager) for the whole graph.

Registered under the ``torch_dynamo_backends`` entry point, so ``torch.compile(model, backend="moe")`` works
without importing moecompile first.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from moecompile.passes.report import PassReport

from .tracing.capture import MARK, install
from .config import MoEOptions, parse_options
from .pipeline import Checkpoint, MoECompileError, run_passes


def moe_backend(gm: fx.GraphModule, example_inputs, options: dict | MoEOptions | None = None, **_ignored):
    """torch.compile backend entry: rewrite the MoE blocks of ``gm``, then hand it to the inner compiler."""
    return compile_graph(gm, example_inputs, parse_options(options), PassReport())


def _wants_capture(options) -> bool:
    """Read by moecompile/tracing/capture.py when Dynamo starts a compile for this backend: capture data-dependent
    shapes (expert loops stay in the graph) unless options say capture=False. Bad options capture: the backend then
    raises its own clear error for them."""
    try:
        return parse_options(options).capture
    except ValueError:
        return True


setattr(moe_backend, MARK, _wants_capture)
install()


def compile_graph(gm: fx.GraphModule, example_inputs, config: MoEOptions, report: PassReport):
    """The MoE passes, then the inner compiler. A rewritten graph the inner compiler rejects is compiled as it came
    in instead, and the failure reported like a pass's (``strict=True`` raises)."""
    install()  # torch._dynamo.reset() drops Dynamo's compile callbacks: the next compile captures again
    checkpoint = Checkpoint.take(gm, report)
    gm = rewrite(gm, example_inputs, config, report, checkpoint)
    if not checkpoint.rewrote(report):
        return compile_inner(gm, example_inputs, config)
    try:
        return compile_inner(gm, example_inputs, config)
    except torch._dynamo.exc.RestartAnalysis:
        raise  # Dynamo's own control flow: it traces again
    except Exception as exc:
        if config.strict:
            raise MoECompileError(f"the inner compiler ({config.inner}) failed on the rewritten graph: {exc}") from exc
        return compile_inner(checkpoint.restore(report, "inner", exc, config), example_inputs, config)


def rewrite(gm, example_inputs, config: MoEOptions, report: PassReport,
            checkpoint: Checkpoint | None = None) -> fx.GraphModule:
    with torch.enable_grad():  # verify differentiates probes even when the model runs under no_grad
        return run_passes(gm, example_inputs, config, report, checkpoint)


def compile_inner(gm: fx.GraphModule, example_inputs, config: MoEOptions):
    if config.inner == "inductor":
        from torch._inductor.compile_fx import compile_fx

        return compile_fx(gm, example_inputs)
    from torch._dynamo.backends.registry import lookup_backend

    return lookup_backend("aot_eager")(gm, example_inputs)
