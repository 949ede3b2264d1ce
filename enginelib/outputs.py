"""What the engine hands back, shaped like vLLM's ``RequestOutput`` so what you learn transfers."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    index: int
    text: str                  # detokenized, special tokens and any stop string left out
    token_ids: list[int]
    finish_reason: str | None  # "stop", "length", "abort", or None while running


@dataclass
class RequestMetrics:
    """Times in seconds on the engine's clock (``time.perf_counter``)."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0
    num_output_tokens: int = 0

    @property
    def time_to_first_token(self) -> float | None:
        """TTFT: from arrival to the first generated token."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def time_per_output_token(self) -> float | None:
        """TPOT: the mean gap between generated tokens after the first."""
        if self.num_output_tokens < 2 or self.first_token_time is None:
            return None
        return (self.last_token_time - self.first_token_time) / (self.num_output_tokens - 1)


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(0.0))


@dataclass(frozen=True)
class StreamDelta:
    """What one request produced in one step: the text and tokens new since the last delta."""

    request_id: str
    text: str
    token_ids: list[int]
    finished: bool
    finish_reason: str | None
