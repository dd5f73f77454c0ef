"""JSON tables on disk shared by every process of a machine: the tuned tiles (runtime/kernels/tuning.py) and the
forms chosen per MoE layer (passes/forms.py). One file per table under ``$MOECOMPILE_CACHE_DIR`` (default
``~/.cache/moecompile``); an entry is merged in by re-reading the file first (another process may have added
entries) and replacing it atomically. A read-only or missing home only loses the file: the process keeps its
table in memory.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path


def cache_dir(override: str | os.PathLike | None = None) -> Path:
    return Path(override or os.environ.get("MOECOMPILE_CACHE_DIR") or Path.home() / ".cache" / "moecompile")


def safe_name(text: str) -> str:
    """``text`` with every character but letters, digits, dots and dashes replaced by ``_`` (a file name)."""
    return "".join(c if c.isalnum() or c in ".-" else "_" for c in text)


def load(path: Path) -> dict:
    try:
        table = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return table if isinstance(table, dict) else {}


def store(path: Path, table: dict, key: str, value) -> None:
    """``table[key] = value``, and the same entry merged into the file at ``path``."""
    table[key] = value
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        table.update({**load(path), key: value})
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(table, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except OSError:
        pass
