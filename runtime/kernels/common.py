"""What the Triton kernels share: where they may run, the activation math, shape checks, launch configurations.

Interpreter. Without CUDA, Triton runs kernels in its interpreter when ``TRITON_INTERPRET=1`` is set before
``triton.language`` is first imported (see ``moecompile.runtime.kernels.load``); it exists to prove the kernels
on CPU, not to be fast.
"""

from __future__ import annotations

import contextlib
import os
import threading

import torch
import triton
import triton.language as tl

# Activation codes (constexpr ACT of the expert kernels); names are those of runtime/activations.py.
ACT_CODES = {"silu": 0, "gelu": 1, "gelu_tanh": 2, "relu": 3, "relu2": 4, "swiglu_clamp": 5, "swiglu_softcap": 6,
             "silu_clamp": 7}


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


_COMPILE_ONLY = threading.local()  # .on: this thread's launches compile their kernel and run nothing


def launch_kernel(kernel, grid, *args, **kwargs):
    """``kernel[grid](*args, **kwargs)``; on a thread inside ``compiling_only()``, the kernel's compile alone
    (Triton's ``warmup``: nothing runs)."""
    if getattr(_COMPILE_ONLY, "on", False):
        return kernel.warmup(*args, grid=grid, **kwargs)
    return kernel[grid](*args, **kwargs)


@contextlib.contextmanager
def compiling_only():
    """On this thread, ``launch_kernel`` compiles and launches nothing (the tuner compiles its candidates at once
    before it times them one after the other: ``tuning.precompile``)."""
    _COMPILE_ONLY.on = True
    try:
        yield
    finally:
        _COMPILE_ONLY.on = False


def check_device(*tensors: torch.Tensor | None) -> None:
    """Kernels run on CUDA tensors, or on CPU tensors under the interpreter; all on one device."""
    devices = {t.device for t in tensors if t is not None}
    if len(devices) > 1:
        raise ValueError(f"moecompile Triton kernels got tensors on several devices: {sorted(map(str, devices))}")
    device = devices.pop()
    if device.type == "cpu" and not interpreting():
        raise ValueError(
            "moecompile Triton kernels got CPU tensors but Triton is not in interpreter mode; use "
            "lowering='torch' on CPU, or start Python with TRITON_INTERPRET=1 in the environment"
        )
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"moecompile Triton kernels run on CUDA (or CPU under the interpreter), not {device}")


def check_shape(name: str, t: torch.Tensor | None, shape: tuple) -> None:
    if t is not None and tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {tuple(shape)}")


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs multiply in full precision ("ieee"), as torch's default fp32 matmul does (no TF32)."""
    return "ieee" if dtype == torch.float32 else "tf32"


def pow2(n: int, lo: int = 16) -> int:
    return max(lo, triton.next_power_of_2(int(n)))


@triton.jit
def _sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def _tanh(x):
    return 2.0 * _sigmoid(2.0 * x) - 1.0


@triton.jit
def act_fwd(g, u, ACT: tl.constexpr, alpha, limit):
    """The expert's hidden activation from fp32 gate ``g`` and up ``u`` tiles (``g`` unused when ungated:
    the ungated activations read ``u``)."""
    if ACT == 0:  # silu(g) * u
        h = g * _sigmoid(g) * u
    elif ACT == 1:  # gelu(g) * u (or gelu(u) ungated: the launcher passes u as g and ones as u)
        h = 0.5 * g * (1.0 + tl.math.erf(g * 0.7071067811865476)) * u
    elif ACT == 2:  # tanh approximation: sqrt(2/pi) * (g + 0.044715 g^3)
        h = 0.5 * g * (1.0 + _tanh(0.7978845608028654 * (g + 0.044715 * g * g * g))) * u
    elif ACT == 3:
        h = tl.maximum(g, 0.0) * u
    elif ACT == 4:
        r = tl.maximum(g, 0.0)
        h = r * r * u
    elif ACT == 5:  # GPT-OSS: (clamp(u) + 1) * gc * sigmoid(alpha * gc), gc = min(g, limit)
        gc = tl.minimum(g, limit)
        uc = tl.minimum(tl.maximum(u, -limit), limit)
        h = (uc + 1.0) * gc * _sigmoid(alpha * gc)
    elif ACT == 7:  # DeepSeek-V4: silu(min(g, limit)) * clamp(u, -limit, limit)
        gc = tl.minimum(g, limit)
        h = gc * _sigmoid(gc) * tl.minimum(tl.maximum(u, -limit), limit)
    else:  # Inkling2: alpha tanh(g / alpha) * sigmoid(g) * limit tanh(u / limit)
        h = _tanh(g / alpha) * alpha * _sigmoid(g) * (_tanh(u / limit) * limit)
    return h


