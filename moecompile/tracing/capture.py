"""Let Dynamo capture data-dependent shapes while it traces for the moe backend, so expert loops stay in the graph.

    torch.compile(model, backend="moe")
      Dynamo compile-start callback  ->  compiling for moe with option capture on?  ->  turn on
                                          capture_dynamic_output_shape_ops, capture_scalar_outputs;
                                          give provable expert loops code that runs them rewritten while a
                                          compiler traces (loops.py; kept after: eager runs them as written)
      Dynamo traces the frame        ->  where(ids == e), x.split(counts.tolist()) stay in the graph (unbacked sizes)
        the trace fails with them on ->  put back the settings; Dynamo traces the frame again with its
                                          defaults (RestartAnalysis), and the frame is listed in ``retraced``
      Dynamo compile-end callback    ->  put back the settings

Why callbacks: torch.compile in torch 2.13 gives a custom backend no hook around Dynamo's trace, and without the two
settings an expert loop breaks the graph before any backend sees the experts. ``install()`` registers the callbacks,
and again whenever ``torch._dynamo.reset()`` clears them; ``capture()`` turns the settings on for a ``with`` block,
for any backend. A trace that fails only because the settings are on (``.tolist()`` of a tensor whose length depends
on the data) is traced again with Dynamo's defaults: Dynamo's ``convert_frame.trace_frame`` is wrapped for the moe
compiles only, and raises Dynamo's own ``RestartAnalysis`` after putting the settings back. Why the other ways fail,
what happens if torch moves the hooks, and what no setting captures: ``docs/detection.md``, Expert loops.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import types

import torch

from . import loops
from moecompile.passes.aliases import EAGER_EXPERTS_REASON

FLAGS = ("capture_dynamic_output_shape_ops", "capture_scalar_outputs")
MARK = "moecompile_capture"  # attribute of a backend: bool, or callable(options) -> bool
RETRACE = "moecompile_retrace"  # attribute of a backend: callable(options, where, error) -> None, called when a
# trace for it failed with the settings on, before Dynamo traces the frame again with its defaults; it may raise


@contextlib.contextmanager
def capture():
    """Dynamo captures data-dependent output shapes (``nonzero``, ``where(mask)``) and ``.item()``/``.tolist()``
    inside this block; both settings are restored on exit."""
    with torch._dynamo.config.patch(**{flag: True for flag in FLAGS}):
        yield


def capturing() -> bool:
    """Whether Dynamo is capturing data-dependent shapes now (read while a graph is traced)."""
    return all(getattr(torch._dynamo.config, flag) for flag in FLAGS)


def wants_capture(compiler) -> bool:
    """Whether ``compiler`` (as Dynamo holds it: its debug and torch.compile wrappers included) is a backend that
    asks for capture: one carrying ``MARK``, given the ``options`` torch.compile passes it."""
    mark, options = _backend_attribute(compiler, MARK)
    return bool(mark(options)) if callable(mark) else bool(mark)


def _backend_attribute(compiler, name: str) -> tuple:
    """(attribute ``name`` of the backend that ``compiler`` wraps or None, the ``options`` torch.compile passes it)."""
    value, kwargs = backend_kwargs(compiler, name)
    return value, kwargs.get("options")


def backend_kwargs(compiler, name: str) -> tuple:
    """(attribute ``name`` of the backend that ``compiler`` wraps or None, the keyword arguments torch.compile
    passes it: ``options=`` and ``mode=``). The chain walked: Dynamo's debug wrappers, torch.compile's wrapper,
    and a DDP model's ``DDPOptimizer.compile_fn`` (its ``backend_compile_fn``)."""
    kwargs: dict = {}
    for _ in range(16):  # the wrapper chain is short; a cycle must not hang a compile
        if compiler is None:
            break
        held = getattr(compiler, "kwargs", None)  # torch.compile's _TorchCompileWrapper keeps options= here
        if isinstance(held, dict):
            kwargs.update({k: held[k] for k in ("options", "mode") if k in held})
        value = getattr(compiler, name, None)
        if value is not None:
            return value, kwargs
        compiler = getattr(compiler, "_torchdynamo_orig_backend", None) or getattr(compiler, "compiler_fn", None) \
            or getattr(getattr(compiler, "__self__", None), "backend_compile_fn", None)
    return None, kwargs


def _compile_frame() -> dict:
    """The locals of Dynamo's ``convert_frame._compile`` running on this thread (found on the stack): its
    ``compiler_fn``, and the ``locals``, ``closure`` and ``globals`` of the frame it compiles; {} if none."""
    frame = sys._getframe(1)
    while frame is not None:
        if (frame.f_globals.get("__name__") == "torch._dynamo.convert_frame"
                and "compiler_fn" in frame.f_code.co_varnames):
            return frame.f_locals
        frame = frame.f_back
    return {}


def _compiler_being_traced_for():
    """The ``compiler_fn`` of the Dynamo compile running on this thread (found on the stack), or None."""
    return _compile_frame().get("compiler_fn")


