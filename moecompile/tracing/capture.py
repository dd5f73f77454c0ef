"""Let Dynamo capture data-dependent shapes while it traces for the moe backend, so expert loops stay in the graph.

    torch.compile(model, backend="moe")
      Dynamo compile-start callback  ->  compiling for moe with option capture on?  ->  turn on
                                          capture_dynamic_output_shape_ops, capture_scalar_outputs;
                                          swap provable nonzero() expert loops (loops.py)
      Dynamo traces the frame        ->  where(ids == e), x.split(counts.tolist()) stay in the graph (unbacked sizes)
      Dynamo compile-end callback    ->  put back the settings and the swapped code

Why callbacks: torch.compile in torch 2.13 gives a custom backend no hook around Dynamo's trace, and without the
two settings an expert loop breaks the graph before any backend sees the experts. ``install()`` (re)registers
the callbacks (``torch._dynamo.reset()`` removes them); ``capture()`` turns the settings on for a ``with`` block,
for any backend. Why the other ways fail, what happens if torch moves the hook, and what no setting captures:
``docs/detection.md``, Expert loops.
"""

from __future__ import annotations

import contextlib
import sys

import torch

from . import loops
from moecompile.passes.aliases import EAGER_EXPERTS_REASON

FLAGS = ("capture_dynamic_output_shape_ops", "capture_scalar_outputs")
MARK = "moecompile_capture"  # attribute of a backend: bool, or callable(options) -> bool


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
    options = None
    for _ in range(16):  # the wrapper chain is short; a cycle must not hang a compile
        if compiler is None:
            return False
        kwargs = getattr(compiler, "kwargs", None)  # torch.compile's _TorchCompileWrapper keeps options= here
        if isinstance(kwargs, dict) and "options" in kwargs:
            options = kwargs["options"]
        mark = getattr(compiler, MARK, None)
        if mark is not None:
            return bool(mark(options)) if callable(mark) else bool(mark)
        compiler = getattr(compiler, "_torchdynamo_orig_backend", None) or getattr(compiler, "compiler_fn", None)
    return False


def _compile_frame() -> dict:
    """The locals of Dynamo's ``convert_frame._compile`` running on this thread (found on the stack): its
    ``compiler_fn``, and the ``locals``, ``closure`` and ``globals`` of the frame it compiles; {} if none."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_globals.get("__name__") == "torch._dynamo.convert_frame" and "compiler_fn" in frame.f_code.co_varnames:
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
_swapped: list = []  # (function, original code) pairs of the loops rewritten for the compile running now


def compile_scope_start(args) -> None:
    """Dynamo compile-start callback: if it traces for the moe backend, capture data-dependent shapes and rewrite
    the nonzero() expert loops reachable from the frame (``loops.swap``) for this compile. Never raises
    (an error here would stop the user's compile); on any surprise nothing is turned on."""
    from torch._dynamo.callback import CallbackTrigger

    try:
        frame = _compile_frame()
        if args.callback_trigger != CallbackTrigger.DYNAMO or not wants_capture(frame.get("compiler_fn")):
            return
        scope = capture()
        scope.__enter__()
        _open.append(scope)
        loops.swap(_namespaces(frame), _swapped)
    except Exception:  # noqa: BLE001 - a missed capture is reported later with its fix; a crash here is not
        return


def compile_scope_end(args) -> None:
    """Dynamo compile-end callback: put back the settings and the code ``compile_scope_start`` changed."""
    loops.restore(_swapped)
    _swapped.clear()
    while _open:
        _open.pop().__exit__(None, None, None)


def install() -> None:
    """Register the two callbacks once per process (importing moecompile does it)."""
    handler = torch._dynamo.callback_handler
    if compile_scope_start not in handler.start_callbacks:
        handler.register_start_callback(compile_scope_start)
    if compile_scope_end not in handler.end_callbacks:
        handler.register_end_callback(compile_scope_end)


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

LOOP_REASON = (
    ", although Dynamo captured data-dependent shapes: the graph broke at the experts' loop. Most likely "
    + _NONZERO_LOOP
)


def complete_missing_experts(report) -> None:
    """Say why a graph holds a router and no experts, and the fix, from the capture settings it was traced with
    (the backend runs inside Dynamo's trace, so the settings read now are the trace's); and record the loops over
    ``nonzero()`` rows this trace ran rewritten (``report.loops``)."""
    why = LOOP_REASON if capturing() else CAPTURE_REASON
    if capturing():
        why += "".join(f"; {name}: {r.reason}" for name, r in loops.seen.items() if r.code is None and r.found)
        report.loops.update({name: r.where for name, r in loops.seen.items() if r.code is not None})
    for rec in report.skipped:
        if rec.reason == EAGER_EXPERTS_REASON:
            rec.reason += why
