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
the last one (:class:`~enginelib.core.outputs.StreamDelta`).
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from enginelib.config import SamplingParams, as_token_ids, check_request, stop_hold_back
from enginelib.core.engine import Engine, EngineStats
from enginelib.core.outputs import DeltaCursor, RequestOutput, StreamDelta
from enginelib.core.scheduler import Scheduler
from enginelib.model.device import set_threads

if TYPE_CHECKING:
    from enginelib.model.tokenizer import Tokenizer

log = logging.getLogger(__name__)


class EngineOverloaded(RuntimeError):
    """The waiting queue is full: try again later (a server answers 503 with Retry-After)."""


class EngineDead(RuntimeError):
    """The engine loop stopped on an error; every request in flight got it, and no new one is taken."""


class RequestFailed(RuntimeError):
    """One request failed inside the engine (``finish_reason="error"``: its sampling or its text); the engine
    and every other request went on. ``delta`` is its last delta (``error`` says why, with its metrics)."""

    def __init__(self, delta: StreamDelta) -> None:
        super().__init__(f"request {delta.request_id} failed in the engine: {delta.error}")
        self.delta = delta


@dataclass
class _Stream:
    """Where one request's deltas go: the caller's event loop and queue."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    cursor: DeltaCursor | None = None  # where the deltas are made here (not in an engine-core process)


class AsyncEngine:
    """Run ``engine`` in a background thread; ``generate`` streams a request's deltas to an asyncio caller.

    ``max_waiting`` bounds the waiting queue beyond the free seats of the batch: past it, ``generate``
    raises :class:`EngineOverloaded` instead of queueing work nobody will wait for (a burst that the
    free seats take at the next step is never refused).
    ``threads`` is the loop thread's torch CPU thread count (``set_threads``'s default when None).
    """

    def __init__(self, engine: Engine, *, max_waiting: int | None = None, threads: int | None = None) -> None:
        if max_waiting is not None and max_waiting < 0:
            raise ValueError(f"max_waiting must be >= 0 (or None for no limit), got {max_waiting}")
        self.engine, self.max_waiting, self._threads = engine, max_waiting, threads
        self.tokenizer = engine.tokenizer
        self.context_length, self.vocab_size = engine.model.cfg.context_length, engine.model.cfg.vocab_size
        self._commands: queue.SimpleQueue[tuple[Callable[[], Any], Future]] = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}  # only the loop thread reads or writes this
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
        ids = checked_prompt(prompt, params, self.tokenizer, self.vocab_size, self.context_length)
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue(), DeltaCursor())
        request_id = await self._call(self._add, ids, params, request_id, stream)
        return RequestStream(self, request_id, stream.queue)

    async def generate(self, prompt: str | list[int], params: SamplingParams | None = None,
                       request_id: str | None = None) -> AsyncIterator[StreamDelta]:
        """Queue a request and yield its deltas until it finishes.

        If the caller stops iterating early (a client disconnected), the request
        is aborted and its blocks go back to the pool within a step. A request
        that fails in the engine raises :class:`RequestFailed` (the engine goes on).
        """
        stream = await self.add_request(prompt, params, request_id)
        try:
            async for delta in stream:
                yield delta
        finally:
            stream.close()

    async def abort(self, request_id: str) -> bool:
        """Abort a request; False if it had already finished (or never existed)."""
        return await self._call(self._abort, request_id)

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

    # --- the loop thread -------------------------------------------------------------------

    def _add(self, prompt: list[int], params: SamplingParams, request_id: str | None, stream: _Stream) -> str:
        if (why := overloaded(self.engine.scheduler, self.max_waiting)) is not None:
            raise EngineOverloaded(why)
        request_id = self.engine.add_request(prompt, params, request_id)
        stream.cursor.hold_back = stop_hold_back(params)
        self._streams[request_id] = stream
        return request_id

    def _close(self, request_id: str) -> None:
        """A stream closed before its end (its client left): abort it at the loop's next turn, answer unread."""
        self._submit(self._abort, request_id)

    def _abort(self, request_id: str) -> bool:
        if self._streams.pop(request_id, None) is None:
            return False  # finished (or aborted) already: its blocks are free
        self.engine.abort(request_id)
        return True

    def _run(self) -> None:
        set_threads(self._threads)  # torch's thread count is set per thread
        try:
            while not self._stopping:
                busy = self.engine.has_unfinished_requests()
                self._apply_commands(block=not busy)
                if self.engine.has_unfinished_requests() or busy:
                    self._deliver(self.engine.step())
                self.stats = self.engine.stats()
        except BaseException as error:  # noqa: BLE001 - logged, handed to every waiting caller; the loop ends
            self.error = error
            log.exception("the engine loop stopped")
        finally:
            self._fail_commands()
            stopped = self.error or EngineDead("the engine was shut down")
            for stream in self._streams.values():  # nobody would ever finish these: tell their callers
                _call_soon(stream.loop, stream.queue.put_nowait, stopped)
            if self.error is None:
                for request_id in list(self._streams):
                    self._abort(request_id)

    def _apply_commands(self, block: bool) -> None:
        """Run every queued command; when idle, sleep until one comes."""
        while True:
            try:
                fn, future = self._commands.get(block=block)
            except queue.Empty:
                return
            block = False
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except Exception as error:  # the caller's error (a bad request): raised in the caller
                    future.set_exception(error)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """Hand each output's delta to its caller: one wake-up per event loop per step."""
        batches: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, StreamDelta]]] = {}
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue  # aborted: nobody waits for it
            if out.finished:
                del self._streams[out.request_id]
            batches.setdefault(stream.loop, []).append((stream.queue, stream.cursor.delta(out)))
        for loop, items in batches.items():
            _call_soon(loop, _put_all, items)

    def _fail_commands(self) -> None:
        while True:
            try:
                _, future = self._commands.get(block=False)
            except queue.Empty:
                return
            if future.set_running_or_notify_cancel():
                future.set_exception(EngineDead(f"the engine loop stopped (error: {self.error!r})"))


