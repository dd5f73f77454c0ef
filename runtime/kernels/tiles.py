"""Tile sizes of the grouped GEMM kernels: the untuned rule each role starts from, and how a launch picks its tiles.

    tile_config(role, config, launch, ...)   the caller's config, else the tuner's (tuning.py): the interpreter's
                                             fixed tiles, a tuning on disk, one made now where the launch is long
                                             enough to matter (worth_tuning; the vendor GEMM among the
                                             candidates: run_role runs the pick), the shipped table, or
    rule_config(role, rows/expert, dtype)    this rule (gpu_config; dh halves N; wgrad_gpu_config for wgrad_*)
    layer_configs(...)                       every role's choice for a layer's shape, without tuning (explain())

Apart from the kernels because it is policy, not kernel code: the reason for each tile size is written beside it,
and the registers and spills of each are measured by ``benchmarks/kernel_resources.py``.
"""

from __future__ import annotations

import torch

from . import tuning


def gpu_config(rows_per_expert: float, dtype: torch.dtype) -> dict:
    """16-bit: M tiles of 64 rows when experts see few rows (decode, many experts: less of each tile is masked),
    128 otherwise; 128-wide N and 64-deep K (wgmma-sized; three stages fit shared memory). fp32 runs without
    tensor cores (as torch's fp32 default, no TF32) in 64 x 64 tiles so the FMA accumulators fit the registers.
    Registers and spills of each: ``benchmarks/kernel_resources.py``."""
    if dtype == torch.float32:
        return dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=32, num_warps=4, num_stages=2)
    block_m = 64 if rows_per_expert < 128 else 128
    return dict(BLOCK_M=block_m, BLOCK_N=128, BLOCK_K=64, num_warps=8 if block_m == 128 else 4, num_stages=3)


GROUP_M = 8  # row tiles that walk the column tiles together (grouped_common.tile_of): 8 x 128 rows is one of
# Mixtral's experts at 4096 tokens; with 16 column tiles a wave of an H100's 132 programs reads about 8 MB of rows
# and 32 MB of weights, inside its 50 MB L2. A configuration may set its own ("GROUP_M": 0 is the 2-D grid's order,
# each row tile in turn for one column tile, as the kernels ran before).


def group_m(cfg: dict) -> int:
    return cfg.get("GROUP_M", GROUP_M)


def gpu_configs():
    """(dtype, config) for every tile configuration ``gpu_config`` can return."""
    return [(dt, gpu_config(rows, dt)) for dt in (torch.float32, torch.float16, torch.bfloat16) for rows in (1, 1024)]


def rule_config(role: str, rows_per_expert: float, dtype: torch.dtype) -> dict:
    """The untuned configuration of a kernel role: ``gpu_config``; the dh kernel holds three [M, N] fp32
    accumulators (gate, up, dout @ Wd), so it takes half the N (at N=128 ptxas spills 300-600 bytes a thread,
    benchmarks/kernel_resources.py); the weight gradients have their own (``wgrad_gpu_config``)."""
    cfg = gpu_config(rows_per_expert, dtype)
    # dh_kept holds G, then the kept g and u beside it; up_act_kept its g and u beside h as it stores all three
    # (128 x 128 in 8 warps spilled 476 bytes, 128 x 64 none: benchmarks/kernel_resources.py)
    return halved_n(cfg) if role in ("dh", "dh_kept", "up_act_kept") else cfg


