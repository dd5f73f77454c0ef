"""The floors and rooms of docs/architecture.md hold: imports run down only (front end -> passes -> runtime), no
import runs up even inside a function, each room says in its ``__init__`` what lives there and what it may import,
and no module grows past 400 lines."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = {"moecompile": "moecompile", "passes": "moecompile.passes", "runtime": "moecompile.runtime",
           "models": "moecompile.models"}

# Who may import whom, by package prefix (the longest prefix of a module decides its room). A module may always
# import its own room. Anything outside moecompile (torch, triton, transformers...) is not checked.
FRONT = "moecompile"
MAY_IMPORT = {
    "moecompile": {"moecompile", "moecompile.tracing", "moecompile.distributed", "moecompile.passes",
                   "moecompile.runtime", "moecompile.runtime.kernels", "moecompile.runtime.comm",
                   "moecompile.runtime.placement"},
    "moecompile.tracing": {"moecompile.passes"},
    "moecompile.distributed": {"moecompile", "moecompile.tracing", "moecompile.passes", "moecompile.runtime",
                               "moecompile.runtime.kernels", "moecompile.runtime.comm",
                               "moecompile.runtime.placement"},
    "moecompile.passes": {"moecompile.runtime", "moecompile.runtime.kernels", "moecompile.runtime.comm",
                          "moecompile.runtime.placement"},
    "moecompile.runtime": {"moecompile.runtime.kernels"},
    "moecompile.runtime.kernels": {"moecompile.runtime"},
    "moecompile.runtime.comm": {"moecompile.runtime"},
    "moecompile.runtime.placement": {"moecompile.runtime", "moecompile.runtime.comm"},
    "moecompile.models": {"moecompile.passes"},
}
# The CLI's demo and inspect build the tiny models: the one place the front end reaches the models.
EXCEPTIONS = {("moecompile.__main__", "moecompile.models")}


def modules():
    for folder, package in FOLDERS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            is_init = parts[-1] == "__init__"
            name = ".".join((package, *(parts[:-1] if is_init else parts)))
            if folder == "moecompile" and parts[0] in ("passes", "runtime", "models"):
                continue
            yield name, path, is_init


def room(module: str) -> str:
    return max((r for r in MAY_IMPORT if module == r or module.startswith(r + ".")), key=len)


def imported(name: str, path: Path, is_init: bool) -> set[str]:
    package = name if is_init else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):  # every import, function bodies included
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            out.add(base)
            out.update(f"{base}.{a.name}" for a in node.names)  # `from pkg import module`
    known = {m for m, _, _ in modules()}
    return {m for m in out if m in known}


def test_imports_run_down_only():
    wrong = []
    for name, path, is_init in modules():
        mine = room(name)
        for target in sorted(imported(name, path, is_init)):
            theirs = room(target)
            if theirs != mine and theirs not in MAY_IMPORT[mine] and (name, theirs) not in EXCEPTIONS:
                wrong.append(f"{path.relative_to(ROOT)} ({mine}) imports {target} ({theirs})")
    assert not wrong, "imports that run up or across:\n  " + "\n  ".join(wrong)


def test_every_room_says_what_it_holds_and_may_import():
    for name, path, is_init in modules():
        if is_init and name != FRONT:
            doc = ast.get_docstring(ast.parse(path.read_text())) or ""
            assert "import" in doc.lower() and len(doc.splitlines()) >= 3, f"{path}: docstring lacks the room's rules"


@pytest.mark.parametrize("folder", ["moecompile", "passes", "runtime", "models", "tests", "benchmarks",
                                    "examples", "scripts"])
def test_no_module_over_400_lines(folder):
    long = {str(p.relative_to(ROOT)): n for p in sorted((ROOT / folder).rglob("*.py"))
            if (n := len(p.read_text().splitlines())) > 400}
    assert not long, f"split these along a seam a reader would expect: {long}"


def test_the_rules_can_fail(tmp_path):
    """An upward import inside a function is found."""
    up = tmp_path / "up.py"
    up.write_text("def f():\n    from moecompile.distributed.parallel import parallelize\n")
    assert imported("moecompile.runtime.comm.up", up, False) == {"moecompile.distributed.parallel"}
    rel = tmp_path / "rel.py"
    rel.write_text("from ..placement import swap\nfrom .ops import _group\n")
    assert imported("moecompile.runtime.comm.rel", rel, False) == {
        "moecompile.runtime.placement", "moecompile.runtime.placement.swap", "moecompile.runtime.comm.ops"}
    assert room("moecompile.runtime.placement.swap") not in MAY_IMPORT["moecompile.runtime.comm"]