class RequestStream:
    """One request's deltas, as an async iterator; ``close()`` aborts it if it has not finished. A request that
    failed in the engine raises :class:`RequestFailed` in place of its last delta."""

    def __init__(self, engine: AsyncEngine, request_id: str, deltas: asyncio.Queue) -> None:
        self.engine, self.request_id, self._deltas = engine, request_id, deltas
        self.finished = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> StreamDelta:
        if self.finished:
            raise StopAsyncIteration
        delta = await self._deltas.get()
        if isinstance(delta, BaseException):
            self.finished = True
            raise delta if isinstance(delta, EngineDead) else EngineDead(f"the engine loop stopped: {delta!r}")
        self.finished = delta.finished
        if delta.finish_reason == "error":
            raise RequestFailed(delta)
        return delta

    def close(self) -> None:
        """Abort the request unless it finished; safe to call twice."""
        if not self.finished:
            self.finished = True
            self.engine._close(self.request_id)


def checked_prompt(prompt: str | list[int], params: SamplingParams, tokenizer: Tokenizer, vocab_size: int,
                   context_length: int) -> list[int]:
    """The prompt's token ids, checked against the model (length, vocabulary) and ``params``: ``ValueError``
    if the engine would refuse it, before it costs the engine anything."""
    if isinstance(prompt, str) and isinstance(params, SamplingParams):
        refuse_long_text(prompt, params.max_tokens, tokenizer, context_length)
    ids = tokenizer.encode(prompt) if isinstance(prompt, str) else as_token_ids(prompt)
    check_request(ids, params, vocab_size, context_length)
    return ids


def refuse_long_text(text: str, max_tokens: int, tokenizer: Tokenizer, context_length: int) -> None:
    """``ValueError`` for a text that cannot fit the context whatever its tokens: each token stands for at most
    ``tokenizer.max_token_bytes`` bytes, so this costs a length, not a tokenization."""
    fewest = -(-len(text.encode("utf-8", "surrogatepass")) // tokenizer.max_token_bytes)
    if fewest + max_tokens > context_length:
        raise ValueError(f"prompt (at least {fewest} tokens) + max_tokens ({max_tokens}) exceeds the model's "
                         f"context of {context_length} tokens: shorten the prompt or lower max_tokens")


def overloaded(scheduler: Scheduler, max_waiting: int | None) -> str | None:
    """Why a new request is turned away (None: it is taken). Only the requests that no free seat will take at
    the next step count: a burst of commands lands in the waiting queue before the loop steps, and those that
    fill free seats are not waiting for anyone."""
    queued = len(scheduler.waiting) - max(0, scheduler.config.max_num_seqs - len(scheduler.running))
    if max_waiting is None or queued < max_waiting:
        return None
    return f"{queued} requests are already waiting beyond the free seats (the limit is {max_waiting}): retry later"


def _put_all(items: list[tuple[asyncio.Queue, StreamDelta]]) -> None:
    for q, delta in items:
        q.put_nowait(delta)


def _call_soon(loop: asyncio.AbstractEventLoop, fn: Callable[..., Any], *args: Any) -> None:
    """Schedule ``fn`` on ``loop`` from the engine thread; a closed loop's caller is gone and gets nothing."""
    if not loop.is_closed():
        loop.call_soon_threadsafe(fn, *args)
