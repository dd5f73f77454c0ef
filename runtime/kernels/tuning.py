"""Tile configurations of the grouped GEMM kernels: tuned on the user's GPU, cached on disk, a shipped table
until then.

Each kernel role (``up_act``, ``down``, ``dh``, ``dx``, ``wgrad_up`` for [dWg | dWu], ``wgrad_down``; in training
``up_act_kept`` also storing the projections and ``dh_kept`` reading them: one GEMM, not three) picks its
configuration by key: (role, dtype, H, I, E, gated, rows-per-expert bucket), the things that move the best tile.
In order:

1. the interpreter: small fixed tiles (it runs each program in Python; fewer masked rows is what counts);
2. a configuration tuned before, on this GPU model with this Triton and these kernels (a digest of their source),
   from the in-process table or the JSON file on disk (``$MOECOMPILE_CACHE_DIR``, default ``~/.cache/moecompile``),
   shared by every process;
3. tuning now, when allowed (``MOECOMPILE_AUTOTUNE`` is not ``0``): every candidate that ``prune_configs`` keeps
   inside shared memory and registers is compiled, all at once on threads (``precompile``), then timed one after the
   other on the real arguments (``triton.testing.do_bench``); the fastest is stored on disk. Kernels here write
   their outputs without accumulating (no atomics), so running a candidate on the real buffers changes nothing;
4. the shipped table (``h100_table.json``: measured on an H100 by hand, and tunings of GPU checks added with
   ``benchmarks/ship_tiles.py``) for that GPU model and key: what a launch takes where tuning is off or the
   launch is too short to tune;
5. the rule of ``tiles.gpu_config`` (what was used before tuning existed).

Beside the tiles, the tuner times the vendor's grouped GEMM for the role (``vendor.py``: ``torch._grouped_mm``
with the kernel's epilogue as torch ops) where it takes the dtype and widths; when it is fastest the role's
configuration is ``VENDOR`` and the launcher runs it instead of the kernel.

Why not ``triton.autotune``: the kernels of one layer allocate buffers whose sizes depend on the tile (partial
sums per column tile, the persistent kernel's scratch), the key needs a rows-per-expert bucket that is no kernel
argument, ``explain()`` must name the configuration before anything runs, and the interpreter cannot run a
multi-config autotuner. The pruning is ``prune_configs_by``'s idea: drop what cannot fit before timing.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import itertools
import json
import math
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
import triton

from .. import disk_cache
from .common import compiling_only, interpreting

ROLES = ("up_act", "up_act_kept", "down", "dh", "dh_kept", "dx", "wgrad_up", "wgrad_down")
SHIPPED = Path(__file__).with_name("h100_table.json")
SMEM_DEFAULT = 232448  # an H100's shared memory per block (opt-in), when the device cannot be asked
# fp32 accumulator registers a thread may hold (of 255) before ptxas spills, from benchmarks/kernel_resources.py
# on every candidate: the GEMM kernels hold 128 (at 4 warps and 128 they spill 4 bytes); the weight-gradient
# kernel also keeps its transposed A tile and column sums in registers: 64 (at 128 it spills 48-972 bytes)
ACC_REGISTERS = {"wgrad": 64, "gemm": 128}
INTERPRETER = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, num_warps=4, num_stages=1)
WGRAD_INTERPRETER = dict(BLOCK_N1=16, BLOCK_N2=16, BLOCK_K=16, num_warps=4, num_stages=1)


VENDOR = {"vendor": "torch._grouped_mm"}  # the configuration of a role that runs the vendor GEMM


def is_vendor(cfg: dict | None) -> bool:
    return bool(cfg) and "vendor" in cfg


def key(role: str, dtype: torch.dtype, H: int, I: int, E: int, rows: int, gated: bool) -> str:
    """The table key: rows per expert bucketed to a power of two (the tile height that wastes least)."""
    bucket = 1 << max(0, min(14, round(math.log2(max(1.0, rows / max(1, E))))))
    return f"{role}|{str(dtype).removeprefix('torch.')}|H{H}|I{I}|E{E}|{'gated' if gated else 'plain'}|r{bucket}"


# ---- candidates and pruning ----------------------------------------------------------------------------------


def candidates(role: str, dtype: torch.dtype) -> list[dict]:
    """Every configuration the tuner may time for ``role`` (before pruning): around what measured best on an
    H100 (128 x 128 x 64, 8 warps, 3 stages; 64 x 256 for up_act with many small experts), small enough that a
    first tuning compiles in seconds per kernel. fp32 runs without tensor cores (torch's fp32 default is not
    TF32): small tiles only."""
    if role.startswith("wgrad"):
        if dtype == torch.float32:
            return [dict(BLOCK_N1=64, BLOCK_N2=64, BLOCK_K=32, num_warps=4, num_stages=s) for s in (2, 3)]
        return [dict(BLOCK_N1=a, BLOCK_N2=b, BLOCK_K=64, num_warps=w, num_stages=s)
                for a, b, w, s in itertools.product((64, 128, 256), (64, 128), (4, 8), (3, 4))]
    if dtype == torch.float32:
        return [dict(BLOCK_M=m, BLOCK_N=n, BLOCK_K=32, num_warps=4, num_stages=2) for m, n in ((32, 64), (64, 64))]
    return [dict(BLOCK_M=m, BLOCK_N=n, BLOCK_K=64, num_warps=w, num_stages=s)
            for m, n, w, s in itertools.product((64, 128), (64, 128, 256), (4, 8), (3, 4))]


def _footprint(role: str, cfg: dict, gated: bool) -> tuple[int, int]:
    """(operand tiles loaded per pipeline stage, fp32 accumulator tiles) of one program of ``role``."""
    if role.startswith("wgrad"):
        return cfg["BLOCK_K"] * (cfg["BLOCK_N1"] + cfg["BLOCK_N2"]), cfg["BLOCK_N1"] * cfg["BLOCK_N2"]
    m, n, k = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    b_tiles = 2 if gated else 1
    return {
        "up_act": (m * k + b_tiles * k * n, b_tiles * m * n),  # x rows; gate and up weights
        "up_act_kept": (m * k + b_tiles * k * n, (b_tiles + 1) * m * n),  # g and u stored beside h
        "down": (m * k + k * n, m * n),
        "dh": (m * k + b_tiles * k * n, (b_tiles + 1) * m * n),  # recomputed projections, then dout @ Wd
        "dh_kept": (m * k + k * n, (b_tiles + 1) * m * n),  # dout @ Wd, then the kept projections beside it
        "dx": (b_tiles * (m * k + k * n), m * n),  # dg and du rows; gate and up weights
    }[role]


def prune_configs(role: str, configs: list[dict], dtype: torch.dtype, gated: bool, smem: int) -> list[dict]:
    """Keep the configurations whose pipelined operand tiles fit ``smem`` bytes and whose fp32 accumulators fit
    the registers of their warps."""
    size = torch.tensor([], dtype=dtype).element_size()
    kept = []
    for cfg in configs:
        per_stage, acc = _footprint(role, cfg, gated)
        if cfg["num_stages"] * per_stage * size > smem:
            continue
        if acc / (32 * cfg["num_warps"]) > ACC_REGISTERS["wgrad" if role.startswith("wgrad") else "gemm"]:
            continue
        kept.append(cfg)
    return kept


# ---- the tuner -----------------------------------------------------------------------------------------------


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


def _smem(device: torch.device) -> int:
    if device.type != "cuda":
        return SMEM_DEFAULT
    props = torch.cuda.get_device_properties(device)
    return getattr(props, "shared_memory_per_block_optin", SMEM_DEFAULT) or SMEM_DEFAULT


def _bench(fn: Callable[[], None]) -> float:
    return triton.testing.do_bench(fn, warmup=5, rep=20)


PRECOMPILE_THREADS = 8


def precompile(configs: list[dict], launch: Callable[[dict], None], device: torch.device,
               threads: int | None = None) -> int:
    """Compile the kernel of every configuration (``launch(cfg)`` inside ``compiling_only``: nothing runs), the
    first here, the rest at once on threads, before the tuner times them one after the other: a first tuning
    compiles up to ~20 configurations per role, and Triton's compile leaves the GIL (16 of up_act's for sm_90:
    8.2 s one after the other, 4.5 s on two threads of this 2-core machine). Each thread works on the caller's
    device and stream (what a launch closure also runs there is ordered as the caller's own). A configuration
    whose compile fails here is left to the timing, which skips it if it fails there too. Returns how many
    compiled."""
    if not configs:
        return 0
    stream = torch.cuda.current_stream(device) if device.type == "cuda" else None

    def one(cfg: dict) -> None:
        with contextlib.ExitStack() as stack:
            if stream is not None:
                stack.enter_context(torch.cuda.device(device))
                stack.enter_context(torch.cuda.stream(stream))
            stack.enter_context(compiling_only())
            launch(cfg)

    def tried(cfg: dict) -> bool:
        try:
            one(cfg)
            return True
        except Exception:  # noqa: BLE001 - out of resources on this GPU: the timing says so again, and skips it
            return False

    done = tried(configs[0])  # the kernel's per-device state is made once, here, not by racing threads
    workers = min(len(configs) - 1, threads or min(PRECOMPILE_THREADS, os.cpu_count() or 1))
    if workers < 2:
        return done + sum(tried(c) for c in configs[1:])
    with ThreadPoolExecutor(workers, thread_name_prefix="moecompile-tiles") as pool:
        return done + sum(pool.map(tried, configs[1:]))


class Tuner:
    """Configurations by (device, key): tuned, cached in memory and in one JSON file per GPU model and Triton
    version, or from the shipped table. ``bench`` times a zero-argument launch in ms, ``compile_all`` compiles the
    candidates before (``precompile``; on CUDA: tests inject both)."""

    def __init__(self, cache_dir: str | os.PathLike | None = None, shipped: Path = SHIPPED,
                 bench: Callable[[Callable[[], None]], float] = _bench, enabled: bool | None = None,
                 compile_all: Callable | None = None):
        self.cache_dir = disk_cache.cache_dir(cache_dir)
        self.shipped = json.loads(shipped.read_text()) if shipped.exists() else {}
        self.bench = bench
        self.compile_all = compile_all if compile_all is not None else (
            precompile if torch.cuda.is_available() else None)
        self.enabled = os.environ.get("MOECOMPILE_AUTOTUNE", "1") != "0" if enabled is None else enabled
        self.tuned: dict[str, dict[str, dict]] = {}  # device name -> key -> config (this process and the file)

    def cache_file(self, device_name: str) -> Path:
        safe = "".join(c if c.isalnum() else "_" for c in device_name)
        return self.cache_dir / f"tuning-{safe}-triton{triton.__version__}-{kernels_digest()}.json"

    def _load(self, device_name: str) -> dict[str, dict]:
        if device_name not in self.tuned:
            self.tuned[device_name] = disk_cache.load(self.cache_file(device_name))
        return self.tuned[device_name]

    def _store(self, device_name: str, k: str, cfg: dict) -> None:
        disk_cache.store(self.cache_file(device_name), self._load(device_name), k, cfg)

    def lookup(self, role: str, k: str, dtype: torch.dtype, device: torch.device,
               rule: Callable[[], dict]) -> tuple[dict, str]:
        """(configuration, where it came from) without tuning: interpreter, tuned, shipped table, rule."""
        if interpreting():
            return dict(WGRAD_INTERPRETER if role.startswith("wgrad") else INTERPRETER), "interpreter"
        tuned = self._load(_device_name(device))
        if k in tuned:
            return dict(tuned[k]), "tuned"
        shipped = self.shipped.get(_device_name(device), {})
        if k in shipped:
            return dict(shipped[k]), "shipped table"
        return rule(), "rule"

    def choose(self, role: str, k: str, dtype: torch.dtype, device: torch.device, gated: bool,
               launch: Callable[[dict], None], rule: Callable[[], dict],
               vendor: Callable[[], None] | None = None, tune: bool = True) -> dict:
        """The configuration for this launch; tunes (times every kept candidate with ``launch``, and ``vendor``,
        the role on the vendor's GEMM, where given: ``VENDOR`` when it wins) when the key is new on this GPU,
        tuning is enabled and the launch is worth it (``tune``: ``tiles.worth_tuning``)."""
        cfg, source = self.lookup(role, k, dtype, device, rule)
        if source in ("tuned", "interpreter") or not (self.enabled and tune) or device.type != "cuda":
            return cfg
        kept = prune_configs(role, candidates(role, dtype), dtype, gated, _smem(device))
        if self.compile_all is not None:
            self.compile_all(kept, launch, device)
        runs = [(c, lambda c=c: launch(c)) for c in kept] + ([(VENDOR, vendor)] if vendor is not None else [])
        timings = []
        for c, run in runs:
            try:
                timings.append((self.bench(run), c))
            except Exception:  # out of resources on this GPU, or a GEMM the vendor refuses: not a candidate
                continue
        if not timings:
            return cfg
        best = min(timings, key=lambda t: t[0])[1]
        self._store(_device_name(device), k, best)
        return dict(best)


@functools.cache
def kernels_digest() -> str:
    """A digest of the kernels' source (this folder): a tuning timed other kernels than the ones a changed file
    launches (their program order, what they store), so each version of them has its own tuning file."""
    digest = hashlib.sha1()
    for f in sorted(Path(__file__).resolve().parent.glob("*.py")):
        digest.update(f.read_bytes())
    return digest.hexdigest()[:10]


@functools.cache
def tuner() -> Tuner:
    """The process's tuner (made on first use: reads the environment then)."""
    return Tuner()


def describe(cfg: dict) -> str:
    if is_vendor(cfg):
        return cfg["vendor"]
    if "BLOCK_N1" in cfg:
        return f"{cfg['BLOCK_N1']}x{cfg['BLOCK_N2']}x{cfg['BLOCK_K']} w{cfg['num_warps']} s{cfg['num_stages']}"
    return f"{cfg['BLOCK_M']}x{cfg['BLOCK_N']}x{cfg['BLOCK_K']} w{cfg['num_warps']} s{cfg['num_stages']}"
