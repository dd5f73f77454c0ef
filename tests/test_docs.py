"""The README and docs/ stay true to the code: every command in a fenced block names files, modules and CLI verbs
that exist, every repository path or ``moecompile.*`` name written in the text resolves, and the README's example
on one device runs.

    python -m moecompile VERB ...        VERB is a verb of the CLI
    python -m some.module ...            the module can be found
    python path/to/file.py ..., torchrun ... path/to/file.py, bash path.sh, pytest tests/x.py::name
                                         the file exists (and the test is defined in it)
    `runtime/comm/ops.py` in the text    the path exists (paths under the repository's own folders)
    `moecompile.runtime.comm.exchange.emulate_links`   a module, or an attribute of one
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import io
import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "passes" / "README.md",
        ROOT / "benchmarks" / "README.md"]
FOLDERS = ("moecompile", "passes", "runtime", "models", "tests", "benchmarks", "examples", "scripts", "docs", ".ci")
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
RUNNERS = ("python", "python3", ".venv/bin/python", "torchrun", "bash", "pytest")


def cli_verbs() -> set[str]:
    from moecompile.__main__ import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        main(["--help"])
    return set(re.search(r"\{([\w,]+)\}", out.getvalue()).group(1).split(","))


def commands(text: str) -> list[list[str]]:
    """Each command of the fenced shell blocks (and of commented ``# torchrun ...`` lines in Python blocks), split
    into words, environment assignments dropped."""
    out = []
    for lang, body in FENCE.findall(text):
        for line in body.replace("\\\n", " ").splitlines():
            if lang in ("python", "py"):
                hit = re.search(r"#\s*((?:torchrun|python)\b.*)", line)
                if not hit:
                    continue
                line = hit.group(1)
            line = re.sub(r"\s#.*$", "", line.strip())
            if not line or line.startswith("#"):
                continue
            for part in re.split(r"&&|\|\||;|\|", line):
                try:
                    words = shlex.split(part)
                except ValueError:
                    continue
                while words and re.fullmatch(r"\w+=\S*", words[0]):
                    words = words[1:]
                if words and Path(words[0]).name in {Path(r).name for r in RUNNERS}:
                    out.append(words)
    return out


def check_command(words: list[str], verbs: set[str]) -> list[str]:
    problems = []
    runner, args = Path(words[0]).name, words[1:]
    if runner in ("python", "python3") and args and args[0] == "-m" and args[1:2] == ["pytest"]:
        runner, args = "pytest", args[2:]
    if runner == "pytest":
        for a in args:
            if a.startswith("-") or not a.startswith("tests"):
                continue
            path, _, test = a.partition("::")
            if not (ROOT / path).exists():
                problems.append(f"pytest path {path} does not exist")
            elif test and not re.search(rf"def {re.escape(test.split('[')[0])}\(", (ROOT / path).read_text()):
                problems.append(f"{path} defines no test {test}")
        return problems
    for i, a in enumerate(args):
        if a == "-m" and i + 1 < len(args):
            module = args[i + 1]
            if module == "moecompile" and i + 2 < len(args) and args[i + 2] not in verbs and \
                    not args[i + 2].startswith("-"):
                problems.append(f"`{args[i + 2]}` is not a verb of python -m moecompile ({sorted(verbs)})")
            elif importlib.util.find_spec(module) is None:
                problems.append(f"module {module} cannot be found")
            break
        if a.endswith((".py", ".sh")):
            if "/" in a and not (ROOT / a).exists():  # a bare name (train.py) is the user's own script
                problems.append(f"{a} does not exist")
            break
    return problems


def named_paths(text: str) -> set[str]:
    found = set()
    for token in re.findall(r"`([^`\n]+)`", text):
        for word in re.findall(r"[\w./*-]+(?:::[\w*]+)?", token):
            head = word.split("/")[0]
            if "/" in word and head in FOLDERS:
                found.add(word.rstrip(".,:;"))
    return found


def exists(path: str) -> str | None:
    """None when ``path`` (globs allowed, ``file::test`` too) names something that exists, else the problem."""
    file, _, test = path.partition("::")
    files = sorted(ROOT.glob(file)) if "*" in file else [ROOT / file] if (ROOT / file).exists() else []
    if not files:
        return f"path {file} does not exist"
    name = re.escape(test).replace(r"\*", r"\w*")
    if test and not any(re.search(rf"def {name}\(", f.read_text()) for f in files if f.is_file()):
        return f"{file} defines no test {test}"
    return None


def resolves(dotted: str) -> bool:
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            if not hasattr(obj, name):
                return False
            obj = getattr(obj, name)
        return True
    return False


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_commands_and_names_exist(doc: Path):
    text = doc.read_text()
    verbs = cli_verbs()
    problems = [f"`{' '.join(c)}`: {p}" for c in commands(text) for p in check_command(c, verbs)]
    problems += [p for p in map(exists, sorted(named_paths(text))) if p]
    for dotted in sorted(set(re.findall(r"\bmoecompile(?:\.\w+)+", text))):
        if not resolves(dotted):
            problems.append(f"{dotted} is neither a module nor an attribute of one")
    assert not problems, f"{doc.relative_to(ROOT)}:\n  " + "\n  ".join(problems)


def test_the_checks_can_fail():
    """The reader finds what a stale doc would hold."""
    verbs = cli_verbs()
    assert {"inspect", "demo", "calibrate"} <= verbs
    doc = "```bash\npython -m moecompile plot x\nbash scripts/nowhere.sh && python -m no_such_module\n```\n" \
          "`runtime/ep_ops.py` and `tests/test_ops.py::no_such_test`, `tests/test_kernels_*.py`\n"
    problems = [p for c in commands(doc) for p in check_command(c, verbs)]
    assert len(problems) == 3, problems
    paths = named_paths(doc)
    assert paths == {"runtime/ep_ops.py", "tests/test_ops.py::no_such_test", "tests/test_kernels_*.py"}
    assert [bool(exists(p)) for p in sorted(paths)] == [True, False, True]  # the stale path, the missing test
    assert not resolves("moecompile.runtime.ep_ops") and resolves("moecompile.runtime.comm.exchange.emulate_links")


def test_the_one_device_example_runs():
    """The README's example on one device runs as written (a fresh process, as a user pastes it) and rewrites the
    layers it says it does."""
    import subprocess
    import sys

    text = (ROOT / "README.md").read_text()
    section = text.split("## On one device", 1)[1]
    lang, code = FENCE.search(section).groups()
    assert lang == "python" and "backend=\"moe\"" in code
    code += "\nprint('final loss', loss.item())\n"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-4000:]
    assert "2 MoE layer(s) rewritten, 0 skipped" in out.stdout and "final loss" in out.stdout, out.stdout[-4000:]