@triton.jit
def act_bwd(g, u, dh, ACT: tl.constexpr, alpha, limit):
    """Gradients (dg, du) of ``act_fwd`` given the output gradient ``dh``, all fp32."""
    if ACT == 0:
        s = _sigmoid(g)
        a = g * s
        dg = dh * u * (s + a * (1.0 - s))
        du = dh * a
    elif ACT == 1:
        cdf = 0.5 * (1.0 + tl.math.erf(g * 0.7071067811865476))
        pdf = 0.3989422804014327 * tl.exp(-0.5 * g * g)
        dg = dh * u * (cdf + g * pdf)
        du = dh * g * cdf
    elif ACT == 2:
        inner = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        t = _tanh(inner)
        dinner = 0.7978845608028654 * (1.0 + 3.0 * 0.044715 * g * g)
        dg = dh * u * (0.5 * (1.0 + t) + 0.5 * g * (1.0 - t * t) * dinner)
        du = dh * 0.5 * g * (1.0 + t)
    elif ACT == 3:
        dg = tl.where(g > 0.0, dh * u, 0.0)
        du = dh * tl.maximum(g, 0.0)
    elif ACT == 4:
        r = tl.maximum(g, 0.0)
        dg = dh * u * 2.0 * r
        du = dh * r * r
    elif ACT == 5:
        gc = tl.minimum(g, limit)
        uc = tl.minimum(tl.maximum(u, -limit), limit)
        s = _sigmoid(alpha * gc)
        glu = gc * s
        dgc = dh * (uc + 1.0) * (s + alpha * glu * (1.0 - s))
        dg = tl.where(g <= limit, dgc, 0.0)  # torch.clamp passes the gradient at the bound
        du = tl.where((u >= -limit) & (u <= limit), dh * glu, 0.0)
    elif ACT == 7:
        gc = tl.minimum(g, limit)
        uc = tl.minimum(tl.maximum(u, -limit), limit)
        s = _sigmoid(gc)
        a = gc * s
        dg = tl.where(g <= limit, dh * uc * (s + a * (1.0 - s)), 0.0)
        du = tl.where((u >= -limit) & (u <= limit), dh * a, 0.0)
    else:
        tg = _tanh(g / alpha)
        tu = _tanh(u / limit)
        s = _sigmoid(g)
        capped_u = tu * limit
        dg = dh * capped_u * ((1.0 - tg * tg) * s + tg * alpha * s * (1.0 - s))
        du = dh * tg * alpha * s * (1.0 - tu * tu)
    return dg, du


TRITON_TYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.int64: "i64",
                torch.int32: "i32"}


def target(fn, ptr_dtypes: dict, constexprs: dict, default_ptr=torch.float32, floats=("alpha", "limit"),
           unit=(), aligned=(), **options):
    """A compile target (fn, signature, constexprs, options, attrs) for ``tests/test_kernels_compile.py``:
    pointers named ``*_ptr`` get their dtype from ``ptr_dtypes`` (else ``default_ptr``), ``floats`` are fp32
    scalars, other scalars i32. As a GPU launch specialises its arguments, the integers named in ``unit`` become
    the constant 1 (unit inner strides of contiguous tensors) and every pointer and the integers in ``aligned``
    are marked divisible by 16 (what real model widths and strides are): that is the code a launch at real
    sizes compiles, with its software pipelining and vector loads."""
    sig, attrs = {}, {}
    consts = dict(constexprs)
    for i, name in enumerate(fn.arg_names):
        if name in consts:
            sig[name] = "constexpr"
        elif name in unit:
            sig[name], consts[name] = "constexpr", 1
        elif name.endswith("_ptr"):
            sig[name] = "*" + TRITON_TYPES[ptr_dtypes.get(name, default_ptr)]
            attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            sig[name] = "fp32" if name in floats else "i32"
            if name in aligned:
                attrs[(i,)] = [["tt.divisibility", 16]]
    return fn, sig, consts, options, attrs
