"""Where Dynamo broke the graph, for explain(): Dynamo counts its graph breaks by reason only (``counters``); the
place of each is in its ``graph_breaks`` log (what ``TORCH_LOGS=graph_breaks`` prints), which ``recording``
reads while explain() runs, without printing it unless the user asked for that log.

A site is the innermost frame of the break's user stack outside the standard library and Dynamo (a context
manager's ``__enter__`` in ``contextlib`` is not where the user would look), ``path:line`` with the path from the
package root (``torch/nn/parallel/distributed.py:1757``)."""

from __future__ import annotations

import contextlib
import logging
import re
import sysconfig

_FRAME = re.compile(r'File "([^"]+)", line (\d+)')
_AT = re.compile(r"in user code at (\S+):(\d+)")
_STDLIB = sysconfig.get_paths()["stdlib"]
_NOT_THE_SITE = ("/torch/_dynamo/", "/torch/_compile.py")
# DDP's forward (torch/nn/parallel/distributed.py), FSDP2's hooks and their helpers: around the modules they wrap
_WRAPPERS = ("torch/nn/parallel/", "torch/distributed/fsdp/", "torch/distributed/_composable/")


def _loggers() -> list[logging.Logger]:
    from torch._dynamo import convert_frame, symbolic_convert

    return [log for log in (getattr(m, "graph_break_log", None) for m in (symbolic_convert, convert_frame))
            if isinstance(log, logging.Logger)]


class _Keep(logging.Handler):
    def __init__(self, messages: list[str]):
        super().__init__(logging.DEBUG)
        self.messages = messages

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.messages.append(record.getMessage())
        except Exception:  # a record that does not format is not worth failing explain() for
            pass


@contextlib.contextmanager
def recording(messages: list[str]):
    """``messages`` receives the message of every graph-break log record made inside the block."""
    handler, touched = _Keep(messages), []
    for log in _loggers():
        touched.append((log, log.level, log.propagate))
        if not log.isEnabledFor(logging.DEBUG):  # not asked for: read it without printing it
            log.setLevel(logging.DEBUG)
            log.propagate = False
        log.addHandler(handler)
    try:
        yield
    finally:
        for log, level, propagate in touched:
            log.removeHandler(handler)
            log.setLevel(level)
            log.propagate = propagate


def _short(path: str) -> str:
    for root in ("site-packages/", "dist-packages/"):
        if root in path:
            return path.split(root, 1)[1]
    return path


def _candidate(path: str) -> bool:
    installed = "site-packages" in path or "dist-packages" in path  # (under the stdlib's folder outside a venv)
    return ((installed or not path.startswith(_STDLIB)) and not any(part in path for part in _NOT_THE_SITE)
            and "<" not in path)


def site(message: str, known: dict[str, str]) -> str | None:
    """The site of one log message, or None. ``known``: the "user code at" place of earlier messages -> their
    site, filled here (a duplicate break's message gives the place only, no stack)."""
    at = _AT.search(message)
    place = f"{at.group(1)}:{at.group(2)}" if at else None
    frames = [(path, line) for path, line in _FRAME.findall(message) if _candidate(path)]
    if frames:
        found = f"{_short(frames[-1][0])}:{frames[-1][1]}"
        if place:
            known.setdefault(place, found)
        return found
    if place in known:
        return known[place]
    return f"{_short(at.group(1))}:{at.group(2)}" if at and _candidate(at.group(1)) else None


def sites_by_reason(messages: list[str], reasons: dict[str, tuple[str, ...]]) -> dict[str, list[str]]:
    """For each reason (its key -> the lines a message of it contains), the sites of its messages, in order,
    each once."""
    known: dict[str, str] = {}
    placed = [(m, site(m, known)) for m in messages]
    out: dict[str, list[str]] = {}
    for key, lines in reasons.items():
        found = [s for m, s in placed if s and all(line in m for line in lines)]
        if found:
            out[key] = list(dict.fromkeys(found))
    return out


def in_wrapper(sites: list[str]) -> bool:
    """Whether every site is in the code of DDP or FSDP2 (``_WRAPPERS``; not DTensor's, which runs inside layers)."""
    return bool(sites) and all(s.startswith(_WRAPPERS) for s in sites)
