"""``AsyncEngine``: one engine loop, in its own thread, serving every caller of an asyncio program.

The :class:`Engine` is not thread-safe and need not be: only the loop thread
touches it. Callers hand it commands (add, abort) through a queue and get their
answers back as futures; each request's deltas come back on an ``asyncio.Queue``
of the caller's event loop. So requests from different clients share decode
steps, and the event loop never waits for the model.

    engine = AsyncEngine(Engine(model, tokenizer))
    async for delta in engine.generate("Hello", SamplingParams(max_tokens=16)):
        print(delta.text, end="")

Shaped like vLLM's ``AsyncLLM.generate``, but yielding deltas: what is new since
the last one (:class:`~enginelib.core.outputs.StreamDelta`). It is an
:class:`~enginelib.serve.engine_client.EngineClient`, as the engine core in its own
process is; the loop's body (:class:`~enginelib.serve.engine_loop.EngineLoop`) is the same in both.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from typing import Any

from enginelib.config import SamplingParams
from enginelib.core.engine import Engine, EngineStats
from enginelib.core.outputs import StreamDelta
from enginelib.core.prompt import CheckedPrompt, check_prompt
from enginelib.model.device import set_threads
from enginelib.serve.engine_client import (EngineDead, RequestStream, Subscriber, Subscribers, check_max_waiting,
                                           generate_deltas, overload)
from enginelib.serve.engine_loop import EngineLoop

log = logging.getLogger(__name__)


class AsyncEngine:
    """Run ``engine`` in a background thread; ``generate`` streams a request's deltas to an asyncio caller.

    ``max_waiting`` bounds the waiting queue beyond the free seats of the batch: past it, ``generate``
    raises :class:`EngineOverloaded` instead of queueing work nobody will wait for (a burst that the
    free seats take at the next step is never refused).
    ``threads`` is the loop thread's torch CPU thread count (``set_threads``'s default when None).
    """

    def __init__(self, engine: Engine, *, max_waiting: int | None = None, threads: int | None = None) -> None:
        check_max_waiting(max_waiting)
        self.engine, self.max_waiting, self._threads = engine, max_waiting, threads
        self.tokenizer = engine.tokenizer
        self.context_length, self.vocab_size = engine.model.cfg.context_length, engine.model.cfg.vocab_size
        self._engine_loop = EngineLoop(engine, max_waiting)  # only the loop thread touches it
        self._commands: queue.SimpleQueue[tuple[Callable[[], Any], Future]] = queue.SimpleQueue()
        self._subscribers = Subscribers()
        self._stopping = False
        self.error: BaseException | None = None
        self.stats: EngineStats = engine.stats()  # a snapshot after every step, safe to read from any thread
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    # --- the caller's side (any thread, any event loop) -----------------------------------

    async def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                          request_id: str | None = None) -> RequestStream:
        """Queue a request; its deltas come from the returned stream.

        The prompt is tokenized and checked here, in the caller's thread, not in
        the engine loop's: bad input raises ``ValueError`` before anything is
        queued, so a server can answer 400 before it starts a streamed response.
        """
        params = SamplingParams() if params is None else params
        checked = check_prompt(prompt, params, self.tokenizer, self.vocab_size, self.context_length)
        subscriber = Subscriber.here()
        request_id = await self._call(self._add, checked, request_id, subscriber)
        return RequestStream(request_id, subscriber.queue, self._close)

    def generate(self, prompt: str | list[int], params: SamplingParams | None = None,
                 request_id: str | None = None) -> AsyncIterator[StreamDelta]:
        """Queue a request and yield its deltas until it finishes.

        If the caller stops iterating early (a client disconnected), the request
        is aborted and its blocks go back to the pool within a step. A request
        that fails in the engine raises :class:`RequestFailed` (the engine goes on).
        """
        return generate_deltas(self, prompt, params, request_id)

    async def abort(self, request_id: str) -> bool:
        """Abort a request; False if it had already finished (or never existed)."""
        return await self._call(self._abort, request_id)

    def overloaded(self) -> str | None:
        """Why a request would be turned away now (None: it would be taken), from the latest step's counters."""
        return overload(self.stats.waiting, self.stats.running, self._engine_loop.max_num_seqs, self.max_waiting)

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def join(self, timeout: float | None = None) -> None:
        """Wait until the loop thread ends (shut down, or stopped by an error: see ``error``)."""
        self._thread.join(timeout)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the loop thread (requests still in flight are aborted)."""
        self._stopping = True
        self._submit(lambda: None)  # wake the loop if it sleeps on an empty queue
        self._thread.join(timeout)

    def _submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        future: Future = Future()
        self._commands.put((lambda: fn(*args), future))
        return future

    async def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        if not self.is_running:
            raise EngineDead(f"the engine loop is not running (error: {self.error!r})")
        return await asyncio.wrap_future(self._submit(fn, *args))

    def _close(self, request_id: str) -> None:
        """A stream closed before its end (its client left): abort it at the loop's next turn, answer unread."""
        self._submit(self._abort, request_id)

    # --- the loop thread -------------------------------------------------------------------

    def _add(self, prompt: CheckedPrompt, request_id: str | None, subscriber: Subscriber) -> str:
        request_id = self._engine_loop.add(prompt, request_id)
        self._subscribers.add(request_id, subscriber)  # before the next step: its first delta finds its subscriber
        return request_id

    def _abort(self, request_id: str) -> bool:
        self._subscribers.pop(request_id)
        return self._engine_loop.abort(request_id)

    def _run(self) -> None:
        set_threads(self._threads)  # torch's thread count is set per thread
        try:
            while not self._stopping:
                deltas = self._engine_loop.turn(self._apply_commands)
                if deltas is not None:
                    self._subscribers.deliver(deltas)
                self.stats = self.engine.stats()
        except BaseException as error:  # noqa: BLE001 - logged, handed to every waiting caller; the loop ends
            self.error = error
            log.exception("the engine loop stopped")
        finally:
            self._fail_commands()
            # nobody would ever finish these: tell their callers
            self._subscribers.fail_all(self.error or EngineDead("the engine was shut down"))
            if self.error is None:
                self._engine_loop.abort_all()

    def _apply_commands(self, block: bool) -> bool:
        """Run every queued command; when idle, sleep until one comes. False once shut down."""
        while True:
            try:
                fn, future = self._commands.get(block=block)
            except queue.Empty:
                return not self._stopping
            block = False
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except Exception as error:  # the caller's error (a bad request): raised in the caller
                    future.set_exception(error)

    def _fail_commands(self) -> None:
        while True:
            try:
                _, future = self._commands.get(block=False)
            except queue.Empty:
                return
            if future.set_running_or_notify_cancel():
                future.set_exception(EngineDead(f"the engine loop stopped (error: {self.error!r})"))
