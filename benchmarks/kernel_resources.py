"""Registers, spills and shared memory of every Triton kernel configuration on the H100, without a GPU.

    python benchmarks/kernel_resources.py [router pft grouped_mlp grouped_mlp_bwd grouped_wgrad combine]
                                                                            (TRITON_INTERPRET unset)

Compiles each compile target of ``moecompile.runtime.kernels`` (the configurations the launchers pick, with the
argument specialisations of a launch at real sizes) for sm_90 and runs Triton's bundled ``ptxas -v`` on the PTX:
a kernel that spills registers or runs out of shared memory shows here before any GPU time is spent. Prints a
markdown table. Static figures: they say nothing of speed.
"""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
KEYS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "BLOCK_N1", "BLOCK_N2", "BLOCK_T", "BLOCK_E", "CHUNK", "GATED", "ACT", "KEPT",
        "STORE_PRE")


def resources(t) -> dict:
    fn, sig, consts = t[:3]
    options = t[3] if len(t) > 3 else {}
    attrs = t[4] if len(t) > 4 else None
    compiled = triton.compile(ASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", 90, 32), options=options)
    ptx = compiled.asm["ptx"]
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    out = subprocess.run([PTXAS, "-arch=sm_90a", "-v", f.name, "-o", os.devnull], capture_output=True, text=True)
    os.unlink(f.name)
    num = lambda pattern: int(m.group(1)) if (m := re.search(pattern, out.stderr)) else 0  # noqa: E731
    dtype = next((v for k, v in sig.items() if k.endswith("_ptr") and v[1:] in ("bf16", "fp16")), "*fp32")[1:]
    specialised = any(not fn.arg_names[i].endswith("_ptr") for (i,) in (attrs or {}))
    mma = "wgmma" if "wgmma" in ptx else ("mma" if "mma.sync" in ptx else "-")
    return dict(
        kernel=fn.__name__, dtype=dtype, config=" ".join(f"{k}={consts[k]}" for k in KEYS if k in consts),
        warps=options.get("num_warps", 4), stages=options.get("num_stages", 3),
        specialised="yes" if specialised else "no", regs=num(r"Used (\d+) registers"),
        spill=num(r"(\d+) bytes spill stores"), smem_kib=compiled.metadata.shared / 1024, mma=mma,
    )


def main(names) -> None:
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("unset TRITON_INTERPRET: the interpreter's kernels cannot be compiled")
    cols = ("kernel", "dtype", "config", "warps", "stages", "specialised", "regs", "spill", "smem_kib", "mma")
    print("| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    for name in names:
        for t in importlib.import_module(f"moecompile.runtime.kernels.{name}").compile_targets():
            r = resources(t)
            print("| " + " | ".join(f"{r[c]:.0f}" if c == "smem_kib" else str(r[c]) for c in cols) + " |", flush=True)


if __name__ == "__main__":
    from moecompile.runtime.kernels import KERNEL_MODULES

    main(sys.argv[1:] or list(KERNEL_MODULES))
