"""The engine core in its own process, as vLLM V1 runs it: the server's Python never waits on the model's.

In one process, the event loop (HTTP, JSON, SSE) and the engine loop (schedule,
run, detokenize) share one interpreter lock: while one runs Python, the other
waits. :class:`EngineCoreClient` has :class:`AsyncEngine`'s API (both are an
:class:`~enginelib.serve.engine_client.EngineClient`), but the
:class:`Engine` lives in a child process that does nothing else:

    API process                               engine-core process
    HTTP, chat template, tokenize,            add / abort ──►  schedule, run the model,
    check the prompt, SSE            ◄── one message per step  sample, detokenize, stop strings

A prompt is tokenized and checked (length, vocabulary) in the API process, so a
refused one never reaches the engine. Each step the core sends one message: the
deltas of every request that moved, and the engine's counters. The channel is a
``multiprocessing`` pipe (pickle over a Unix socket), its messages the dataclasses of :mod:`.core_messages`:
a step's message of 32 deltas takes tens of microseconds, against tens of milliseconds for the step.
Detokenizing and stop strings stay with the engine (vLLM moves them to the API
process): they cost microseconds a token, and a stop string found where the
token is sampled ends the request in that very step, with no extra token and
no abort sent back. The core's loop has the same body as :class:`AsyncEngine`'s thread
(:class:`~enginelib.serve.engine_loop.EngineLoop`).
"""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import multiprocessing
import os
import threading
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from multiprocessing.connection import Connection
from typing import Any

from enginelib.config import SamplingParams
from enginelib.core.engine import Engine
from enginelib.core.outputs import StreamDelta
from enginelib.core.prompt import check_prompt
from enginelib.model.device import set_threads
from enginelib.serve.core_messages import Abort, Add, Answer, Dead, Failed, Ready, Step, Stop
from enginelib.serve.engine_client import (EngineDead, EngineOverloaded, RequestStream, Subscriber, Subscribers,
                                           check_max_waiting, generate_deltas, overload)
