"""An object that lives in a child process, so that native code which crashes kills the child, not the benchmark.

llama-cpp-python built from its sdist segfaulted on its first prompt on one
Intel Xeon, and a segfault in the benchmark's own process ended the whole run
with no number at all. Here the peer is built and called in a child
(:class:`Child`): each method call is pickled over the child's stdin, the
answer comes back on its stdout. When the child dies, the call raises
:class:`ChildCrashed`, which says how it died (the signal), which native call
was in flight (:func:`native_call` writes the name into a small shared file,
a plain memory write, before each call into C, and clears it after) and the
last lines the child printed, with :mod:`faulthandler`'s Python traceback.

The child imports this module and its target without running ``enginelib``'s
package ``__init__`` (which imports torch): it starts in about 0.3 s and
holds no second copy of torch.
"""
from __future__ import annotations

import contextlib
import mmap
import os
import pickle
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

MARKER_BYTES = 256
_marker: mmap.mmap | None = None  # set in a child: where native_call writes the call in flight

# Run by ``python -c``: bare ``enginelib`` and ``enginelib.bench`` packages (their __init__s import torch), then serve.
_BOOT = """
import sys, types
for name, path in (("enginelib", sys.argv[1]), ("enginelib.bench", sys.argv[2])):
    package = sys.modules[name] = types.ModuleType(name)
    package.__path__ = [path]
from enginelib.bench.child import serve
serve(sys.argv[3], sys.argv[4])
"""


@contextlib.contextmanager
def native_call(name: str) -> Iterator[None]:
    """Mark ``name`` as the native call in flight, so that a crash inside it is reported by name.

    Outside a child (the peer run in-process, in a test) it marks nothing.
    """
    if _marker is None:
        yield
        return
    _marker[:MARKER_BYTES] = name.encode()[:MARKER_BYTES - 1].ljust(MARKER_BYTES, b"\0")
    try:
        yield
    finally:
        _marker[0] = 0  # one byte: the name no longer counts


class ChildCrashed(RuntimeError):
    """The child process died during a call: how (``signal`` or ``returncode``) and in which native call."""

    def __init__(self, label: str, returncode: int | None, call: str | None, log_tail: str):
        self.label, self.returncode, self.call, self.log_tail = label, returncode, call, log_tail
        self.signal = -returncode if returncode is not None and returncode < 0 else None
        if self.signal is not None:
            how = f"signal {self.signal}"
            with contextlib.suppress(ValueError):  # a number with no name on this OS keeps just the number
                how += f" ({signal.Signals(self.signal).name})"
        elif returncode is None:
            how = "stopped answering"
        else:
            how = f"exited with code {returncode}"
        where = f" in {call}" if call else " outside any marked native call"
        super().__init__(f"{label} crashed: {how}{where}")

    def python_frame(self) -> str | None:
        """The innermost Python frame of faulthandler's traceback (``File "...", line N in f``), if it printed one."""
        lines = self.log_tail.splitlines()
        for i, line in enumerate(lines):
            if "most recent call first" in line and i + 1 < len(lines):
                return lines[i + 1].strip()
        return None

    def summary(self) -> dict:
        """What the report keeps: the headline, the signal, the call in flight, the Python frame, the log's end."""
        return {"crashed": str(self), "signal": self.signal, "returncode": self.returncode, "call": self.call,
                "python_frame": self.python_frame(), "log_tail": self.log_tail}


def child_env() -> dict[str, str]:
    """The environment a child starts with: this one, with this process's ``sys.path`` so it imports what we can."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    return env


class Child:
    """``target(*args, **kwargs)`` built in a child process; :meth:`call` runs its methods there.

    ``target`` is ``"module:attribute"``. A Python exception in the child is
    raised here as it was raised there; a child that dies raises
    :class:`ChildCrashed` (named ``label``) on this call and every later one.
    """

    def __init__(self, target: str, *args: Any, label: str = "the child", **kwargs: Any):
        self.label, self.crashed = label, None
        bench = Path(__file__).resolve().parent
        fd, marker = tempfile.mkstemp(prefix="enginelib-child-", suffix=".call")
        os.write(fd, b"\0" * MARKER_BYTES)
        os.close(fd)
        self._marker_path = Path(marker)
        self._log = tempfile.TemporaryFile(prefix="enginelib-child-", suffix=".log")
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _BOOT, str(bench.parent), str(bench), target, marker],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, env=child_env())
        try:
            self.call("__init__", *args, **kwargs)
        except BaseException:
            self.close()
            raise

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Run ``method(*args, **kwargs)`` on the child's object and return its value (pickled both ways)."""
        if self.crashed is not None:
            raise self.crashed
        try:
            pickle.dump((method, args, kwargs), self.proc.stdin)
            self.proc.stdin.flush()
            status, value = pickle.load(self.proc.stdout)
        except (EOFError, BrokenPipeError, pickle.UnpicklingError):
            self.crashed = self._crash()
            raise self.crashed from None
        if status == "error":
            raise value
        return value

    def log(self) -> str:
        """What the child printed to stderr (and stdout) so far: llama.cpp's own messages, faulthandler's."""
        self._log.seek(0)
        return self._log.read().decode(errors="replace")

    def _crash(self) -> ChildCrashed:
        try:
            returncode = self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:  # it closed its pipe but lives on: end it, and say it stopped answering
            self.proc.kill()
            self.proc.wait()
            returncode = None
        call = self._marker_path.read_bytes().split(b"\0", 1)[0].decode(errors="replace") or None
        tail = "\n".join(self.log().splitlines()[-20:])
        return ChildCrashed(self.label, returncode, call, tail)

    def close(self) -> None:
        """Ask the child's object to close and the child to exit; end it if it does not within 30 s."""
        if self.proc.poll() is None and self.crashed is None:
            with contextlib.suppress(ChildCrashed):  # dying while it closes changes nothing now
                self.call("__close__")
        if self.proc.stdin:
            with contextlib.suppress(BrokenPipeError):
                self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc.stdout.close()
        self._log.close()
        self._marker_path.unlink(missing_ok=True)

    def __enter__(self) -> Child:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def serve(target: str, marker_path: str) -> None:
    """The child's loop: build the target on the first call, then answer calls until ``__close__`` or EOF."""
    global _marker
    import faulthandler
    import importlib

    faulthandler.enable(all_threads=True)  # stderr is the parent's log file: the traceback lands there
    with open(marker_path, "r+b") as f:
        _marker = mmap.mmap(f.fileno(), MARKER_BYTES)
    answers = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # what native code prints to stdout goes to the log, never into the answers
    sys.stdout = sys.stderr
    calls = sys.stdin.buffer
    module, _, attr = target.partition(":")
    obj = None
    while True:
        try:
            method, args, kwargs = pickle.load(calls)
        except EOFError:
            return
        try:
            if method == "__init__":
                obj = getattr(importlib.import_module(module), attr)(*args, **kwargs)
                value = None
            elif method == "__close__":
                close = getattr(obj, "close", None)
                value = close() if close is not None else None
            else:
                value = getattr(obj, method)(*args, **kwargs)
            answer = pickle.dumps(("ok", value))
        except Exception as err:  # noqa: BLE001 - every Python error goes back to the caller, to be raised there
            try:
                answer = pickle.dumps(("error", err))
            except Exception:  # noqa: BLE001 - an exception that does not pickle goes back as its text
                answer = pickle.dumps(("error", RuntimeError(f"{type(err).__name__}: {err}")))
        answers.write(answer)
        answers.flush()
        if method == "__close__":
            return
