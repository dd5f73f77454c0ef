"""Where the frame Dynamo traced sits in the model the user compiled, so that layers are named by their path in
that model (``model.layers.0.mlp``), not in the traced frame's module.

When a model's top-level ``forward`` breaks the graph (transformers with gradient checkpointing does), Dynamo traces
the inner modules' frames apart: the graph's module paths then start at the frame's ``self`` (``layers.0.mlp`` for
a graph of ``MixtralModel.forward``). ``frame_prefix`` finds that module's path in the model being run: the module
``torch.compile`` wrapped (the innermost ``OptimizedModule`` on the call stack), else the outermost module whose
method is on the stack. ``""`` when the frame is the model itself, is not a module's method, or is not found.
"""

from __future__ import annotations

import contextvars
import sys

import torch

# the model being run, where the caller knows it better than the call stack does: ``explain_calls`` traces a
# submodule alone (``moecompile/distributed/find_blocks.py``), with no frame of the model on the stack
RUNNING_MODEL: contextvars.ContextVar[torch.nn.Module | None] = contextvars.ContextVar("moe_running_model",
                                                                                     default=None)


def frame_prefix() -> tuple[str, str]:
    """The traced frame's ``self`` as a path in the model being run (see the module docstring) and its class name,
    or ("", "")."""
    try:  # Dynamo's translator of the frame being compiled (the backend runs while it traces)
        from torch._dynamo.symbolic_convert import InstructionTranslator

        tx = InstructionTranslator.current_tx()
        root = tx.f_locals.get("self") if tx is not None else None
    except Exception:  # a torch without it: the paths stay relative to the frame
        return "", ""
    if not isinstance(root, torch.nn.Module):
        return "", ""
    model = running_model()
    if model is None or model is root:
        return "", ""
    path = next((name for name, m in model.named_modules(remove_duplicate=False) if m is root), "")
    return path, type(root).__name__ if path else ""


def running_model() -> torch.nn.Module | None:
    """The model being run (see the module docstring), or None."""
    return RUNNING_MODEL.get() or _running_model()


def _running_model() -> torch.nn.Module | None:
    from torch._dynamo.eval_frame import OptimizedModule

    outer, frame = None, sys._getframe(1)
    while frame is not None:
        owner = frame.f_locals.get("self")
        if isinstance(owner, OptimizedModule):
            return owner._orig_mod
        if isinstance(owner, torch.nn.Module):
            outer = owner
        frame = frame.f_back
    return outer
