"""Add tile tunings made on a GPU to the shipped table (``runtime/kernels/h100_table.json``), which a launch on that
GPU model takes where tuning is off (``MOECOMPILE_AUTOTUNE=0``) or the launch is too short to tune, and which
``explain()`` names before a tuning exists (``runtime/kernels/tuning.py``).

    python benchmarks/ship_tiles.py --device "NVIDIA H200" --source "gpu_check 2026-11-28" FILES/cache/tuning-*.json

Each input is a tuner's cache file (``tuning-<GPU>-triton<version>-<kernels>.json`` in ``$MOECOMPILE_CACHE_DIR``; a
GPU check keeps its steps' in ``--files DIR/cache`` and prints this command). Its entries replace the table's for
``--device`` (the name ``torch.cuda.get_device_name`` gives, which the tuner looks up), key by key; ``--source`` is
recorded under ``_sources``. An entry whose role the tuner does not know, or whose configuration is neither tiles
nor the vendor GEMM, is refused with its key. The file is rewritten sorted, so a diff shows what changed.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from moecompile.runtime.kernels.tuning import ROLES, SHIPPED as TABLE
TILE_KEYS = ({"BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages"},
             {"BLOCK_N1", "BLOCK_N2", "BLOCK_K", "num_warps", "num_stages"})


def problem(key: str, cfg) -> str:
    """Why an entry cannot be shipped, or ""."""
    if key.split("|")[0] not in ROLES or len(key.split("|")) != 7:
        return f"{key!r}: not a tuner key (role|dtype|H|I|E|gated|rows, role one of {', '.join(ROLES)})"
    if not isinstance(cfg, dict) or not ("vendor" in cfg or any(keys <= set(cfg) for keys in TILE_KEYS)):
        return f"{key!r}: {cfg!r} is neither a tile configuration nor the vendor GEMM"
    return ""


def ship(files: list[Path], device: str, source: str, table_path: Path = TABLE) -> int:
    """Merge ``files`` into the table for ``device``; returns the number of entries added or changed."""
    table = json.loads(table_path.read_text()) if table_path.exists() else {}
    entries = table.setdefault(device, {})
    changed, bad = 0, []
    for f in files:
        for key, cfg in json.loads(f.read_text()).items():
            if why := problem(key, cfg):
                bad.append(f"{f.name}: {why}")
            elif entries.get(key) != cfg:
                entries[key], changed = cfg, changed + 1
    if bad:
        raise ValueError("not shipped, nothing written:\n" + "\n".join(bad))
    table.setdefault("_sources", {})[device] = source
    table_path.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    return changed


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("files", nargs="+", type=Path, help="tuning-*.json files of the tuner's cache")
    p.add_argument("--device", required=True, help="the GPU's name as torch.cuda.get_device_name gives it")
    p.add_argument("--source", required=True, help="where the tunings come from (a GPU check's date and commit)")
    p.add_argument("--table", type=Path, default=TABLE)
    args = p.parse_args(argv)
    try:
        n = ship(args.files, args.device, args.source, args.table)
    except (OSError, ValueError) as exc:
        print(f"ship_tiles: {exc}", file=sys.stderr)
        return 1
    print(f"{n} entries added or changed for {args.device} in {args.table}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
