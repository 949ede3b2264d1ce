"""A request's life: waiting -> running -> finished, with detours through preemption."""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from enginelib.config import SamplingParams
from enginelib.core.outputs import RequestMetrics, TokenLogprob


class RequestStatus(str, Enum):
    WAITING = "waiting"      # queued, holds no blocks
    RUNNING = "running"      # admitted: holds blocks, computed every step
    PREEMPTED = "preempted"  # evicted to free blocks; back at the front of the queue
    FINISHED = "finished"    # done: see finish_reason


@dataclass
class Request:
    """Everything the scheduler tracks about one request. Plain data, no tensors."""
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: str | None = None
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None  # "stop", "length", "abort" or "error" (its own failure)
    num_computed_tokens: int = 0      # tokens whose K/V are in the cache (or found in the prefix cache)
    block_table: list[int] = field(default_factory=list)  # written by the KVCacheManager only
    block_hashes: list[int] = field(default_factory=list)  # of its full blocks, for the prefix cache
    num_preemptions: int = 0
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(0.0))
    # with params.logprobs: one per sampled token (by the runner); readers take the first len(output_token_ids)
    output_logprobs: list[TokenLogprob] = field(default_factory=list)
    # with params.prompt_logprobs: prompt tokens 1, 2, ... as their logits are computed (token 0 has none)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_slice(self, start: int, stop: int) -> list[int]:
        """Tokens ``start..stop`` of prompt + output, without building the whole list (a decode asks for one)."""
        n = len(self.prompt_token_ids)
        if start >= n:
            return self.output_token_ids[start - n:stop - n]
        return self.prompt_token_ids[start:stop] + self.output_token_ids[:max(0, stop - n)]

    @property
    def needs_prompt_logprobs(self) -> bool:
        """It asks for prompt logprobs that are not all computed yet: its prompt must be computed, not cached."""
        return (self.params.prompt_logprobs is not None
                and len(self.prompt_logprobs) < len(self.prompt_token_ids) - 1)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens to feed the model before the next token can be sampled."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def max_total_tokens(self) -> int:
        """Prompt + max_tokens - 1 (the last token is never fed back): its worst case in the cache."""
        return len(self.prompt_token_ids) + self.params.max_tokens - 1