def halved_n(cfg: dict) -> dict:
    """``cfg`` with half the N (at least 16): the rule for the kernels holding three [M, N] tiles at once."""
    return dict(cfg, BLOCK_N=max(16, cfg["BLOCK_N"] // 2))


def wgrad_gpu_config(dtype) -> dict:
    """Untuned weight-gradient tiles: 128 x 128 outputs on the tensor cores for 16-bit, reduced over 64 rows per
    step; fp32 (no tensor cores: torch's fp32 default is not TF32 either) takes 64 x 64 so its FMA accumulators
    fit the registers."""
    if dtype == torch.float32:
        return dict(BLOCK_N1=64, BLOCK_N2=64, BLOCK_K=32, num_warps=4, num_stages=2)
    return dict(BLOCK_N1=128, BLOCK_N2=128, BLOCK_K=64, num_warps=8, num_stages=3)


# A launch estimated (at the GPU's ceilings) to run under TUNE_MIN_US is bound by its latency, not its tiles: tuning
# it (compiling and timing up to 22 configurations per role, about a minute for a layer's roles on an H200) cannot
# pay back, so it takes the tuned, shipped or rule configuration without tuning. The ceilings are the larger of
# the H100's and H200's (dense 16-bit tensor-core FLOP/s, HBM bytes/s; vendor datasheets), so the estimate is a
# lower bound and a launch that may run longer is tuned.
TUNE_MIN_US = 10.0
CEILING_FLOPS, CEILING_BYTES = 990e12, 4.8e12


def worth_tuning(role: str, dtype, B: int, E: int, H: int, I: int, gated: bool) -> bool:
    """Whether ``role`` at this shape may run long enough for its tiles to matter (``TUNE_MIN_US``): its FLOPs,
    and the bytes of all ``E`` experts' weights and the rows it reads and writes, at the ceilings."""
    width = 2 * I if gated and role in ("up_act", "up_act_kept", "dh", "dh_kept", "dx") else I  # wgrad_*: its width
    # dh recomputes the projections beside dout @ Wd; dh_kept reads them (dout @ Wd alone)
    flops = 2 * B * H * {"dh": 2 * width, "dh_kept": I}.get(role, width)
    nbytes = (E * H * width + B * (H + width)) * dtype.itemsize
    return max(flops / CEILING_FLOPS, nbytes / CEILING_BYTES) * 1e6 >= TUNE_MIN_US


def tile_config(role: str, config: dict | None, launch, *, dtype, device, B: int, E: int, H: int, I: int,
                gated: bool, rule=None, vendor=None) -> dict:
    """``config`` when the caller gives one; else the tuner's for this role and shape (``tuning.py``: the
    interpreter's fixed tiles, a tuning cached on disk, a tuning made now by timing ``launch(cfg)`` and
    ``vendor()`` where the launch is ``worth_tuning``, the shipped table, or ``rule()``, by default
    ``rule_config``)."""
    if config is not None:
        return config
    k = tuning.key(role, dtype, H, I, E, B, gated)
    rule = rule or (lambda: rule_config(role, B / max(E, 1), dtype))
    return tuning.tuner().choose(role, k, dtype, device, gated, launch, rule, vendor,
                                 tune=worth_tuning(role, dtype, B, E, H, I, gated))


def run_role(role: str, config: dict | None, launch, vendor, **shape) -> dict:
    """Pick the role's configuration (``tile_config``) and run it: ``vendor()`` (``vendor.py``, None where the
    vendor GEMM does not take the shape) when it is ``tuning.VENDOR``, else the kernel, ``launch(cfg)``."""
    cfg = tile_config(role, config, launch, vendor=vendor, **shape)
    if not tuning.is_vendor(cfg):
        launch(cfg)
    elif vendor is None:
        raise ValueError(f"the {role} kernel was asked to run on torch._grouped_mm, which does not take "
                         f"{shape['dtype']} with widths {shape['H']}, {shape['I']} (rows of 16 bytes): "
                         "pass a tile configuration instead")
    else:
        vendor()
    return cfg


def layer_configs(dtype, device, B: int, E: int, H: int, I: int, gated: bool,
                  kept: bool = False) -> dict[str, tuple[dict, str]]:
    """role -> (tile configuration, where it comes from) for every grouped GEMM kernel of a layer of this shape,
    as the launchers will pick it, without tuning (``explain()``): interpreter, tuned, shipped table or rule.
    ``kept``: the forward keeps its projections (training): up_act_kept and dh_kept in place of up_act and dh."""
    rows = B / max(E, 1)
    shapes = {"up_act_kept" if kept else "up_act": (H, I, gated), "down": (H, I, False),
              "dh_kept" if kept else "dh": (H, I, gated),
              "dx": (H, I, gated), "wgrad_up": (H, 2 * I if gated else I, gated), "wgrad_down": (I, H, False)}
    out = {}
    for role, (h, i, g) in shapes.items():
        rule = (lambda: wgrad_gpu_config(dtype)) if role.startswith("wgrad") else (
            lambda role=role: rule_config(role, rows, dtype))
        cfg, source = tuning.tuner().lookup(role, tuning.key(role, dtype, h, i, E, B, g), dtype, device, rule)
        small = source == "rule" and not worth_tuning(role, dtype, B, E, h, i, g)
        out[role] = (cfg, "rule (too small to tune)" if small else source)
    return out


def tuner_configs(roles):
    """(role, dtype, config) for every configuration the tuner keeps for these roles (16-bit: bf16 stands for
    fp16 too, the same code), beyond the rule's own (compiled with every flag set)."""
    out = []
    for role in roles:
        for dt in (torch.bfloat16, torch.float32):
            kept = tuning.prune_configs(role, tuning.candidates(role, dt), dt, True, tuning.SMEM_DEFAULT)
            out += [(role, dt, cfg) for cfg in kept]
    return out
