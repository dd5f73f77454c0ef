"""The ``moe`` torch.compile backend: options -> MoE passes -> Inductor (or aot_eager) for the whole graph.

Registered under the ``torch_dynamo_backends`` entry point, so ``torch.compile(model, backend="moe")`` works
without importing moecompile first.

No model stops the user's program (``docs/detection.md``, "Never stops your program"): a pass or the inner compiler
that raises, a rewritten graph that raises at its first run, and a trace that fails only because data-dependent
shapes are captured each leave that graph (or frame) as Dynamo's defaults give it, reported; ``strict=True`` raises.
"""

from __future__ import annotations

import contextlib
import logging
import warnings

import torch
import torch.fx as fx

from moecompile.passes import forms
from moecompile.passes.experts import PARAM_DTYPES
from moecompile.passes.graph_utils import FRAME_PREFIX, FRAME_TYPE
from moecompile.passes.recompute import saves_exchanges
from moecompile.passes.regather import RegathersEarly, regathers, start_regathers_early
from moecompile.passes.report import PassReport

from .distributed.grads import fsdp_param_dtypes, gradient_syncs
from .tracing import ddp
from .tracing.capture import MARK, RETRACE, install
from .tracing.frames import frame_prefix, running_model
from .config import MoEOptions, parse_options, with_mode
from .pipeline import Checkpoint, MoECompileError, MoEFallbackWarning, run_passes


def moe_backend(gm: fx.GraphModule, example_inputs, options: dict | MoEOptions | None = None, mode: str | None = None,
                **unknown):
    """torch.compile backend entry: rewrite the MoE blocks of ``gm``, then hand it to the inner compiler.
    ``mode``: torch.compile's, for the inner Inductor (the option ``mode``)."""
    if unknown:  # torch.compile passes only mode and options today: a newer torch's argument is said, not dropped
        warnings.warn(f"moecompile: the moe backend does not know the argument(s) {sorted(unknown)} it was given; "
                      "they are ignored", stacklevel=2)
    return compile_graph(gm, example_inputs, parse_options(with_mode(options, mode)), PassReport())


def _wants_capture(options) -> bool:
    """Read by moecompile/tracing/capture.py when Dynamo starts a compile for this backend: capture data-dependent
    shapes (expert loops stay in the graph) unless options say capture=False. Bad options capture: the backend then
    raises its own clear error for them."""
    try:
        return parse_options(options).capture
    except ValueError:
        return True


def capture_failed(config: MoEOptions, where: str, error: str) -> None:
    """Called by moecompile/tracing/capture.py when Dynamo's trace for this backend failed at ``where`` with
    data-dependent shapes captured, before Dynamo traces the frame again with its defaults: warn, or with
    ``strict=True`` raise instead (Dynamo raises it as the backend's error). A trace of a model
    ``moecompile.parallelize`` sharded that failed where parameters were added to its experts since raises
    saying so (no trace can run them)."""
    _refuse_adapted_experts(running_model(), error)
    if config.strict:
        raise MoECompileError(
            f"Dynamo's trace of {where} failed with data-dependent shapes captured (the moe backend's option "
            f"capture, on by default): {error}. Fix: options={{'capture': False}} traces with Dynamo's defaults "
            "(data-dependent shapes there then break the graph, and experts cut off by a break are not rewritten), "
            "or give that line sizes of a length Dynamo knows (docs/detection.md, Expert loops); without strict the "
            "backend traces the frame again with Dynamo's defaults by itself and explain() says so")
    warnings.warn(f"moecompile: Dynamo's trace of {where} failed with data-dependent shapes captured ({error}); it is "
                  "traced again with Dynamo's defaults (such shapes there break the graph). moecompile.explain() "
                  "reports it; options={'strict': True} raises instead.", MoEFallbackWarning, stacklevel=2)


def _capture_failed(options, where: str, error: str) -> None:
    capture_failed(parse_options(options), where, error)


def compile_whole(gm: fx.GraphModule, example_inputs, config: MoEOptions, report: PassReport, split):
    """A graph of a model in ``DistributedDataParallel`` (``tracing/ddp.py``): the passes on Dynamo's whole graph,
    then ``split``, DDP's bucket cut of the rewritten graph, each piece compiled by the inner compiler (counted in
    ``ddp.pieces``), so that each bucket's all-reduce still starts when its piece's backward is done."""
    def piece(graph, inputs):
        report.counters["ddp.pieces"] += 1
        return compile_inner(graph, inputs, config)

    return compile_graph(gm, example_inputs, config, report, inner=lambda graph, inputs, _: split(graph, inputs, piece))


def _whole_graph(gm: fx.GraphModule, example_inputs, kwargs: dict, split):
    return compile_whole(gm, example_inputs, parse_options(with_mode(kwargs.get("options"), kwargs.get("mode"))),
                         PassReport(), split)


