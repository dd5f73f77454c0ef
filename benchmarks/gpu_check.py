"""Every GPU check in one command, one markdown report: run it first whenever a GPU is at hand.

    python benchmarks/gpu_check.py --out benchmarks/gpu_check.md        # on a CUDA machine; about 20 minutes
    python benchmarks/gpu_check.py --dry-run                            # the steps and their commands, run nothing

Steps, each a child process with its own time limit (the whole run stops starting steps past ``--budget-min``):

    kernels        the Triton kernel tests compiled on CUDA (TRITON_INTERPRET=0): every kernel against its reference,
                   bitwise determinism of forward and backward, the compile of every tile configuration, tuning
    parity         every family of the walk on CUDA, fp32 and bf16, compiled against eager (benchmarks/gpu_parity.py)
    ep             expert parallelism, dedup="node" and replication="adaptive" on 4 gloo ranks sharing the GPU, two
                   training steps against one process (benchmarks/gpu_ep.py)
    layer          one MoE layer at real widths, T = 4096 and 16384: eager, Inductor, moe (benchmarks/bench_gpu.py)
    layer-decode   the same at T = 16 and 256
    gemms          each grouped GEMM of the kernels against torch._grouped_mm (benchmarks/bench_kernels.py)
    gemms-decode   the same, forward only, at decode token counts

The report has the date, the device, the versions and the commit, a table of the steps (passed, failed, timed
out, not run) and each step's tables or the end of its output.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
KERNEL_TESTS = ["tests/test_kernels_grouped.py", "tests/test_kernels_vendor.py", "tests/test_kernels_pft.py",
                "tests/test_kernels_router.py", "tests/test_kernels_compile.py", "tests/test_tuning.py"]


@dataclass
class Step:
    name: str
    what: str
    argv: list[str]  # "{dir}" is the folder of the step's own report files
    timeout_s: int
    env: dict = field(default_factory=dict)
    out: str = ""  # a markdown file the step writes into {dir}, pasted into the report


STEPS = [
    Step("kernels", "Triton kernel tests compiled on CUDA (bitwise determinism included)",
         [PY, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0", *KERNEL_TESTS], 360,
         {"TRITON_INTERPRET": "0"}),
    Step("parity", "every walk family on CUDA, fp32 and bf16, against eager",
         [PY, "benchmarks/gpu_parity.py", "--device", "cuda", "--moe-option", "inner=aot_eager", "--out",
          "{dir}/parity.md"], 420, out="parity.md"),
    Step("ep", "expert parallelism, dedup and replication on 4 gloo ranks sharing the GPU, against one process",
         [PY, "benchmarks/gpu_ep.py", "--device", "cuda", "--out", "{dir}/ep.md"], 300, out="ep.md"),
    Step("layer", "one layer at real widths, T = 4096, 16384",
         [PY, "benchmarks/bench_gpu.py", "--tokens", "4096,16384", "--out", "{dir}/layer.md"], 300, out="layer.md"),
    Step("layer-decode", "one layer, T = 16, 256",
         [PY, "benchmarks/bench_gpu.py", "--tokens", "16,256", "--out", "{dir}/decode.md"], 120, out="decode.md"),
    Step("gemms", "each grouped GEMM against torch._grouped_mm",
         [PY, "benchmarks/bench_kernels.py", "--out", "{dir}/gemms.md"], 180, out="gemms.md"),
    Step("gemms-decode", "the grouped GEMMs at decode token counts",
         [PY, "benchmarks/bench_kernels.py", "--decode", "--out", "{dir}/gemms_decode.md"], 90,
         out="gemms_decode.md"),
]


@dataclass
class Result:
    step: Step
    status: str  # passed | failed | timed out | not run
    seconds: float = 0.0
    tail: str = ""
    tables: str = ""


def run_step(step: Step, folder: Path, limit_s: float) -> Result:
    argv = [a.replace("{dir}", str(folder)) for a in step.argv]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(argv, cwd=ROOT, env={**os.environ, **step.env}, capture_output=True, text=True,
                              timeout=min(step.timeout_s, limit_s))
        status, output = ("passed" if proc.returncode == 0 else f"failed (exit {proc.returncode})",
                          proc.stdout + proc.stderr)
    except subprocess.TimeoutExpired as exc:
        status = f"timed out ({min(step.timeout_s, limit_s):.0f} s)"
        output = "".join(o.decode(errors="replace") if isinstance(o, bytes) else (o or "")
                         for o in (exc.stdout, exc.stderr))
    seconds = time.perf_counter() - t0
    tables = (folder / step.out).read_text() if step.out and (folder / step.out).exists() else ""
    return Result(step, status, seconds, "\n".join(output.strip().splitlines()[-40:]), tables)


def header(device: str) -> list[str]:
    import torch

    versions = [f"torch {torch.__version__}", f"python {platform.python_version()}"]
    for name in ("triton", "transformers"):
        try:
            versions.append(f"{name} {__import__(name).__version__}")
        except ImportError:
            versions.append(f"{name} not installed")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return [f"# GPU check, {datetime.date.today().isoformat()}", "",
            f"- device: {device}", f"- versions: {', '.join(versions)}",
            f"- commit: {commit.stdout.strip() or 'unknown'}", "- command: `python benchmarks/gpu_check.py`"]


def report(results: list[Result], device: str, total_s: float) -> str:
    lines = header(device) + [f"- wall time: {total_s / 60:.1f} min", "", "| step | what | status | s |",
                              "|---|---|---|---|"]
    lines += [f"| {r.step.name} | {r.step.what} | {r.status} | {r.seconds:.0f} |" for r in results]
    for r in results:
        if r.status == "not run":
            continue
        lines += ["", f"## {r.step.name}: {r.status}", ""]
        lines += [r.tables.strip()] if r.tables else ["```", r.tail, "```"]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="benchmarks/gpu_check.md", help="the markdown report")
    p.add_argument("--steps", default=",".join(s.name for s in STEPS), help="comma-separated subset")
    p.add_argument("--budget-min", type=float, default=20.0, help="start no step past this many minutes")
    p.add_argument("--dry-run", action="store_true", help="print the steps and their commands, run nothing")
    args = p.parse_args(argv)
    chosen = [s.strip() for s in args.steps.split(",") if s.strip()]
    unknown = sorted(set(chosen) - {s.name for s in STEPS})
    if unknown:
        p.error(f"--steps: unknown {unknown}; choose from {', '.join(s.name for s in STEPS)}")
    steps = [s for s in STEPS if s.name in chosen]
    if args.dry_run:
        for s in steps:
            env = " ".join(f"{k}={v}" for k, v in s.env.items())
            print(f"{s.name} ({s.timeout_s} s): {env + ' ' if env else ''}{' '.join(s.argv)}")
        return 0
    import torch

    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device here (torch.cuda.is_available() is False); run it on a GPU machine, or "
              "--dry-run to see the steps", file=sys.stderr)
        return 2
    device = f"{torch.cuda.get_device_name(0)} ({torch.cuda.get_device_properties(0).total_memory / 2**30:.0f} GiB)"
    budget, start, results = args.budget_min * 60, time.perf_counter(), []
    with tempfile.TemporaryDirectory() as tmp:
        for s in steps:
            left = budget - (time.perf_counter() - start)
            if left < 30:
                results.append(Result(s, "not run"))
                continue
            print(f"... {s.name}: {s.what}", file=sys.stderr, flush=True)
            results.append(run_step(s, Path(tmp), left))
            print(f"    {results[-1].status} in {results[-1].seconds:.0f} s", file=sys.stderr, flush=True)
    text = report(results, device, time.perf_counter() - start)
    Path(args.out).write_text(text)
    print(text)
    return 0 if all(r.status == "passed" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