def _namespaces(compile_locals: dict) -> list:
    """The values the frame being compiled can reach directly: its locals, its closure's cells, its globals."""
    cells = []
    for cell in compile_locals.get("closure") or ():
        try:
            cells.append(cell.cell_contents)
        except ValueError:  # an empty cell
            pass
    return [(compile_locals.get("locals") or {}).values(), cells, (compile_locals.get("globals") or {}).values()]


_open: list[contextlib.AbstractContextManager] = []
_patched: list = []  # (convert_frame module, its trace_frame) while the compile running now may trace again
_retracing: list[str] = []  # the error of the capture-on trace, while the compile running now traces again
retraced: dict[str, str] = {}  # "fn (file:line)" -> the error of its capture-on trace, for every frame traced again
# with Dynamo's defaults (explain() clears and reads it)


def compile_scope_start(args) -> None:
    """Dynamo compile-start callback: if it traces for the moe backend, capture data-dependent shapes for this
    compile, rewrite the expert loops reachable from the frame (``loops.swap``: for good, run rewritten only while a
    compiler traces), and have a trace that fails so traced again with Dynamo's defaults. Never raises (an error
    here would stop the user's compile); on any surprise nothing is turned on."""
    from torch._dynamo.callback import CallbackTrigger

    _retracing.clear()
    try:
        frame = _compile_frame()
        if args.callback_trigger != CallbackTrigger.DYNAMO or not wants_capture(frame.get("compiler_fn")):
            return
        scope = capture()
        scope.__enter__()
        _open.append(scope)
        _retrace_on_failure()
        loops.swap(_namespaces(frame))
    except Exception:  # noqa: BLE001 - a missed capture is reported later with its fix; a crash here is not
        return


def compile_scope_end(args) -> None:
    """Dynamo compile-end callback: put back the settings ``compile_scope_start`` changed."""
    _stop_capture()
    _retracing.clear()


def _stop_capture() -> None:
    while _open:
        _open.pop().__exit__(None, None, None)
    while _patched:
        module, trace_frame = _patched.pop()
        module.trace_frame = trace_frame


def _retrace_on_failure() -> None:
    """Wrap Dynamo's ``convert_frame.trace_frame`` (one trace attempt of the frame) for this compile: an attempt that
    fails with the settings on puts them back and raises ``RestartAnalysis``, on which Dynamo's own loop traces the
    frame again, now with its defaults. Dynamo's control flow, a frame it gives up on (run eagerly: the program goes
    on) and the backend's own errors (``strict=True``) pass through. Without ``trace_frame`` nothing is wrapped."""
    from torch._dynamo import convert_frame, exc as dynamo_exc, symbolic_convert

    trace_frame = getattr(convert_frame, "trace_frame", None)
    if trace_frame is None:
        return
    passes = (dynamo_exc.RestartAnalysis, dynamo_exc.SkipFrame, dynamo_exc.Unsupported, dynamo_exc.UserError,
              dynamo_exc.BackendCompilerFailed)
    speculation_log = getattr(symbolic_convert, "SpeculationLog", ())

    @functools.wraps(trace_frame)
    def trace_or_retrace(*args, **kwargs):
        try:
            return trace_frame(*args, **kwargs)
        except passes:
            raise
        except Exception as exc:
            if not _open:
                raise
            values = (*args, *kwargs.values())
            code = next((v for v in values if isinstance(v, types.CodeType)), None)
            where, error = _where(exc, code), _first_line(exc)
            compiler = _compile_frame().get("compiler_fn")
            policy, options = _backend_attribute(compiler, RETRACE)
            if callable(policy):
                try:
                    policy(options, where, error)
                except Exception as refused:  # strict=True: raised as Dynamo raises a backend's error
                    raise dynamo_exc.BackendCompilerFailed(compiler, refused, None) from exc
            _stop_capture()
            _retracing.append(error)
            retraced[where] = error
            for log in (v for v in values if isinstance(v, speculation_log)):
                log.clear()  # what this attempt recorded: the next one may break the graph where this one did not
            raise dynamo_exc.RestartAnalysis(restart_reason=f"moecompile: trace again with Dynamo's defaults "
                                                            f"({error})") from exc

    _patched.append((convert_frame, trace_frame))
    convert_frame.trace_frame = trace_or_retrace


def _where(exc: Exception, code) -> str:
    """The user's line the trace failed at (Dynamo's ``real_stack`` of the error), else the frame's first line."""
    stack = getattr(exc, "real_stack", None) or ()
    if stack:
        return f"{stack[-1].name} ({stack[-1].filename}:{stack[-1].lineno})"
    if code is not None:
        return f"{code.co_name} ({code.co_filename}:{code.co_firstlineno})"
    return "a frame"


def _first_line(exc: Exception, n: int = 200) -> str:
    line = next((ln.strip() for ln in str(exc).splitlines() if ln.strip()), "")
    text = " ".join(f"{type(exc).__name__}: {line}".split())
    return text if len(text) <= n else text[: n - 1] + "…"


