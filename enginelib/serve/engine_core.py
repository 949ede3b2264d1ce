"""The engine core in its own process, as vLLM V1 runs it: the server's Python never waits on the model's.

In one process, the event loop (HTTP, JSON, SSE) and the engine loop (schedule,
run, detokenize) share one interpreter lock: while one runs Python, the other
waits. :class:`EngineCoreClient` has :class:`AsyncEngine`'s API, but the
:class:`Engine` lives in a child process that does nothing else:

    API process                               engine-core process
    HTTP, chat template, tokenize,            add / abort ──►  schedule, run the model,
    check the prompt, SSE            ◄── one message per step  sample, detokenize, stop strings

A prompt is tokenized and checked (length, vocabulary) in the API process, so a
refused one never reaches the engine. Each step the core sends one message: the
deltas of every request that moved, and the engine's counters. The channel is a
``multiprocessing`` pipe (pickle over a Unix socket): a step's message of 32
deltas takes tens of microseconds, against tens of milliseconds for the step.
Detokenizing and stop strings stay with the engine (vLLM moves them to the API
process): they cost microseconds a token, and a stop string found where the
token is sampled ends the request in that very step, with no extra token and
no abort sent back.
"""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import multiprocessing
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future
from multiprocessing.connection import Connection
from typing import Any

from enginelib.config import SamplingParams, stop_hold_back
from enginelib.core.engine import Engine, EngineStats
from enginelib.core.outputs import DeltaCursor
from enginelib.model.device import set_threads
from enginelib.serve.async_engine import (AsyncEngine, EngineDead, EngineOverloaded, RequestStream, _call_soon,
                                          _put_all, _Stream, checked_prompt, overloaded)

log = logging.getLogger(__name__)


