"""CUDA's autograd threading, on CPU: every backward runs on a thread of its own, as the autograd engine runs a
CUDA graph's backward on a device thread while the calling thread waits. On CPU the engine runs backward on the
caller's thread, so code that holds a lock (Dynamo's ``compile_lock`` while the user's graph compiles) and runs a
backward needing that lock passes on CPU and hangs on CUDA (an H200, 2026-11-27: ``lowering="auto"`` timed the
original under Inductor, whose backward compiled at its first call).

A backward started while tracing (a dispatch or torch-function mode, functorch transforms: AOTAutograd's joint
graph) stays on the caller's thread: the engine copies the caller's thread-local state to its threads, which a
Python thread cannot."""

from __future__ import annotations

import contextlib
import threading

import torch
import torch.autograd as autograd
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack


def _tracing() -> bool:
    return bool(_get_current_dispatch_mode_stack()) or torch._C._is_torch_function_mode_enabled() \
        or torch._C._functorch.maybe_current_level() is not None


@contextlib.contextmanager
def backward_on_a_device_thread(timeout_s: float = 60.0):
    """Within it, a backward that has not finished in ``timeout_s`` raises TimeoutError in the caller (the
    thread is left to finish once whatever it waits for is free: it is a daemon)."""
    real = autograd._engine_run_backward

    def on_a_thread(*args, **kwargs):
        if _tracing():
            return real(*args, **kwargs)
        box: dict = {}

        def run():
            try:
                box["out"] = real(*args, **kwargs)
            except BaseException as exc:  # noqa: BLE001 - raised again in the caller
                box["error"] = exc

        worker = threading.Thread(target=run, daemon=True, name="emulated CUDA autograd thread")
        worker.start()
        worker.join(timeout_s)
        if worker.is_alive():
            raise TimeoutError(f"a backward on its device thread did not finish in {timeout_s:g} s")
        if "error" in box:
            raise box["error"]
        return box.get("out")

    autograd._engine_run_backward = on_a_thread
    try:
        yield
    finally:
        autograd._engine_run_backward = real
