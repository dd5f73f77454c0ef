"""Triton kernels of the canonical MoE ops, each module in threes: ``_name_kernel`` (``@triton.jit``), a host
``name()`` that checks shapes and picks the grid and configuration, and ``name_ref()`` in plain torch.

    router.py        fused router: scores, correction bias, group-limited top-k, renorm, scaling (+ backward)
    pft.py           padding-free token buffer on device: per-expert counts, prefix sums, stable permutation
    grouped_mlp.py   gather + grouped up GEMM + gated activation; down GEMM + weighted scatter-combine;
                     the persistent whole-layer forward kernel
    grouped_mlp_bwd.py  backward grouped GEMMs (input and weight gradients) and the gather/scatter adjoints

Every module has ``compile_targets()``: each kernel with every configuration its launcher can pick, which CI
compiles for sm_90 (tests/test_kernels_compile.py).

Import the kernels through ``load()``: on a machine without CUDA it turns on Triton's interpreter first (the
switch is read when the kernels are decorated), so the kernels run, slowly, on CPU tensors.
"""

from __future__ import annotations

import importlib
import os

KERNEL_MODULES = ("router", "pft", "grouped_mlp", "grouped_mlp_bwd")


def load():
    """The kernel modules, imported (interpreter mode first when there is no CUDA)."""
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    return {name: importlib.import_module(f"{__name__}.{name}") for name in KERNEL_MODULES}
