"""The messages on the pipe between :class:`~enginelib.serve.engine_core.EngineCoreClient` and its engine-core
process: plain dataclasses, pickled by ``multiprocessing``, so each side reads fields by name and a message of the
wrong shape fails where it is made, not where it is read."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from enginelib.core.prompt import CheckedPrompt
    from enginelib.core.engine import EngineStats
    from enginelib.core.outputs import StreamDelta
    from enginelib.model.tokenizer import Tokenizer


# --- API process -> core ------------------------------------------------------------------------

@dataclass(frozen=True)
class Add:
    """Queue a checked prompt; answered (:class:`Answer` ``number``) with its request id, or the error."""

    number: int
    prompt: CheckedPrompt  # its token ids and params, checked in the API process: the core does not check again
    request_id: str | None


@dataclass(frozen=True)
class Abort:
    """Abort a request; answered with whether it was still live, unless ``number`` is None (nobody waits)."""

    request_id: str
    number: int | None = None


@dataclass(frozen=True)
class Stop:
    """Shut down: the core exits."""


# --- core -> API process ------------------------------------------------------------------------

@dataclass(frozen=True)
class Ready:
    """The engine is built: what the API process checks prompts against, and the first counters."""

    tokenizer: Tokenizer
    context_length: int
    vocab_size: int
    max_num_seqs: int  # the overload rule counts the waiting requests beyond the free seats
    stats: EngineStats


@dataclass(frozen=True)
class Failed:
    """The engine could not be built (the process exits)."""

    why: str


@dataclass(frozen=True)
class Answer:
    """A command's result, or the caller's error (a full queue, a request the engine refused)."""

    number: int
    result: Any
    error: BaseException | None


@dataclass(frozen=True)
class Step:
    """One step: the deltas of every request that moved and someone waits for, and the engine's counters."""

    deltas: list[StreamDelta]
    stats: EngineStats


@dataclass(frozen=True)
class Dead:
    """The core's loop raised (the process exits after this)."""

    why: str
