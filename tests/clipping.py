"""Gradient clipping checked against one process, for the multi-process training tests: each step clips both
models to half the one-process norm (so clipping acts), in turn by the 2-, 1- and inf-norm, and the norm returned
on the rank must be the one-process norm."""

import torch

import moecompile

NORMS = (2.0, 1.0, float("inf"))


def clip_as_one_process(model, ref, step: int, optimizer=None) -> None:
    """``moecompile.clip_grad_norm_(model, ...)`` (``optimizer.clip_grad_norm_`` for an ExpertOptimizer) beside
    ``torch.nn.utils.clip_grad_norm_`` of the one-process ``ref``, at the step's norm type."""
    norm_type = NORMS[step % len(NORMS)]
    max_norm = 0.5 * float(torch.nn.utils.get_total_norm([p.grad for p in ref.parameters() if p.grad is not None],
                                                         norm_type))
    if optimizer is not None:
        got = optimizer.clip_grad_norm_(max_norm, norm_type)
    else:
        got = moecompile.clip_grad_norm_(model, max_norm, norm_type)
    want = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm, norm_type)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=lambda m: f"norm {norm_type} step {step}: {m}")
