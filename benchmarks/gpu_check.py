"""Every GPU check in one command, one markdown report: run it first whenever a GPU is at hand.

    python benchmarks/gpu_check.py --out benchmarks/gpu_check.md        # on a CUDA machine; about 15 minutes
    python benchmarks/gpu_check.py --dry-run                            # the steps and their commands, run nothing
    python benchmarks/gpu_check.py --steps layer,kernels,parity,ep,gemms --limit parity=200 --budget-min 11

Steps, each a child process (its own process group: a step past its time limit is stopped with every process it
started) with its own time limit; the whole run starts no step past ``--budget-min``:

    kernels        the Triton kernel tests compiled on CUDA (TRITON_INTERPRET=0): every kernel against its reference,
                   bitwise determinism of forward and backward, the compile of every tile configuration, tuning;
                   each failure written as it happens (tests/conftest.py, MOECOMPILE_FAILURE_LOG)
    parity         every family of the walk on CUDA, fp32 and bf16, the Triton form forced, against eager
                   (benchmarks/gpu_parity.py, the families split over 8 processes)
    parity-autocast  five families with float32 weights under bf16 autocast, eager experts (computed in bf16 by
                   the rewrite too), the Triton form forced, against eager under autocast (gpu_parity.py)
    parity-graphs  four families under CUDA graphs (mode="reduce-overhead"), float32, the Triton form forced, three
                   training steps each on fresh tokens against eager (the second records, the third replays)
    ep             expert parallelism, dedup="node" and replication="adaptive" on 4 gloo ranks sharing the GPU, two
                   training steps against one process (benchmarks/gpu_ep.py)
    layer          one MoE layer at real widths, T = 4096 and 16384: eager, Inductor, moe (benchmarks/bench_gpu.py)
    layer-auto     the same without the Triton kernels forced: eager, Inductor and what lowering="auto" chose
                   (issue 23's measure; for a short lease, in place of layer)
    layer-decode   the same at T = 16 and 256
    layer-graphs   T = 16 and 256: eager, Inductor, lowering="auto", and Inductor's and moe's under CUDA graphs
    gemms          each grouped GEMM of the kernels against torch._grouped_mm (benchmarks/bench_kernels.py)
    gemms-decode   the same, forward only, at decode token counts

kernels, the parity steps and ep time nothing: adjacent ones run at the same time (their compiles are CPU-bound).
The others time the GPU and run alone, in the order of ``--steps``. The report is rewritten after every step (a run
cut short keeps what finished); ``--files DIR`` keeps each step's log and tables, and ``DIR/cache``: the steps share
it as ``MOECOMPILE_CACHE_DIR`` (unless that is set), so the tile tunings made on this GPU come back with the files,
and the report says how to add them to the shipped table (``benchmarks/ship_tiles.py``): what users of this GPU
model get where tuning is off or a launch is too short to tune.

The report has the date, the device, the versions and the commit, a table of the steps (passed, failed, timed
out, not run) and each step's tables or the end of its output; for a step stopped at its limit, where each of its
threads was (Python's faulthandler dumps them on SIGABRT before the step is killed; our frames are kept).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import signal
import subprocess
import sys
import sysconfig
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
    argv: list[str]  # "{dir}": the folder of the step's own report files; "{limit}": its time limit less 30 s
    timeout_s: int
    env: dict = field(default_factory=dict)
    out: str = ""  # a markdown file the step writes into {dir}, pasted into the report
    timed: bool = True  # False: it times nothing, and runs beside the untimed steps next to it


STEPS = [
    Step("kernels", "Triton kernel tests compiled on CUDA (bitwise determinism included)",
         [PY, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "4", *KERNEL_TESTS], 360,
         {"TRITON_INTERPRET": "0", "MOECOMPILE_FAILURE_LOG": "{dir}/kernel_failures.md"}, out="kernel_failures.md",
         timed=False),
    Step("parity", "every walk family on CUDA, fp32 and bf16, the Triton form, against eager",
         [PY, "benchmarks/gpu_parity.py", "--device", "cuda", "--moe-option", "lowering=triton", "--jobs", "8",
          "--timeout", "{limit}", "--out", "{dir}/parity.md"], 420,
         out="parity.md", timed=False),
    Step("parity-autocast", "five families, float32 weights under bf16 autocast, the Triton form, against eager",
         [PY, "benchmarks/gpu_parity.py", "--device", "cuda", "--moe-option", "lowering=triton", "--dtypes",
          "autocast", "--families", "mixtral,qwen2_moe,gpt_oss,deepseek_v3,llama4_text", "--jobs", "5",
          "--timeout", "{limit}", "--out", "{dir}/parity_autocast.md"], 180, out="parity_autocast.md", timed=False),
    Step("parity-graphs", "four families under CUDA graphs (mode=\"reduce-overhead\"), float32, 3 steps each, "
         "against eager",
         [PY, "benchmarks/gpu_parity.py", "--device", "cuda", "--moe-option", "mode=reduce-overhead", "--moe-option",
          "lowering=triton", "--dtypes", "float32", "--steps", "3", "--families",
          "mixtral,qwen3_moe,deepseek_v3,gpt_oss", "--jobs", "2", "--timeout", "{limit}", "--out",
          "{dir}/parity_graphs.md"], 180, out="parity_graphs.md", timed=False),
    Step("ep", "expert parallelism, dedup and replication on 4 gloo ranks sharing the GPU, against one process",
         [PY, "benchmarks/gpu_ep.py", "--device", "cuda", "--out", "{dir}/ep.md"], 300, out="ep.md", timed=False),
    Step("layer", "one layer at real widths, T = 4096, 16384",
         [PY, "benchmarks/bench_gpu.py", "--tokens", "4096,16384", "--out", "{dir}/layer.md"], 300, out="layer.md"),
    Step("layer-auto", "one layer at real widths, T = 4096, 16384, what a user gets (lowering=\"auto\") only",
         [PY, "benchmarks/bench_gpu.py", "--tokens", "4096,16384", "--variants", "eager,inductor,moe-auto", "--out",
          "{dir}/layer_auto.md"], 240, out="layer_auto.md"),
    Step("layer-decode", "one layer, T = 16, 256",
         [PY, "benchmarks/bench_gpu.py", "--tokens", "16,256", "--out", "{dir}/decode.md"], 120, out="decode.md"),
    Step("layer-graphs", "one layer, T = 16, 256, also under CUDA graphs (mode=\"reduce-overhead\": Inductor, moe)",
         [PY, "benchmarks/bench_gpu.py", "--tokens", "16,256", "--variants",
          "eager,inductor,inductor-graphs,moe-auto,moe-graphs", "--out", "{dir}/graphs.md"], 150, out="graphs.md"),
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
    stopped: str = ""  # where its threads were when it was stopped at its limit (stopped_at)


def run_steps(steps: list[Step], folder: Path, limit_s: float) -> list[Result]:
    """Run ``steps`` at the same time, each to min(its own limit, ``limit_s``); its output goes to
    ``folder/<name>.log``. A step past its limit is stopped with its whole process group (pytest's workers, the
    parity processes, the gloo ranks), so nothing it started is left holding the GPU."""
    running = []
    for step in steps:
        limit = min(step.timeout_s, limit_s)
        fill = lambda a: a.replace("{dir}", str(folder)).replace("{limit}", f"{max(limit - 30, 10):.0f}")  # noqa: E731
        argv, env = [fill(a) for a in step.argv], {k: fill(v) for k, v in step.env.items()}
        log = open(folder / f"{step.name}.log", "w")  # noqa: SIM115 - closed below
        proc = subprocess.Popen(argv, cwd=ROOT, env={**os.environ, "PYTHONFAULTHANDLER": "1", **env}, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        running.append((step, proc, log, time.perf_counter(), limit))
    results = []
    for step, proc, log, t0, limit in running:
        try:
            code = proc.wait(timeout=max(0.0, t0 + limit - time.perf_counter()))
            status = "passed" if code == 0 else f"failed (exit {code})"
        except subprocess.TimeoutExpired:
            status = f"timed out ({limit:.0f} s)"
            _dump_stacks(proc)
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # whatever it left running, timed out or not
        except ProcessLookupError:
            pass
        proc.wait()
        log.close()
        output = (folder / f"{step.name}.log").read_text(errors="replace")
        tables = (folder / step.out).read_text() if step.out and (folder / step.out).exists() else ""
        results.append(Result(step, status, time.perf_counter() - t0, "\n".join(output.strip().splitlines()[-40:]),
                              tables, stopped_at(output) if status.startswith("timed out") else ""))
    return results


def _dump_stacks(proc: subprocess.Popen) -> None:
    """Every Python process of a step past its limit prints where each of its threads is (faulthandler, switched
    on by PYTHONFAULTHANDLER, dumps the stacks on SIGABRT) before it is killed: a hung step says where it hung
    (on the H200 the layer step's only clue was its silence)."""
    try:
        os.killpg(proc.pid, signal.SIGABRT)
        proc.wait(timeout=5)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        pass


def stopped_at(output: str, keep: int = 60) -> str:
    """From the stack dumps of a step stopped at its limit: each thread's header and the frames of our own code,
    not of installed packages or the standard library (innermost first, as faulthandler prints them), the last
    ``keep`` lines."""
    libraries = ("site-packages", "dist-packages", "<frozen", sysconfig.get_paths()["stdlib"])
    lines = [line for line in output.splitlines()
             if line.startswith(("Thread 0x", "Current thread 0x"))
             or (line.lstrip().startswith("File ") and not any(lib in line for lib in libraries))]
    return "\n".join(lines[-keep:])


def run_step(step: Step, folder: Path, limit_s: float) -> Result:
    return run_steps([step], folder, limit_s)[0]


def groups(steps: list[Step]) -> list[list[Step]]:
    """The steps in order, adjacent untimed ones together (they run at once), each timed one alone."""
    out: list[list[Step]] = []
    for s in steps:
        if out and not s.timed and not out[-1][-1].timed:
            out[-1].append(s)
        else:
            out.append([s])
    return out


def header(device: str) -> list[str]:
    import torch

    versions = [f"torch {torch.__version__}", f"python {platform.python_version()}"]
    for name in ("triton", "transformers"):
        try:
            versions.append(f"{name} {__import__(name).__version__}")
        except ImportError:
            versions.append(f"{name} not installed")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    commit.stdout = commit.stdout or os.environ.get("MOECOMPILE_COMMIT", "")  # a copy of the tree without .git
    return [f"# GPU check, {datetime.date.today().isoformat()}", "",
            f"- device: {device}", f"- versions: {', '.join(versions)}",
            f"- commit: {commit.stdout.strip() or 'unknown'}", "- command: `python benchmarks/gpu_check.py`"]


def tunings(cache: Path | None, device: str, where: str = "FILES/cache") -> list[str]:
    """Report lines for the tile tunings the steps made (``tuning-*.json`` in the shared cache), with the command
    that adds them to the shipped table (``where``: the cache as the reader will find it)."""
    files = sorted(cache.glob("tuning-*.json")) if cache is not None and cache.is_dir() else []
    counts = [(f, len(json.loads(f.read_text() or "{}"))) for f in files]
    if not any(n for _, n in counts):
        return []
    name = device.rsplit(" (", 1)[0]
    return ["", "Tile tunings made: " + ", ".join(f"{n} in `{f.name}`" for f, n in counts) + ". To ship them "
            "(what users of this GPU model get untuned), with the files copied back:", "",
            f"    python benchmarks/ship_tiles.py --device \"{name}\" --source \"gpu_check "
            f"{datetime.date.today().isoformat()}\" {where}/tuning-*.json"]


def report(results: list[Result], device: str, total_s: float, cache: Path | None = None,
           where: str = "FILES/cache") -> str:
    lines = header(device) + [f"- wall time: {total_s / 60:.1f} min", "", "| step | what | status | s |",
                              "|---|---|---|---|"]
    lines += [f"| {r.step.name} | {r.step.what} | {r.status} | {r.seconds:.0f} |" for r in results]
    lines += tunings(cache, device, where)
    for r in results:
        if r.status == "not run":
            continue
        lines += ["", f"## {r.step.name}: {r.status}", ""]
        lines += [r.tables.strip()] if r.tables else ["```", r.tail, "```"]
        if r.stopped:
            lines += ["", f"Where {r.step.name} was when it was stopped (its threads, frames of our code):", "",
                      "```", r.stopped, "```"]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="benchmarks/gpu_check.md", help="the markdown report")
    p.add_argument("--steps", default=",".join(s.name for s in STEPS), help="comma-separated, run in this order")
    p.add_argument("--budget-min", type=float, default=20.0, help="start no step past this many minutes")
    p.add_argument("--dry-run", action="store_true", help="print the steps and their commands, run nothing")
    p.add_argument("--limit", action="append", default=[], metavar="STEP=SECONDS",
                   help="a step's own time limit instead of its default (repeatable), to fit a short GPU lease")
    p.add_argument("--files", help="keep each step's log and tables in this folder (default: a temporary one)")
    args = p.parse_args(argv)
    chosen = [s.strip() for s in args.steps.split(",") if s.strip()]
    unknown = sorted(set(chosen) - {s.name for s in STEPS})
    if unknown:
        p.error(f"--steps: unknown {unknown}; choose from {', '.join(s.name for s in STEPS)}")
    limits = {}
    for item in args.limit:
        name, _, seconds = item.partition("=")
        if name not in {s.name for s in STEPS} or not seconds.isdigit():
            p.error(f"--limit {item!r}: expected STEP=SECONDS, STEP one of {', '.join(s.name for s in STEPS)}")
        limits[name] = int(seconds)
    by_name = {s.name: dataclasses.replace(s, timeout_s=limits.get(s.name, s.timeout_s)) for s in STEPS}
    steps = [by_name[n] for n in dict.fromkeys(chosen)]
    if args.dry_run:
        for group in groups(steps):
            for s in group:
                env = " ".join(f"{k}={v}" for k, v in s.env.items())
                at_once = f", at once with {len(group) - 1} more" if len(group) > 1 else ""
                print(f"{s.name} ({s.timeout_s} s{at_once}): {env + ' ' if env else ''}{' '.join(s.argv)}")
        return 0
    import torch

    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device here (torch.cuda.is_available() is False); run it on a GPU machine, or "
              "--dry-run to see the steps", file=sys.stderr)
        return 2
    device = f"{torch.cuda.get_device_name(0)} ({torch.cuda.get_device_properties(0).total_memory / 2**30:.0f} GiB)"
    budget, start, results = args.budget_min * 60, time.perf_counter(), []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(args.files or tmp)
        folder.mkdir(parents=True, exist_ok=True)
        cache = Path(os.environ.setdefault("MOECOMPILE_CACHE_DIR", str(folder / "cache")))  # the steps inherit it
        # a temporary folder is gone after the run: its tunings are not reported (kept only with --files)
        kept = cache if args.files or cache != folder / "cache" else None
        where = "FILES/cache" if cache == folder / "cache" else str(cache)
        for group in groups(steps):
            left = budget - (time.perf_counter() - start)
            if left < 30:
                results += [Result(s, "not run") for s in group]
                continue
            print(f"... {', '.join(s.name for s in group)}: {'; '.join(s.what for s in group)}", file=sys.stderr,
                  flush=True)
            for r in run_steps(group, folder, left):
                results.append(r)
                print(f"    {r.step.name}: {r.status} in {r.seconds:.0f} s", file=sys.stderr, flush=True)
            Path(args.out).write_text(report(results, device, time.perf_counter() - start, kept, where))
        text = report(results, device, time.perf_counter() - start, kept, where)
    Path(args.out).write_text(text)
    print(text)
    return 0 if all(r.status == "passed" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