def install() -> None:
    """Register the two callbacks once per process (importing moecompile does it), and again whenever Dynamo's
    callbacks are cleared: ``torch._dynamo.reset()`` clears them (to a fresh process's state, in which moecompile,
    imported, has them), and a compile right after it would trace without capture; a sharded layer's exchange could
    not even be compiled then (its rows' count is data-dependent)."""
    handler = torch._dynamo.callback_handler
    if compile_scope_start not in handler.start_callbacks:
        handler.register_start_callback(compile_scope_start)
    if compile_scope_end not in handler.end_callbacks:
        handler.register_end_callback(compile_scope_end)
    clear = handler.clear
    if not getattr(clear, "_moecompile_installs", False):
        @functools.wraps(clear)
        def clear_and_install() -> None:
            clear()
            install()

        clear_and_install._moecompile_installs = True
        handler.clear = clear_and_install  # (on the instance: torch's class is left as it is)


_NONZERO_LOOP = (
    "a loop over the experts that received tokens (`for e in mask.nonzero():`, as transformers' "
    "experts_implementation='eager' does) has a data-dependent trip count, which Dynamo cannot unroll, and "
    "moecompile could not prove its rewrite into a loop over every expert (moecompile/tracing/loops.py): for it, "
    "load the model with experts_implementation='grouped_mm' (the default) or set config._experts_implementation = "
    "'grouped_mm' where the model has it, or loop over range(num_experts) (an expert with no tokens then does "
    "nothing)"
)

CAPTURE_REASON = (
    ": Dynamo broke the graph at a data-dependent shape (nonzero(), where(mask), .tolist()) before the experts, so "
    "they run outside it, because it traced without capturing such shapes. Fix: leave the backend option capture "
    "at True (the default: the moe backend turns on torch._dynamo.config.capture_dynamic_output_shape_ops and "
    "capture_scalar_outputs for its own compiles), or, for a backend of your own around moe_backend, run the first "
    "call under `with moecompile.capture():`; but "
    + _NONZERO_LOOP
)

RETRACE_REASON = (
    ": Dynamo broke the graph at a data-dependent shape (nonzero(), where(mask), .tolist()) before the experts, so "
    "they run outside it: its trace with such shapes captured failed ({error}), and the moe backend traced the frame "
    "again with Dynamo's defaults so that the program runs. Fix: write the line it failed at so that its sizes have "
    "a length Dynamo knows (counts from F.one_hot(ids, E).sum(0), not torch.bincount(ids, minlength=E), whose "
    "length depends on the data: docs/detection.md, Expert loops); options={{'strict': True}} raises at the failure"
)

LOOP_REASON = (
    ", although Dynamo captured data-dependent shapes: the graph broke at the experts' loop. Most likely "
    + _NONZERO_LOOP
)


PARAMETRIZED_REASON = (
    ": the graph broke before its experts ran, at {where} ({what}): their weights are parametrized at every call "
    "(torch.nn.utils.parametrize registered in forward, as peft's LoRA on the experts' stacked parameters, "
    "target_parameters, does), which Dynamo cannot trace, so the experts run as written outside every graph. Fix: "
    "adapt the attention or other linears instead (peft: target_modules), or merge the adapters into the weights "
    "(merge_and_unload) to serve the model"
)


def _break_ending_graph() -> tuple[str, str, bool] | None:
    """(Dynamo's reason, where, whether a parametrization is being registered) of the graph break that ends the
    graph being compiled now, or None (the frame ended, or no trace is running)."""
    from torch._dynamo.symbolic_convert import InstructionTranslator

    try:
        tx = InstructionTranslator.current_tx()
    except (AttributeError, IndexError, RuntimeError):
        return None
    why = getattr(getattr(tx, "output", None), "compile_subgraph_reason", None)
    if why is None or not why.graph_break or not why.user_stack:
        return None
    files = [frame.filename.replace("\\", "/") for frame in why.user_stack]
    where = f"{files[-1].split('site-packages/')[-1]}:{why.user_stack[-1].lineno}"
    return why.reason.splitlines()[0], where, any(f.endswith("torch/nn/utils/parametrize.py") for f in files)


def complete_missing_experts(report) -> None:
    """Say why a graph holds a router and no experts, and the fix, from the capture settings it was traced with
    (the backend runs inside Dynamo's trace, so the settings read now are the trace's, and so is ``_retracing``: a
    trace again after one with the settings failed); and record the loops over ``nonzero()`` rows this trace ran
    rewritten (``report.loops``)."""
    why = LOOP_REASON if capturing() else CAPTURE_REASON
    if _retracing:  # this frame's trace with capture failed: it is traced again with Dynamo's defaults
        why = RETRACE_REASON.format(error=_retracing[-1])
    if capturing():
        why += "".join(f"; {name}: {r.reason}" for name, r in loops.seen.items() if r.code is None and r.found)
        report.loops.update({name: r.where for name, r in loops.seen.items() if r.code is not None})
    cut = _break_ending_graph()
    if cut is not None and cut[2]:  # not a loop: the weights' parametrization (peft's target_parameters)
        why = PARAMETRIZED_REASON.format(what=cut[0], where=cut[1])
    for rec in report.skipped:
        if rec.reason == EAGER_EXPERTS_REASON:
            rec.reason += why
