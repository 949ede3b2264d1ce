"""The engine's side of serving, one loop body for a thread and for the engine-core process (chapter 11).

:class:`EngineLoop` owns one :class:`Engine` and is only ever touched by the one thread that runs it:
:class:`~enginelib.serve.async_engine.AsyncEngine`'s loop thread, or the engine-core process's main thread. Both
run the same turn (take the commands that came in, sleeping for one when idle, then step if there is work) and
pass on the same deltas, which the engine's output processor makes (:meth:`Engine.step_deltas`).
"""
from __future__ import annotations

from collections.abc import Callable

from enginelib.core.engine import Engine
from enginelib.core.outputs import StreamDelta
from enginelib.core.prompt import CheckedPrompt
from enginelib.serve.engine_client import EngineOverloaded, overload


class EngineLoop:
    """One engine, served: requests added under the overload rule (``max_waiting``), aborted, and stepped into
    deltas. Not thread-safe: one thread owns it."""

    def __init__(self, engine: Engine, max_waiting: int | None) -> None:
        self.engine, self.max_waiting = engine, max_waiting
        self._waited: set[str] = set()  # the live requests someone waits for

    @property
    def max_num_seqs(self) -> int:
        return self.engine.config.scheduler.max_num_seqs

    def add(self, prompt: CheckedPrompt, request_id: str | None) -> str:
        """Queue a checked prompt; :class:`EngineOverloaded` past the waiting limit, ``ValueError`` from the engine.
        The queue is read live: a burst of adds between two steps counts in full."""
        scheduler = self.engine.scheduler
        why = overload(len(scheduler.waiting), len(scheduler.running), self.max_num_seqs, self.max_waiting)
        if why is not None:
            raise EngineOverloaded(why)
        request_id = self.engine.add_request(prompt, request_id=request_id)
        self._waited.add(request_id)
        return request_id

    def abort(self, request_id: str) -> bool:
        """Abort a request; False if it had finished (or been aborted) already: its blocks are free."""
        if request_id not in self._waited:
            return False
        self._waited.discard(request_id)
        self.engine.abort(request_id)
        return True

    def abort_all(self) -> None:
        """Abort every live request (a clean shutdown: their blocks go back)."""
        for request_id in list(self._waited):
            self.abort(request_id)

    def turn(self, take_commands: Callable[[bool], bool]) -> list[StreamDelta] | None:
        """One turn of the loop: ``take_commands(block)`` runs the commands that came in (``block``: the engine is
        idle, so wait for one) and says whether to go on; then a step if there is work. The step's deltas, or None
        (no step, or told to stop)."""
        busy = self.engine.has_unfinished_requests()
        if not take_commands(not busy):
            return None
        if not (busy or self.engine.has_unfinished_requests()):
            return None
        deltas = [delta for delta in self.engine.step_deltas() if delta.request_id in self._waited]  # not aborted
        self._waited.difference_update(delta.request_id for delta in deltas if delta.finished)
        return deltas
