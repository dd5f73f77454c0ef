"""Let Dynamo capture data-dependent shapes while it traces, so expert loops stay in the graph.

MoE layers written as loops over the tokens each expert received (``idx = torch.where(ids == e)``,
``x.split(counts.tolist())``, transformers' jetmoe, megablocks-style code, an ``nn.ModuleList`` called in a loop
with ``index_add_``) make tensors whose size depends on the data. By default Dynamo stops the graph there (a graph
break): the router lands in one graph, the experts run outside any graph, and nothing can be rewritten. With
``capture_dynamic_output_shape_ops`` and ``capture_scalar_outputs`` on, Dynamo keeps such ops in the graph with
unbacked sizes, and the whole block reaches the backend.

``capture()`` turns both on for the duration of a ``with`` block and puts back what was there before (nothing
global is left changed). It is the ``moe`` backend's ``backend_ctx_ctor``, Dynamo's documented hook for a backend's
context: ``torch._dynamo.optimize("moe")`` and ``moecompile.explain`` enter it around every call of the compiled
model. ``torch.compile`` in torch 2.13 does not pass a backend's ``backend_ctx_ctor`` on (its
``_TorchCompileWrapper`` keeps only its own fields), so under ``torch.compile(model, backend="moe")`` the first call
(the one Dynamo traces) has to run inside ``with moecompile.capture():`` for such a model; the backend says so
when it meets the break (``CAPTURE_REASON``).

What no setting captures: a loop whose trip count is itself data-dependent, ``for e in mask.nonzero():`` over the
experts that received tokens (transformers' ``experts_implementation="eager"``, dbrx, longcat_flash). Dynamo
unrolls Python loops, and it cannot unroll a loop of unbacked length; the graph breaks at the ``for``
(``LOOP_REASON``).
"""

from __future__ import annotations

import contextlib

import torch

from moecompile.passes.aliases import EAGER_EXPERTS_REASON

FLAGS = ("capture_dynamic_output_shape_ops", "capture_scalar_outputs")


@contextlib.contextmanager
def capture():
    """Dynamo captures data-dependent output shapes (``nonzero``, ``where(mask)``) and ``.item()``/``.tolist()``
    inside this block; both settings are restored on exit."""
    with torch._dynamo.config.patch(**{flag: True for flag in FLAGS}):
        yield


def capturing() -> bool:
    """Whether Dynamo is capturing data-dependent shapes now (read while a graph is traced)."""
    return all(getattr(torch._dynamo.config, flag) for flag in FLAGS)


_NONZERO_LOOP = (
    "a loop over the experts that received tokens (`for e in mask.nonzero():`, as transformers' "
    "experts_implementation='eager', dbrx and longcat_flash do) has a data-dependent trip count, which Dynamo cannot "
    "unroll: for it, load the model with experts_implementation='grouped_mm' (the default) or set "
    "config._experts_implementation = 'grouped_mm' where the model has it, or loop over range(num_experts) (an "
    "expert with no tokens then does nothing)"
)

CAPTURE_REASON = (
    ": Dynamo broke the graph at a data-dependent shape (nonzero(), where(mask), .tolist()) before the experts, so "
    "they run outside it (torch.compile in torch 2.13 does not let a backend turn on capturing such shapes for its "
    "own trace). Fix: run the first call under `with moecompile.capture():`, which turns on "
    "torch._dynamo.config.capture_dynamic_output_shape_ops and capture_scalar_outputs for that block only; but "
    + _NONZERO_LOOP
)

LOOP_REASON = (
    ", although Dynamo captured data-dependent shapes: the graph broke at the experts' loop. Most likely "
    + _NONZERO_LOOP
)


def complete_missing_experts(report) -> None:
    """Say why a graph holds a router and no experts, and the fix, from the capture settings it was traced with
    (the backend runs inside Dynamo's trace, so the settings read now are the trace's)."""
    why = LOOP_REASON if capturing() else CAPTURE_REASON
    for rec in report.skipped:
        if rec.reason == EAGER_EXPERTS_REASON:
            rec.reason += why
