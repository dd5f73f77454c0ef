"""Triton kernels of the canonical MoE ops, each module in threes: ``_name_kernel`` (``@triton.jit``), a host
``name()`` that checks shapes and picks the grid and configuration, and ``name_ref()`` in plain torch.

    router.py        fused router: scores, correction bias, group-limited top-k, renorm, scaling (+ backward)
    pft.py           padding-free token buffer on device: per-expert counts, prefix sums, stable permutation
    grouped_mlp.py   gather + grouped up GEMM + gated activation; down GEMM + weighted scatter-combine;
                     the persistent whole-layer forward kernel
    grouped_mlp_bwd.py  backward grouped GEMMs (input gradients) and the gather/scatter adjoints
    grouped_wgrad.py    the backward's weight-gradient kernel (dW[e] = A_e^T C_e over each expert's rows)
    combine.py       the deterministic combine (each token's k rows in k order) and its row inversion
beside them, not kernels in threes: ``grouped_common.py`` (the tile schedule over expert segments and the host
checks both grouped modules share), ``tiles.py`` (the tile-size rule and how a launch picks its tiles),
``tuning.py`` (timing candidates on the GPU, the cache on disk), ``vendor.py`` (each grouped GEMM role on
``torch._grouped_mm``, a candidate of the tuner), ``common.py`` (activations, dtypes, targets).

Every kernel module has ``compile_targets()``: each kernel with every configuration its launcher can pick,
which CI compiles for sm_90 (tests/test_kernels_compile.py).

May import: ``runtime``'s top-level modules (references, activations), never ``runtime.comm`` or
``runtime.placement``. Topic page: ``docs/triton-lowering.md``.

Import the kernels through ``load()``. Without CUDA they can only run in Triton's interpreter, which must be
switched on (``TRITON_INTERPRET=1``) before Triton's language module is first imported: ``load()`` does it when
it still can, and otherwise says how (building a transformers model imports Triton, so on CPU it is usually
too late: start Python with ``TRITON_INTERPRET=1`` in the environment).
"""

from __future__ import annotations

import importlib
import os

KERNEL_MODULES = ("router", "pft", "grouped_mlp", "grouped_mlp_bwd", "grouped_wgrad", "combine")


def load():
    """The kernel modules, imported (Triton's interpreter switched on first when there is no CUDA)."""
    import sys

    import torch

    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") != "1":
        if "triton.language" in sys.modules:
            raise RuntimeError(
                "moecompile's Triton kernels need CUDA, or Triton's interpreter on CPU, which must be switched on "
                "before Triton is imported: run Python with TRITON_INTERPRET=1 in the environment, or use "
                "lowering='torch' (or 'auto') on CPU"
            )
        os.environ["TRITON_INTERPRET"] = "1"
    return {name: importlib.import_module(f"{__name__}.{name}") for name in KERNEL_MODULES}