setattr(moe_backend, MARK, _wants_capture)
setattr(moe_backend, RETRACE, _capture_failed)
setattr(moe_backend, ddp.WHOLE, _whole_graph)
install()
ddp.install()


def compile_graph(gm: fx.GraphModule, example_inputs, config: MoEOptions, report: PassReport, inner=None):
    """The MoE passes, then the inner compiler (``inner(gm, example_inputs, config)``, ``compile_inner`` by default).
    A rewritten graph the inner compiler rejects is compiled as it came in instead, and the failure reported like a
    pass's; so is one that raises at its first run (``FirstRun``). ``strict=True`` raises."""
    inner = inner or compile_inner
    install()  # torch._dynamo.reset() drops Dynamo's compile callbacks: the next compile captures again
    checkpoint = Checkpoint.take(gm, report)
    model = running_model()
    _sync_new_parameters(model)
    path, kind = frame_prefix()
    prefix, typ = FRAME_PREFIX.set(path), FRAME_TYPE.set(kind)  # layers named by their path in the model
    dtypes = PARAM_DTYPES.set(fsdp_param_dtypes(model) if model is not None else {})  # (FSDP2's bf16 policy)
    try:
        gm = rewrite(gm, example_inputs, config, report, checkpoint)
    finally:
        FRAME_PREFIX.reset(prefix)
        FRAME_TYPE.reset(typ)
        PARAM_DTYPES.reset(dtypes)
    if not checkpoint.rewrote(report):
        return inner(gm, example_inputs, config)
    try:
        with _quiet_context_fn_note(saves_exchanges(gm)):
            compiled = inner(gm, example_inputs, config)
    except torch._dynamo.exc.RestartAnalysis:
        raise  # Dynamo's own control flow: it traces again
    except Exception as exc:
        if config.strict:
            raise MoECompileError(f"the inner compiler ({config.inner}) failed on the rewritten graph: {exc}") from exc
        return inner(checkpoint.restore(report, "inner", exc, config), example_inputs, config)
    context = torch._guards.TracingContext.try_get()  # Dynamo's, for this graph: its fake tensors, symbolic sizes
    # the fallback holds no example input: they are real tensors (the passes' full-size stand-ins of sharded experts
    # among them), and a graph Dynamo keeps without ever calling would keep them alive with it
    return FirstRun(compiled, lambda exc: _fall_back(exc, checkpoint, context, config, report, inner))


def _gradient_syncs(model: torch.nn.Module | None) -> list:
    """(ParallelInfo, GradientSync) of each module of ``model`` that ``moecompile.parallelize`` sharded."""
    return gradient_syncs(model.modules() if model is not None else ())


def _refuse_adapted_experts(model: torch.nn.Module | None, error: str) -> None:
    """Raise, naming them, where parameters were added to the experts of a sharded model in ``model``."""
    for info, sync in _gradient_syncs(model):
        added = sync.added_to_experts(info.module_list_experts)
        if added:
            raise MoECompileError(
                f"parameters were added to the experts of a model moecompile.parallelize sharded ({added[0]}"
                f"{f' and {len(added) - 1} more' if len(added) > 1 else ''}; peft's adapters on the experts, say), "
                f"and its trace failed ({error}): each rank holds some experts only, so nothing can run adapters "
                "on the others. Fix: adapt the attention alone (peft: target_modules without the experts' linears, "
                "no target_parameters on the experts), or train without moecompile.parallelize")


def _sync_new_parameters(model: torch.nn.Module | None) -> None:
    """Parameters added to or unfrozen in a model ``moecompile.parallelize`` sharded (Dynamo compiles again when
    they change) get their data-parallel gradient hooks now, before the backward that needs them
    (``moecompile/distributed/grads.py``, ``GradientSync.refresh``)."""
    for _, sync in _gradient_syncs(model):
        sync.refresh()


class FirstRun:
    """A rewritten graph's compiled callable, watched at its first call: if that raises, the graph as it came in
    from Dynamo runs instead (``_fall_back``: the failure reported, strict=True raises), from the random number
    state the failed call started with, and every later call goes to whichever ran. Forward only: a failure in the
    first backward raises where backward is called (the forward's saved state is gone by then). Out of memory is
    raised as it is: the next call is a first call again."""

    def __init__(self, compiled, fall_back):
        self.fn = compiled
        self.fall_back = fall_back  # None after the first call

    def __call__(self, *args):
        if self.fall_back is None:
            return self.fn(*args)
        rng = _rng_state()
        try:
            out = self.fn(*args)
        except torch.OutOfMemoryError:
            raise  # the device's limit, not the rewrite's doing: the next call runs the rewritten graph again
        except Exception as exc:
            fall_back, self.fall_back = self.fall_back, None
            self.fn = fall_back(exc)
            _set_rng_state(rng)
            return self.fn(*args)
        self.fall_back = None
        return out


