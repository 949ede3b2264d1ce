"""What the engine hands back, shaped like vLLM's ``RequestOutput`` so what you learn transfers."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token's log-probability under the model's raw logits (vLLM's ``raw_logprobs``), and the
    ``params.logprobs`` most likely tokens at its position, best first: what OpenAI's ``logprobs`` reports."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, logprob), most likely first
    rank: int | None = None  # of token_id among all tokens at its position (1: the likeliest), as vLLM reports it


@dataclass
class CompletionOutput:
    index: int
    text: str                  # detokenized, special tokens and any stop string left out
    token_ids: list[int]
    finish_reason: str | None  # "stop", "length", "abort", "error", or None while running
    error: str | None = None   # with "error": what went wrong for this request alone (the engine went on)
    logprobs: list[TokenLogprob] | None = None  # one per token id, when params.logprobs asks (else None)


@dataclass
class RequestMetrics:
    """A request's timing, in one place: seconds on the engine's clock (``time.perf_counter``).

    The scheduler stamps ``first_scheduled_time`` when it admits the request; the
    engine appends to ``token_times`` when each token comes and sets ``finished_time``.
    """

    arrival_time: float
    first_scheduled_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    finished_time: float | None = None
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at admission (chapter 9)

    @property
    def first_token_time(self) -> float | None:
        return self.token_times[0] if self.token_times else None

    @property
    def last_token_time(self) -> float | None:
        return self.token_times[-1] if self.token_times else None

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_times)

    @property
    def time_to_first_token(self) -> float | None:
        """TTFT: from arrival to the first generated token."""
        return None if not self.token_times else self.token_times[0] - self.arrival_time

    @property
    def time_per_output_token(self) -> float | None:
        """TPOT: the mean gap between generated tokens after the first."""
        if len(self.token_times) < 2:
            return None
        return (self.token_times[-1] - self.token_times[0]) / (len(self.token_times) - 1)

    @property
    def inter_token_latencies(self) -> list[float]:
        """Every gap between consecutive tokens: their tail (p99) is what a streaming reader feels."""
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(0.0))
    # with params.prompt_logprobs: one per prompt token, the first None (nothing comes before it), as vLLM's
    prompt_logprobs: list[TokenLogprob | None] | None = None


@dataclass(frozen=True)
class StreamDelta:
    """What one request produced in one step: the text and tokens new since the last delta.

    The last delta (``finished``) also carries the request's ``metrics`` and the
    token counts a server reports as usage.
    """

    request_id: str
    text: str
    token_ids: list[int]
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    metrics: RequestMetrics | None = None
    error: str | None = None  # with finish_reason "error": what failed this request alone
    logprobs: list[TokenLogprob] | None = None  # of ``token_ids``, when the request asked for them
    prompt_logprobs: list[TokenLogprob | None] | None = None  # in a request's first delta, when it asked


@dataclass
class DeltaCursor:
    """Turns one request's outputs (each with the whole text so far) into deltas (only what is new).

    Text that ends in a partial UTF-8 character is never in an output; the last
    ``hold_back`` characters (``params.stop_hold_back``) are held back too, since a
    stop string completed by a later token would cut them from the final text.
    The finished output's delta brings whatever was held back.
    """

    hold_back: int = 0
    chars: int = 0   # characters sent so far
    tokens: int = 0  # token ids sent so far
    started: bool = False  # a delta was made: the prompt's logprobs went with the first

    def delta(self, out: RequestOutput) -> StreamDelta:
        done = out.outputs[0]
        ready = len(done.text) if out.finished else max(self.chars, len(done.text) - self.hold_back)
        delta = StreamDelta(out.request_id, done.text[self.chars:ready], done.token_ids[self.tokens:],
                            out.finished, done.finish_reason, len(out.prompt_token_ids), len(done.token_ids),
                            out.metrics if out.finished else None, done.error,
                            None if done.logprobs is None else done.logprobs[self.tokens:],
                            None if self.started else out.prompt_logprobs)
        self.chars, self.tokens, self.started = ready, len(done.token_ids), True
        return delta