from enginelib.serve.engine_loop import EngineLoop

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
        check_max_waiting(max_waiting)
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
            ready = self._conn.recv()
        except EOFError:
            self.process.join(5)
            ready = Failed(f"it exited with code {self.process.exitcode}")
        if not isinstance(ready, Ready):
            self.process.join(5)
            raise RuntimeError(f"the engine core failed to start: {ready.why}")
        self.tokenizer, self.context_length, self.vocab_size = ready.tokenizer, ready.context_length, ready.vocab_size
        self._max_num_seqs, self.stats = ready.max_num_seqs, ready.stats
        self.error: BaseException | None = None
        self._stopping = False
        self._send_lock, self._lock = threading.Lock(), threading.Lock()
        self._subscribers = Subscribers()  # the reader thread delivers to these
        self._pending: dict[int, tuple[Future, Subscriber | None]] = {}  # commands waiting for the core's answer
        self._ids = itertools.count()
        self._reader = threading.Thread(target=self._read, name="engine-core-reader", daemon=True)
        self._reader.start()

    # --- the caller's side (any thread, any event loop) -----------------------------------

    async def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                          request_id: str | None = None) -> RequestStream:
        """Tokenize and check the request here, then queue it in the core; bad input raises ``ValueError``
        before anything reaches the core."""
        params = SamplingParams() if params is None else params
        checked = check_prompt(prompt, params, self.tokenizer, self.vocab_size, self.context_length)
        subscriber = Subscriber.here()  # the core makes the deltas
        request_id = await self._call(lambda number: Add(number, checked, request_id), subscriber)
        return RequestStream(request_id, subscriber.queue, self._close)

    def generate(self, prompt: str | list[int], params: SamplingParams | None = None,
                 request_id: str | None = None) -> AsyncIterator[StreamDelta]:
        """Queue with add_request, yield the deltas until the request finishes, abort it if left early."""
        return generate_deltas(self, prompt, params, request_id)

    async def abort(self, request_id: str) -> bool:
        """Abort a request; False if it had already finished (or never existed)."""
        self._subscribers.pop(request_id)
        return await self._call(lambda number: Abort(request_id, number))

    def overloaded(self) -> str | None:
        """Why a request would be turned away now (None: it would be taken), from the core's latest counters."""
        return overload(self.stats.waiting, self.stats.running, self._max_num_seqs, self.max_waiting)

    def _close(self, request_id: str) -> None:
        """A stream closed before its end (its client left): abort it in the core, answer unread."""
        self._subscribers.pop(request_id)
        if self.is_running:
            self._send(Abort(request_id))

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
                self._send(Stop())
            self.process.join(timeout)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        self._reader.join(timeout)

    async def _call(self, command: Callable[[int], Add | Abort], subscriber: Subscriber | None = None) -> Any:
        """Send ``command(number)`` and await the core's answer to that number."""
        if not self.is_running:
            raise EngineDead(f"the engine core is not running (error: {self.error!r})")
        future: Future = Future()
        with self._lock:
            number = next(self._ids)
            self._pending[number] = (future, subscriber)
        self._send(command(number))
        return await asyncio.wrap_future(future)

    def _send(self, message: Add | Abort | Stop) -> None:
        with self._send_lock:
            self._conn.send(message)

    # --- the reader thread: the core's messages, to their callers ------------------------------

    def _read(self) -> None:
        error: BaseException = EngineDead("the engine core was shut down")
        try:
            while True:
                message = self._conn.recv()
                if isinstance(message, Step):
                    self.stats = message.stats
                    self._subscribers.deliver(message.deltas)
                elif isinstance(message, Answer):
                    self._answer(message)
                else:  # Dead: the core's loop raised; it exits after this message
                    error = EngineDead(f"the engine core stopped: {message.why}")
                    self.error = error
                    return
        except (EOFError, OSError):  # the pipe closed: the core exited (shut down, or killed)
            if not self._stopping:
                self.error = EngineDead("the engine core exited")  # at once: /health answers 503 from now on
                self.process.join(5)  # reap it, for its exit code
                self.error = error = EngineDead(f"the engine core exited with code {self.process.exitcode}")
        finally:
            self._fail_everyone(error)

    def _answer(self, answer: Answer) -> None:
        with self._lock:
            future, subscriber = self._pending.pop(answer.number)
        if not future.set_running_or_notify_cancel():  # its caller stopped waiting (a client gone mid-add)
            if answer.error is None and subscriber is not None:
                self._send(Abort(answer.result))  # a request nobody will read
            return
        if answer.error is not None:
            future.set_exception(answer.error)
            return
        if subscriber is not None:
            self._subscribers.add(answer.result, subscriber)
        future.set_result(answer.result)

    def _fail_everyone(self, error: BaseException) -> None:
        with self._lock:
            pending, self._pending = self._pending, {}
        for future, _ in pending.values():
            if future.set_running_or_notify_cancel():
                future.set_exception(error)
        self._subscribers.fail_all(error)


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
        conn.send(Failed(f"{type(error).__name__}: {error}"))
        raise SystemExit(1) from error
    served = EngineLoop(engine, max_waiting)
    conn.send(Ready(engine.tokenizer, engine.model.cfg.context_length, engine.model.cfg.vocab_size,
                    served.max_num_seqs, engine.stats()))
    stopped = False

    def take_commands(block: bool) -> bool:
        """Apply every command that came in (idle: sleep until one comes); False once told to stop."""
        nonlocal stopped
        timeout = None if block else 0
        while conn.poll(timeout):
            timeout = 0
            command = conn.recv()
            if isinstance(command, Stop):
                stopped = True
                return False
            _apply(served, command, conn)
        return True
    try:
        while not stopped:
            deltas = served.turn(take_commands)
            if deltas is not None:
                conn.send(Step(deltas, engine.stats()))
    except EOFError:
        return  # the API process is gone: nobody to serve
    except BaseException as error:  # noqa: BLE001 - told to the API process, which fails every caller
        log.exception("the engine core stopped")
        conn.send(Dead(repr(error)))
        raise SystemExit(1) from error


def _apply(served: EngineLoop, command: Add | Abort, conn: Connection) -> None:
    """One command from the API process; a caller's error (a full queue, a pool too small) goes back to it."""
    result, error = None, None
    try:
        if isinstance(command, Add):
            result = served.add(command.prompt, command.request_id)
        else:  # Abort: False when it had finished already
            result = served.abort(command.request_id)
    except (ValueError, EngineOverloaded) as caught:
        error = caught
    if command.number is not None:
        conn.send(Answer(command.number, result, error))