def _fall_back(exc: Exception, checkpoint: Checkpoint, context, config: MoEOptions, report: PassReport, inner):
    """The graph as it came in, for a rewritten graph that raised at its first run: compiled by ``inner`` inside the
    context Dynamo traced it in (its fake tensors and symbolic sizes); where that raises or would need guards Dynamo
    did not install with the graph, or without Dynamo's fake inputs, it runs uncompiled (its own forward, as eager
    does)."""
    if config.strict:
        raise MoECompileError(f"the rewritten graph {checkpoint.index} raised at its first run: "
                              f"{type(exc).__name__}: {exc}") from exc
    gm = checkpoint.restore(report, "first_run", exc, config)
    shape_env = getattr(getattr(context, "fake_mode", None), "shape_env", None)
    guards = len(shape_env.guards) if shape_env is not None else 0
    fakes = [n.meta.get("example_value") for n in gm.graph.nodes if n.op == "placeholder"]
    if context is None or any(f is None for f in fakes):
        return gm.forward
    try:
        with torch._guards.tracing(context):
            compiled = inner(gm, fakes, config)
    except Exception:  # noqa: BLE001 - the failure is reported; the graph still runs, uncompiled
        return gm.forward
    if shape_env is not None and len(shape_env.guards) > guards:
        return gm.forward
    return compiled


def rewrite(gm, example_inputs, config: MoEOptions, report: PassReport,
            checkpoint: Checkpoint | None = None) -> fx.GraphModule:
    token = None
    if forms.TRAINING.get() is None:  # lower times forward+backward only for a training graph (explain sets it)
        token = forms.TRAINING.set(torch.is_grad_enabled())
    try:
        with torch.enable_grad():  # verify differentiates probes even when the model runs under no_grad
            return run_passes(gm, example_inputs, config, report, checkpoint)
    finally:
        if token is not None:
            forms.TRAINING.reset(token)


@contextlib.contextmanager
def _quiet_context_fn_note(active: bool):
    """Drop torch's note that a checkpoint's context_fn was passed (meant for the user's own: it asks them to keep
    in-place ops out of the region) while the regions compile whose policy ``checkpoint_exchanges="save"`` set:
    plain checkpointing takes the same path in torch 2.13, with every op recomputed."""
    def drop(record: logging.LogRecord) -> bool:
        return "context_fn is passed to torch.utils.checkpoint" not in record.getMessage()

    log = logging.getLogger("torch._higher_order_ops.wrap")
    if active:
        log.addFilter(drop)
    try:
        yield
    finally:
        log.removeFilter(drop)


def compile_inner(gm: fx.GraphModule, example_inputs, config: MoEOptions):
    """The graph after the passes, compiled by the inner compiler; Inductor with the settings of the option ``mode``
    (as torch.compile's own mode gives them: ``torch._inductor.list_mode_options``), then the option ``inductor``'s.
    Where backward gathers an expert domain's experts again (``reshard_after_forward``, checkpointed regions), the
    backward graph's gathers are started ahead first (``passes/regather.py``)."""
    regather = regathers(gm)
    if config.inner == "inductor":
        from torch._inductor.compile_fx import compile_fx

        settings = forms.inductor_settings(config)
        if regather:
            from torch._inductor import config as inductor_config

            users = settings.get("post_grad_custom_post_pass", inductor_config.post_grad_custom_post_pass)
            users = [] if users is None else list(users) if isinstance(users, (list, tuple)) else [users]
            settings["post_grad_custom_post_pass"] = [*users, RegathersEarly()]  # (after the user's own)
        return compile_fx(gm, example_inputs, config_patches=settings)
    from torch._dynamo.backends.registry import lookup_backend

    if not regather:
        return lookup_backend("aot_eager")(gm, example_inputs)
    from torch._dynamo.backends.debugging import boxed_nop

    def backward(bw: fx.GraphModule, inputs):  # aot_eager's own backward compiler, after the pass
        start_regathers_early(bw.graph)
        return boxed_nop(bw, inputs)

    return lookup_backend("aot_eager")(gm, example_inputs, bw_compiler=backward)


def run_uncompiled(gm: fx.GraphModule, example_inputs, config: MoEOptions):
    """An inner "compiler" that leaves the graph as it is: it runs as the passes return it (explain(), tests)."""
    return gm.forward


def _rng_state() -> tuple:
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    return torch.random.get_rng_state(), cuda


def _set_rng_state(state: tuple) -> None:
    torch.random.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state_all(state[1])