class EngineCoreClient:
    """``AsyncEngine``'s API over an engine in a child process. ``build`` makes the :class:`Engine` there: a
    picklable callable (a module-level function, or a ``functools.partial`` of one), since the child is
    spawned, not forked (a forked child would inherit the parent's threads and CUDA state half-made).
    The constructor returns once the core is ready (its model loaded); a failed build raises here.
    As with any spawned process, a script that makes one needs Python's ``if __name__ == "__main__":`` guard.
    ``cpus`` pins the core to those CPUs (Linux), so the server's own work runs on the others."""

    def __init__(self, build: Callable[[], Engine], *, max_waiting: int | None = None, threads: int | None = None,
                 cpus: set[int] | None = None, timeout: float = 600.0) -> None:
        if max_waiting is not None and max_waiting < 0:
            raise ValueError(f"max_waiting must be >= 0 (or None for no limit), got {max_waiting}")
        self.max_waiting = max_waiting
        context = multiprocessing.get_context("spawn")
        self._conn, child = context.Pipe()
        self.process = context.Process(target=_run_core, args=(child, build, max_waiting, threads, cpus),
                                       name="engine-core", daemon=True)
        self.process.start()
        child.close()  # ours is closed in the child: when either side exits, the other's recv raises EOFError
        if not self._conn.poll(timeout):
            self.process.kill()
            raise TimeoutError(f"the engine core was not ready within {timeout} s")
        try:
            kind, *ready = self._conn.recv()
        except EOFError:
            self.process.join(5)
            kind, ready = f"it exited with code {self.process.exitcode}", []
        if kind != "ready":
            self.process.join(5)
            raise RuntimeError(f"the engine core failed to start: {ready[0] if ready else kind}")
        self.tokenizer, self.context_length, self.vocab_size, self.stats = ready
        self.error: BaseException | None = None
        self._stopping = False
        self._send_lock, self._lock = threading.Lock(), threading.Lock()
        self._streams: dict[str, _Stream] = {}         # the reader thread delivers to these
        self._pending: dict[int, tuple[Future, _Stream | None]] = {}  # commands waiting for the core's answer
        self._ids = itertools.count()
        self._reader = threading.Thread(target=self._read, name="engine-core-reader", daemon=True)
        self._reader.start()

    # --- the caller's side (any thread, any event loop) -----------------------------------

    async def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                          request_id: str | None = None) -> RequestStream:
        """Tokenize and check the request here, then queue it in the core; bad input raises ``ValueError``
        before anything reaches the core."""
        params = SamplingParams() if params is None else params
        ids = checked_prompt(prompt, params, self.tokenizer, self.vocab_size, self.context_length)
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())  # the core makes the deltas
        request_id = await self._call("add", ids, params, request_id, stream=stream)
        return RequestStream(self, request_id, stream.queue)

    generate = AsyncEngine.generate  # the same: queue with add_request, yield the deltas, abort if left early

    async def abort(self, request_id: str) -> bool:
        """Abort a request; False if it had already finished (or never existed)."""
        with self._lock:
            self._streams.pop(request_id, None)
        return await self._call("abort", request_id)

    def _close(self, request_id: str) -> None:
        """A stream closed before its end (its client left): abort it in the core, answer unread."""
        with self._lock:
            self._streams.pop(request_id, None)
        if self.is_running:
            self._send(("abort", None, request_id))

    @property
    def is_running(self) -> bool:
        return self.error is None and self._reader.is_alive()

    def join(self, timeout: float | None = None) -> None:
        """Wait until the core stops (shut down, or dead: see ``error``)."""
        self._reader.join(timeout)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the core (requests in flight are aborted) and wait for its process."""
        self._stopping = True
        if self.process.is_alive():
            with contextlib.suppress(BrokenPipeError):  # it died meanwhile: nothing to stop, the kill below reaps it
                self._send(("stop",))
            self.process.join(timeout)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        self._reader.join(timeout)

    async def _call(self, kind: str, *args: Any, stream: _Stream | None = None) -> Any:
        if not self.is_running:
            raise EngineDead(f"the engine core is not running (error: {self.error!r})")
        future: Future = Future()
        with self._lock:
            command = next(self._ids)
            self._pending[command] = (future, stream)
        self._send((kind, command, *args))
        return await asyncio.wrap_future(future)

    def _send(self, message: tuple) -> None:
        with self._send_lock:
            self._conn.send(message)

    # --- the reader thread: the core's messages, to their callers ------------------------------

    def _read(self) -> None:
        error: BaseException = EngineDead("the engine core was shut down")
        try:
            while True:
                kind, *body = self._conn.recv()
                if kind == "step":
                    self._deliver(*body)
                elif kind == "answer":
                    self._answer(*body)
                else:  # "dead": the core's loop raised; it exits after this message
                    error = EngineDead(f"the engine core stopped: {body[0]}")
                    self.error = error
                    return
        except (EOFError, OSError):  # the pipe closed: the core exited (shut down, or killed)
            if not self._stopping:
                self.error = EngineDead("the engine core exited")  # at once: /health answers 503 from now on
                self.process.join(5)  # reap it, for its exit code
                self.error = error = EngineDead(f"the engine core exited with code {self.process.exitcode}")
        finally:
            self._fail_everyone(error)

    def _answer(self, command: int, result: Any, error: BaseException | None) -> None:
        with self._lock:
            future, stream = self._pending.pop(command)
        if not future.set_running_or_notify_cancel():  # its caller stopped waiting (a client gone mid-add)
            if error is None and stream is not None:
                self._send(("abort", None, result))  # a request nobody will read
            return
        if error is not None:
            future.set_exception(error)
            return
        if stream is not None:
            with self._lock:
                self._streams[result] = stream
        future.set_result(result)

    def _deliver(self, deltas: list, stats: EngineStats) -> None:
        self.stats = stats
        batches: dict[asyncio.AbstractEventLoop, list] = {}
        with self._lock:
            for delta in deltas:
                stream = self._streams.get(delta.request_id)
                if stream is None:
                    continue  # closed by its caller: nobody reads it
                if delta.finished:
                    del self._streams[delta.request_id]
                batches.setdefault(stream.loop, []).append((stream.queue, delta))
        for loop, items in batches.items():
            _call_soon(loop, _put_all, items)

    def _fail_everyone(self, error: BaseException) -> None:
        with self._lock:
            pending, self._pending = self._pending, {}
            streams, self._streams = self._streams, {}
        for future, _ in pending.values():
            if future.set_running_or_notify_cancel():
                future.set_exception(error)
        for stream in streams.values():
            _call_soon(stream.loop, stream.queue.put_nowait, error)


# --- the engine-core process --------------------------------------------------------------------

def _run_core(conn: Connection, build: Callable[[], Engine], max_waiting: int | None, threads: int | None,
              cpus: set[int] | None) -> None:
    """The child: build the engine, say ready, then step while there is work and read commands between steps."""
    if cpus:
        os.sched_setaffinity(0, cpus)  # before torch starts its threads: they inherit it
    set_threads(threads)
    try:
        engine = build()
    except BaseException as error:  # noqa: BLE001 - the parent raises it; this process ends here
        conn.send(("failed", f"{type(error).__name__}: {error}"))
        raise SystemExit(1) from error
    conn.send(("ready", engine.tokenizer, engine.model.cfg.context_length, engine.model.cfg.vocab_size,
               engine.stats()))
    cursors: dict[str, DeltaCursor] = {}
    try:
        while True:
            busy = engine.has_unfinished_requests()
            timeout = 0 if busy else None  # idle: sleep until a command comes
            while conn.poll(timeout):
                timeout = 0
                command = conn.recv()
                if command[0] == "stop":
                    return
                _apply(engine, command, cursors, max_waiting, conn)
            if busy or engine.has_unfinished_requests():
                deltas = []
                for out in engine.step():
                    cursor = cursors.pop(out.request_id, None) if out.finished else cursors.get(out.request_id)
                    if cursor is not None:  # None: aborted, nobody waits for it
                        deltas.append(cursor.delta(out))
                conn.send(("step", deltas, engine.stats()))
    except EOFError:
        return  # the API process is gone: nobody to serve
    except BaseException as error:  # noqa: BLE001 - told to the API process, which fails every caller
        log.exception("the engine core stopped")
        conn.send(("dead", repr(error)))
        raise SystemExit(1) from error


def _apply(engine: Engine, command: tuple, cursors: dict[str, DeltaCursor], max_waiting: int | None,
           conn: Connection) -> None:
    """One command from the API process; a caller's error (a full queue, a pool too small) goes back to it."""
    kind, number, *args = command
    result, error = None, None
    try:
        if kind == "add":
            ids, params, request_id = args
            if (why := overloaded(engine.scheduler, max_waiting)) is not None:
                raise EngineOverloaded(why)
            result = engine.add_request(ids, params, request_id)
            cursors[result] = DeltaCursor(stop_hold_back(params))
        else:  # "abort": False when it had finished already
            result = cursors.pop(args[0], None) is not None
            if result:
                engine.abort(args[0])
    except (ValueError, EngineOverloaded) as caught:
        error = caught
    if number is not None:
        conn.send(("answer", number, result, error))
