"""What the server needs of an engine, wherever it runs (chapter 11): :class:`EngineClient`.

:class:`~enginelib.serve.async_engine.AsyncEngine` runs the engine in a thread of the server's process and
:class:`~enginelib.serve.engine_core.EngineCoreClient` in a process of its own; the app cannot tell them apart.
What both share lives here, so neither borrows the other's insides: the errors a caller sees, a request's
stream of deltas, the overload rule, and the hand-off of
deltas from the thread that receives them to each caller's event loop.
"""
from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from enginelib.config import SamplingParams
from enginelib.core.outputs import StreamDelta

if TYPE_CHECKING:
    from enginelib.core.engine import EngineStats
    from enginelib.model.tokenizer import Tokenizer


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


@runtime_checkable
class EngineClient(Protocol):
    """An engine as the app, its metrics and its command line use it, from an asyncio program."""

    tokenizer: Tokenizer
    context_length: int
    vocab_size: int
    stats: EngineStats  # the counters after the latest step: /metrics reads them, from any thread
    error: BaseException | None  # why the engine stopped, once it has

    @property
    def is_running(self) -> bool:
        """False once the engine stopped (shut down, or on an error): /health answers 503."""

    async def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                          request_id: str | None = None) -> RequestStream:
        """Check the prompt (``ValueError`` before anything is queued), queue it; its deltas come from the stream."""

    def generate(self, prompt: str | list[int], params: SamplingParams | None = None,
                 request_id: str | None = None) -> AsyncIterator[StreamDelta]:
        """The request's deltas until it finishes (:func:`generate_deltas`); leaving early aborts it."""

    async def abort(self, request_id: str) -> bool:
        """Abort a request; False if it had finished (or never existed)."""

    def overloaded(self) -> str | None:
        """Why a request would be turned away now (None: it would be taken), from the latest counters."""

    def join(self, timeout: float | None = None) -> None:
        """Wait until the engine stops: the server's watcher exits with it."""

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine; requests in flight are aborted."""


async def generate_deltas(client: EngineClient, prompt: str | list[int], params: SamplingParams | None = None,
                          request_id: str | None = None) -> AsyncIterator[StreamDelta]:
    """Queue a request and yield its deltas until it finishes; a caller that stops early aborts it (its blocks
    go back within a step). A request that fails in the engine raises :class:`RequestFailed`."""
    stream = await client.add_request(prompt, params, request_id)
    try:
        async for delta in stream:
            yield delta
    finally:
        stream.close()


class RequestStream:
    """One request's deltas, as an async iterator; ``close()`` aborts it if it has not finished (through
    ``on_close``, its client's). A request that failed in the engine raises :class:`RequestFailed` in place of its
    last delta."""

    def __init__(self, request_id: str, deltas: asyncio.Queue, on_close: Callable[[str], None]) -> None:
        self.request_id, self._deltas, self._on_close = request_id, deltas, on_close
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
            self._on_close(self.request_id)


@dataclass
class Subscriber:
    """Where one request's deltas go: its caller's event loop and queue."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue

    @classmethod
    def here(cls) -> Subscriber:
        """A subscriber on the running event loop (call it from the caller's coroutine)."""
        return cls(asyncio.get_running_loop(), asyncio.Queue())


class Subscribers:
    """Request id -> subscriber, for the thread that receives the deltas (the engine loop's, or the reader of the
    core's pipe): each step's deltas go to their event loops, one wake-up per loop per step."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # the caller's side removes a stream it closed while deltas come in
        self._by_id: dict[str, Subscriber] = {}

    def add(self, request_id: str, subscriber: Subscriber) -> None:
        with self._lock:
            self._by_id[request_id] = subscriber

    def pop(self, request_id: str) -> Subscriber | None:
        with self._lock:
            return self._by_id.pop(request_id, None)

    def deliver(self, deltas: Iterable[StreamDelta]) -> None:
        """Each delta to its subscriber (one that closed gets nothing); a finished request's subscriber is dropped."""
        batches: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, StreamDelta]]] = {}
        with self._lock:
            for delta in deltas:
                subscriber = self._by_id.get(delta.request_id)
                if subscriber is None:
                    continue  # closed by its caller: nobody reads it
                if delta.finished:
                    del self._by_id[delta.request_id]
                batches.setdefault(subscriber.loop, []).append((subscriber.queue, delta))
        for loop, items in batches.items():
            call_soon(loop, _put_all, items)

    def fail_all(self, error: BaseException) -> None:
        """Nobody will finish these requests: every subscriber gets ``error`` (raised as :class:`EngineDead`)."""
        with self._lock:
            subscribers, self._by_id = self._by_id, {}
        for subscriber in subscribers.values():
            call_soon(subscriber.loop, subscriber.queue.put_nowait, error)


def _put_all(items: list[tuple[asyncio.Queue, StreamDelta]]) -> None:
    for q, delta in items:
        q.put_nowait(delta)


def call_soon(loop: asyncio.AbstractEventLoop, fn: Callable[..., Any], *args: Any) -> None:
    """Schedule ``fn`` on ``loop`` from another thread; a closed loop's caller is gone and gets nothing."""
    if not loop.is_closed():
        loop.call_soon_threadsafe(fn, *args)


def overload(waiting: int, running: int, max_num_seqs: int, max_waiting: int | None) -> str | None:
    """Why a new request is turned away (None: it is taken). Only the requests that no free seat will take at
    the next step count: a burst of commands lands in the waiting queue before the loop steps, and those that
    fill free seats are not waiting for anyone."""
    queued = waiting - max(0, max_num_seqs - running)
    if max_waiting is None or queued < max_waiting:
        return None
    return f"{queued} requests are already waiting beyond the free seats (the limit is {max_waiting}): retry later"


def check_max_waiting(max_waiting: int | None) -> None:
    """Both clients take the same limit, checked in the caller's process before any engine starts."""
    if max_waiting is not None and max_waiting < 0:
        raise ValueError(f"max_waiting must be >= 0 (or None for no limit), got {max_waiting}")
