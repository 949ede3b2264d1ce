"""The scheduler: each step, which requests run and how many tokens each computes.

It decides by free memory: a waiting request is admitted only when blocks for
its tokens are free; running requests that need a new block take it, and when
none is left the most recently admitted request is *preempted by recompute*
(its blocks freed, itself sent back to the front of the queue). It never
touches tensors: the engine turns its decisions into a batch.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from .block_pool import BlockPool
from .request import Request, RequestStatus
from .sampling import finish_reason


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 32             # requests running at once
    max_num_batched_tokens: int = 2048  # tokens computed in one step (the token budget)

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be at least "
                             f"max_num_seqs ({self.max_num_seqs}): every running request decodes each step")


@dataclass
class ScheduledWork:
    request: Request
    num_tokens: int  # tokens computed for it this step: its whole prefill, or 1 to decode
    is_prefill: bool


@dataclass
class SchedulerOutput:
    """One step's plan: decodes first, then newly admitted prefills; and who was preempted."""

    scheduled: list[ScheduledWork] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(w.num_tokens for w in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    """Waiting and running queues over a :class:`BlockPool`."""

    def __init__(self, config: SchedulerConfig, pool: BlockPool, eos_token_id: int | None = None) -> None:
        self.config = config
        self.pool = pool
        self.eos_token_id = eos_token_id
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order: the last one is preempted first

    def check_fits(self, request: Request) -> None:
        """Refuse a request that could never run, whatever else is going on."""
        need = self.pool.blocks_for(request.max_total_tokens)
        if need > self.pool.num_blocks:
            raise ValueError(
                f"request {request.request_id} needs {need} blocks for its prompt ({len(request.prompt_token_ids)} "
                f"tokens) plus max_tokens ({request.params.max_tokens}), but the whole pool has "
                f"{self.pool.num_blocks}: give the KV cache more memory (num_blocks) or lower max_tokens")
        if request.max_total_tokens > self.config.max_num_batched_tokens:
            raise ValueError(
                f"request {request.request_id} may need {request.max_total_tokens} tokens in one prefill "
                f"(after a preemption), more than max_num_batched_tokens={self.config.max_num_batched_tokens}: "
                f"raise max_num_batched_tokens or shorten the request")

    def add(self, request: Request) -> None:
        self.check_fits(request)
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        # 1. Running requests decode one token each, oldest first, taking a new block when theirs is full.
        i = 0
        while i < len(self.running):
            request = self.running[i]
            need = self.pool.blocks_for(request.num_tokens) - len(request.block_table)
            while need > self.pool.num_free:
                victim = self.running[-1]
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is request:
                    break
            if request.status is not RequestStatus.RUNNING:
                break  # it preempted itself: everyone after it is gone too
            request.block_table += self.pool.allocate(need)
            out.scheduled.append(ScheduledWork(request, request.num_uncomputed_tokens, is_prefill=False))
            budget -= request.num_uncomputed_tokens
            i += 1
        # 2. Admit waiting requests in order while their blocks and tokens fit (not in a step that preempted).
        while self.waiting and not out.preempted and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            need = self.pool.blocks_for(request.num_tokens)
            if request.num_uncomputed_tokens > budget or not self.pool.can_allocate(need):
                break
            self.waiting.popleft()
            request.block_table = self.pool.allocate(need)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.scheduled.append(ScheduledWork(request, request.num_uncomputed_tokens, is_prefill=True))
            budget -= request.num_uncomputed_tokens
        return out

    def _preempt(self, request: Request) -> None:
        """Free all its blocks and send it to the front of the queue; its tokens so far are kept."""
        self.running.remove(request)
        self.pool.free(request.block_table)
        request.block_table = []
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.waiting.appendleft(request)

    def update(self, out: SchedulerOutput, tokens: list[int]) -> list[Request]:
        """Append each scheduled request's new token; finish those that stop. Returns the finished."""
        finished = []
        for work, token in zip(out.scheduled, tokens, strict=True):
            request = work.request
            request.num_computed_tokens += work.num_tokens
            request.output_token_ids.append(token)
            reason = finish_reason(token, len(request.output_token_ids), request.params, self.eos_token_id)
            if reason:
                self.finish(request, reason)
                finished.append(request)
        return finished

    def finish(self, request: Request, reason: str) -> None:
        """End a request (stopped, out of length, or aborted) and give its blocks back."""
        if request.is_finished:
            return
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.pool.free(request.block_table)
        request.block_table = []
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason

    def find(self, request_id: str) -> Request:
        for request in (*self.running, *self.waiting):
            if request.request_id == request_id:
                return request
        raise ValueError(f"no unfinished request with id {request_id!r}")
