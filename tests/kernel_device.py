"""Where the kernel tests run the kernels: on CPU under Triton's interpreter (TRITON_INTERPRET=1, set by conftest),
on CUDA when the kernels are compiled (TRITON_INTERPRET=0 on a GPU machine: benchmarks/gpu_check.py). The inputs
are made on the CPU and the references run there; only the kernel calls move to DEV and back. A compiled kernel
refuses CPU tensors (runtime/kernels/common.check_device), so a test that called them with CPU tensors failed
on CUDA for that reason alone."""

import torch

from moecompile.runtime.kernels.common import interpreting

DEV = "cuda" if torch.cuda.is_available() and not interpreting() else "cpu"


def on_device(fn, *args, **kwargs):
    """``fn`` with its tensor arguments on DEV; its tensor results (also inside a tuple) back on the CPU."""
    move = lambda v, dev: v.to(dev) if isinstance(v, torch.Tensor) else v  # noqa: E731
    out = fn(*[move(a, DEV) for a in args], **{k: move(v, DEV) for k, v in kwargs.items()})
    return tuple(move(o, "cpu") for o in out) if isinstance(out, tuple) else move(out, "cpu")
