"""DistributedDataParallel's graph split after the MoE rewrite, not before it.

``torch.compile`` of a model wrapped in ``DistributedDataParallel`` hands the backend not Dynamo's graph but the
pieces DDP's gradient buckets cut it into (``torch._dynamo.backends.distributed.DDPOptimizer``, on while
``torch._dynamo.config.optimize_ddp`` is), so that each bucket's all-reduce starts as soon as the backward of its
piece is done. A cut inside an MoE block (the router in one piece, the experts in the next: one expert weight of a
real model outgrows DDP's 25 MB buckets) leaves the block in no one graph, and it ran as written, reported under a
wrong reason. For a backend carrying ``WHOLE`` (the moe backend, ``explain()``) the split moves after the passes:

    before: Dynamo's graph -> DDPOptimizer cuts it -> the backend per piece (blocks cut: left as written)
    after:  Dynamo's graph -> the backend's passes on the whole graph -> DDPOptimizer cuts the rewritten graph
            (the moe ops are nodes like any other) -> the inner compiler per piece

Why a wrapper: Dynamo builds the DDPOptimizer itself, around the backend, with no hook before its cut
(``convert_frame`` in torch 2.13); ``DDPOptimizer.compile_fn`` is wrapped once per process and changes nothing
for other backends. Where torch moves it, nothing is wrapped and DDP models compile as before (blocks cut by a
bucket are reported).
"""

from __future__ import annotations

import functools

import torch

from .capture import backend_kwargs

WHOLE = "moecompile_whole_graph"  # attribute of a backend: callable(gm, example_inputs, kwargs, split) -> compiled,
# where kwargs are torch.compile's (options=, mode=) and split(gm, example_inputs, compile_piece) is DDP's cut of
# gm with each piece compiled by compile_piece(piece, piece_inputs)
_WRAPPED = "moecompile_wrapped"


def install() -> None:
    """Wrap ``DDPOptimizer.compile_fn`` once per process (importing moecompile does it)."""
    try:
        from torch._dynamo.backends.distributed import DDPOptimizer
    except ImportError:  # a torch without it: DDP models compile as Dynamo gives them
        return
    original = getattr(DDPOptimizer, "compile_fn", None)
    if original is None or getattr(original, _WRAPPED, False):
        return

    @functools.wraps(original)
    def compile_fn(self, gm, example_inputs, **configs):
        whole, kwargs = backend_kwargs(self.backend_compile_fn, WHOLE)
        if not callable(whole):
            return original(self, gm, example_inputs, **configs)

        def split(graph, inputs, compile_piece):
            backend = self.backend_compile_fn
            self.backend_compile_fn = lambda piece, piece_inputs, **_: compile_piece(piece, piece_inputs)
            self.add_param_args = functools.partial(_add_listed_params, self)
            try:
                return original(self, graph, inputs, **configs)
            finally:
                self.backend_compile_fn = backend
                del self.add_param_args  # (the instance's: the class's method shows again)

        return whole(gm, example_inputs, kwargs, split)

    setattr(compile_fn, _WRAPPED, True)
    DDPOptimizer.compile_fn = compile_fn


def _add_listed_params(ddp_optimizer, bucket, node) -> None:
    """``DDPOptimizer.add_param_args`` that also counts parameters passed in a list (a ModuleList's expert weights
    to a moe op), which it would miss: its buckets then hold the experts' bytes, and cut where DDP's do."""
    for arg in _leaves(node.args):
        value = arg.meta.get("example_value") if arg.op == "placeholder" else None
        if isinstance(value, torch.nn.Parameter) and value.requires_grad and not ddp_optimizer._ignore_parameter(value):
            ddp_optimizer.add_param(bucket, value, str(arg.target))


def _leaves(args) -> list:
    """The fx nodes in ``args``, lists and tuples opened."""
    out: list = []
    torch.fx.node.map_arg(args, out.append)
    return out
