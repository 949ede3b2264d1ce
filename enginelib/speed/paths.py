"""Which path actually ran: a record of the kernels, compile modes and CUDA graphs used, and of every fallback.

The speed code often has a plan B: ``kernel="auto"`` leaves out a Triton kernel that fails, the engine runs eagerly
where ``torch.compile`` fails, inductor skips CUDA graphs it cannot capture. Each says so once, in a warning or a
log line, and the run goes on, so a check that only looks at exit codes passes on the slow path. Here every such
place records a :class:`PathEvent` (what was asked for, what ran, why), and the paths that ran as asked record one
too, so a test or the GPU check (``.ci/gpu_check.sh``) can read which path a chapter or a benchmark section took:

- :func:`events` and :func:`fallbacks` in this process; with ``$ENGINELIB_PATHS_LOG`` set to a file, every new
  event is also appended to it as a JSON line (a notebook's kernel, a server: other processes), read back by
  :func:`read_log`;
- with ``$ENGINELIB_STRICT_PATHS=1`` a fallback from a path asked for by name (``explicit``) raises
  :class:`FallbackError` instead of going on, so a run stops where it left the path it asked for.

An event is recorded once per process (the same kernel called 30 times a step records it once): it costs a set
lookup on the hot path.
"""
from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import enginelib.env as env


class FallbackError(RuntimeError):
    """A fallback from a path asked for by name, under ``$ENGINELIB_STRICT_PATHS=1``."""


@dataclass(frozen=True)
class PathEvent:
    """One path decision: ``what`` (e.g. "quant kernel int4 [576, 576]", "compiled decode", "CUDA graphs",
    "decode attention"), what was asked for, what ran, and for a fallback why the asked-for path did not."""

    what: str
    requested: str
    ran: str
    why: str = ""
    fallback: bool = False
    section: str = ""  # the part of a run it happened in (:func:`section`): a benchmark section, say


_events: list[PathEvent] = []
_seen: set[tuple[str, str, str, str, bool, str]] = set()  # the events' fields: a tuple is cheaper to build
_section: list[str] = [""]  # a stack: the innermost section names new events


def strict() -> bool:
    """Whether ``$ENGINELIB_STRICT_PATHS`` asks fallbacks from explicitly requested paths to raise (read each time,
    so a test or a notebook can set it late)."""
    return env.strict_paths()


def _record(what: str, requested: str, ran: str, why: str, fallback: bool) -> None:
    key = (what, requested, ran, why, fallback, _section[-1])
    if key in _seen:
        return
    _seen.add(key)
    event = PathEvent(*key)
    _events.append(event)
    log = env.paths_log()
    if log:
        with open(log, "a", encoding="utf-8") as f:  # one short line per event: appends from processes stay whole
            f.write(json.dumps(asdict(event)) + "\n")


def ran(what: str, path: str, requested: str | None = None) -> None:
    """Record that ``path`` ran for ``what``, as asked (``requested``: what was asked for, default ``path``)."""
    _record(what, path if requested is None else requested, path, "", False)


def fell_back(what: str, requested: str, ran: str, why: str, *, explicit: bool = True) -> None:
    """Record that ``ran`` runs for ``what`` instead of ``requested``, because of ``why``; the caller warns or
    logs as before. ``explicit``: the path was asked for by name (not one of ``auto``'s candidates): then, under
    ``$ENGINELIB_STRICT_PATHS=1``, this raises :class:`FallbackError` after recording it."""
    _record(what, requested, ran, why, True)
    if explicit and strict():
        raise FallbackError(f"{what}: asked for {requested}, would run {ran}: {why} (${env.STRICT_PATHS} is set)")


@contextmanager
def section(name: str) -> Iterator[None]:
    """Events recorded inside are tagged ``name`` (a benchmark's section, a chapter's part)."""
    _section.append(name)
    try:
        yield
    finally:
        _section.pop()


def events() -> list[PathEvent]:
    """Every event of this process so far, in order."""
    return list(_events)


def fallbacks() -> list[PathEvent]:
    """The fallbacks among :func:`events`."""
    return [e for e in _events if e.fallback]


def clear() -> None:
    """Forget this process's events (a test starts from none; the log file is left as it is)."""
    _events.clear()
    _seen.clear()


def read_log(path: str | os.PathLike) -> list[PathEvent]:
    """The events a ``$ENGINELIB_PATHS_LOG`` file holds, in order, duplicates from several processes dropped
    (none when the file does not exist: nothing in that run reached the speed code)."""
    path = Path(path)
    if not path.exists():
        return []
    found: dict[PathEvent, None] = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            found.setdefault(PathEvent(**json.loads(line)), None)
    return list(found)


__all__ = ["FallbackError", "PathEvent", "clear", "events", "fallbacks", "fell_back", "ran", "read_log", "section",
           "strict"]
