"""The scheduler: each step, which requests run and how many tokens each computes. Running requests go first (with
chunked prefill, chapter 10, a long prompt computes a chunk of what the budget has left); waiting ones are admitted in
order while blocks and tokens fit. A request needing a block when none is free *preempts* the latest admitted one, sent
back to the front of the queue to be recomputed. No tensors here; it alone moves requests between states."""
from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from enginelib.config import SchedulerConfig, finish_reason
from enginelib.core.block_pool import BlockPool
from enginelib.core.kv_manager import KVCacheManager
from enginelib.core.request import Request, RequestStatus


@dataclass
class ScheduledWork:
    request: Request
    num_tokens: int   # tokens computed for it this step: a prefill (or a chunk of one), or 1 to decode
    is_prefill: bool  # computing its prompt (or recomputing after a preemption), not decoding
    start: int = 0    # position of the first of them: the tokens before it are in the cache
    samples: bool = True  # they reach the end of what it has, so a new token is sampled
    draft_token_ids: list[int] = field(default_factory=list)  # guesses computed after its last token, to verify
    admitted: bool = False  # taken from the waiting queue this step (its cached prefix counts as computed)


@dataclass
class SchedulerOutput:
    """One step's plan: running requests first, then newly admitted ones; and who was preempted."""
    scheduled: list[ScheduledWork] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(w.num_tokens for w in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    """Waiting and running queues; blocks through a :class:`KVCacheManager`."""

    def __init__(self, config: SchedulerConfig, kv: KVCacheManager | BlockPool,
                 eos_token_id: int | None = None) -> None:
        self.config = config
        self.kv = kv if isinstance(kv, KVCacheManager) else KVCacheManager(kv, enable_prefix_caching=False)
        self.eos_token_id = eos_token_id
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order: the last one is preempted first

    @property
    def pool(self) -> BlockPool:
        return self.kv.pool

    def check_fits(self, request: Request) -> None:
        """Refuse a request that could never run, whatever else is going on."""
        need = self.pool.blocks_for(request.max_total_tokens)
        if need > self.pool.num_blocks:
            raise ValueError(
                f"request {request.request_id} needs {need} blocks for its prompt ({len(request.prompt_token_ids)} "
                f"tokens) plus max_tokens ({request.params.max_tokens}), but the whole pool has "
                f"{self.pool.num_blocks}: give the KV cache more memory (num_blocks) or lower max_tokens")
        if not self.config.enable_chunked_prefill and request.max_total_tokens > self.config.max_num_batched_tokens:
            raise ValueError(
                f"request {request.request_id} may need {request.max_total_tokens} tokens in one prefill "
                f"(after a preemption), more than max_num_batched_tokens={self.config.max_num_batched_tokens}: "
                f"enable chunked prefill, raise max_num_batched_tokens or shorten the request")

    def add(self, request: Request) -> None:
        self.check_fits(request)
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, drafts: Mapping[str, Sequence[int]] | None = None) -> SchedulerOutput:
        """Plan one step. ``drafts`` (speculative decoding): guessed next tokens of decoding requests, by id;
        such a decode computes its last token and the guesses that fit the budget and max_tokens."""
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        # 1. Running requests, oldest first: a decode takes one token, a prefill a chunk of what later decodes leave
        decodes_left = sum(map(_decodes, self.running))
        i = 0
        while i < len(self.running):
            request = self.running[i]
            is_decode = _decodes(request)
            decodes_left -= is_decode
            num_new = 1 if is_decode else min(request.num_uncomputed_tokens, budget - decodes_left)
            if num_new < 1:
                i += 1
                continue  # no room for a chunk this step; it keeps its blocks and goes on next step
            guesses = (self._fitting_drafts(request, drafts, budget - decodes_left - 1, i)
                       if is_decode and drafts else [])
            if guesses and self.kv.allocate_slots(request, 1 + len(guesses)):  # else no guesses, as a plain decode
                out.scheduled.append(self._work(request, 1 + len(guesses), False, guesses))
                budget -= 1 + len(guesses)
                i += 1
                continue
            while not self.kv.allocate_slots(request, num_new):
                victim = self.running[-1]
                decodes_left -= victim is not request and _decodes(victim)
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is request:
                    break
            if request.status is not RequestStatus.RUNNING:
                break  # it preempted itself: everyone after it is gone too
            out.scheduled.append(self._work(request, num_new, is_prefill=not is_decode))
            budget -= num_new
            i += 1
        # 2. Admit waiting requests in order while blocks and tokens fit (not in a step that preempted).
        #    A cached prefix counts as computed; without chunking the rest must fit the budget whole.
        while self.waiting and not out.preempted and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            cached = self.kv.find_cached_prefix(request)
            num_new = request.num_tokens - len(cached) * self.pool.block_size
            if self.config.enable_chunked_prefill:
                num_new = min(num_new, budget)
            if num_new < 1 or num_new > budget or not self.kv.allocate_slots(request, num_new, cached):
                break
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.scheduled.append(replace(self._work(request, num_new, is_prefill=True), admitted=True))
            budget -= num_new
        return out

    def _fitting_drafts(self, request: Request, drafts: Mapping[str, Sequence[int]], room: int, i: int) -> list[int]:
        """The guesses of ``running[i]`` that fit ``room`` tokens of budget, its max_tokens, and the free blocks less
        one per later request needing a new one: a guess never costs another its step or a preemption."""
        if request.request_id not in drafts:
            return []
        left = request.params.max_tokens - len(request.output_token_ids) - 1
        others = sum(self.pool.blocks_for(r.num_tokens) > len(r.block_table) for r in self.running[i + 1:])
        blocks = len(request.block_table) + self.pool.num_free - others
        slots = blocks * self.pool.block_size - request.num_computed_tokens - 1
        return list(drafts[request.request_id][:max(0, min(room, left, slots))])

    @staticmethod
    def _work(request: Request, num_tokens: int, is_prefill: bool, guesses: list[int] | None = None) -> ScheduledWork:
        """Called after the request's blocks are allocated (``num_computed_tokens`` counts any cached prefix)."""
        start = request.num_computed_tokens
        if guesses:
            return ScheduledWork(request, num_tokens, is_prefill, start, samples=True, draft_token_ids=guesses)
        return ScheduledWork(request, num_tokens, is_prefill, start, samples=start + num_tokens == request.num_tokens)

    def _preempt(self, request: Request) -> None:
        """Free all its blocks and send it to the front of the queue; its tokens so far are kept."""
        self.running.remove(request)
        self.kv.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.waiting.appendleft(request)

    def update(self, out: SchedulerOutput, tokens: Sequence[int | Sequence[int]]) -> list[Request]:
        """Count computed tokens and append each sampled one. ``tokens``: one per work that ``samples``, in order (for a
        work with guesses, its verified run). Returns the requests that finished."""
        finished = []
        sampled = iter(tokens)
        for work in out.scheduled:
            request = work.request
            if request.is_finished:  # it failed earlier in this step (see ``fail``): what it sampled is dropped
                if work.samples:
                    next(sampled)
                continue
            if work.draft_token_ids:
                if self._update_verified(work, next(sampled)):
                    finished.append(request)
                continue
            request.num_computed_tokens += work.num_tokens
            if not work.samples:
                continue  # a chunk of a prefill: no token until its last chunk
            token = next(sampled)
            request.output_token_ids.append(token)
            reason = finish_reason(token, len(request.output_token_ids), request.params, self.eos_token_id)
            if reason:
                self.finish(request, reason)
                finished.append(request)
        if next(sampled, None) is not None:
            raise ValueError("more sampled tokens than scheduled requests that sample")
        return finished

    def _update_verified(self, work: ScheduledWork, run: Sequence[int]) -> bool:
        """Roll a speculative step back to what verification kept and append the run up to any stop; True if it
        finished. Rejected guesses' slots are forgotten; blocks holding nothing else go back."""
        request, kept = work.request, len(run) - 1
        if not run or kept > len(work.draft_token_ids) or list(run[:kept]) != work.draft_token_ids[:kept]:
            raise ValueError(f"a verified run must start with the kept guesses: got {list(run)} for "
                             f"guesses {work.draft_token_ids}")
        request.num_computed_tokens = work.start + 1 + kept
        for token in run:  # token by token: nothing is emitted past a stop
            request.output_token_ids.append(token)
            reason = finish_reason(token, len(request.output_token_ids), request.params, self.eos_token_id)
            if reason:
                self.finish(request, reason)
                return True
        self.kv.keep(request, work.start + 1)
        return False

    def append_forced(self, request: Request, tokens: Sequence[int]) -> int:
        """Append tokens no step sampled (a grammar forces them: jump-forward), up to a stop or max_tokens; the next
        step computes them, as a recomputed request's. Returns how many were appended."""
        for n, token in enumerate(tokens, 1):
            request.output_token_ids.append(token)
            reason = finish_reason(token, len(request.output_token_ids), request.params, self.eos_token_id)
            if reason:
                self.finish(request, reason)
                return n
        return len(tokens)

    def finish(self, request: Request, reason: str) -> None:
        """End a request (stopped, out of length, aborted, or failed) and give its blocks back."""
        if request.is_finished:
            return
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.kv.free(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason

    def fail(self, request: Request) -> None:
        """A request's own error ends it alone, with reason "error" even if a token ended it this step."""
        self.finish(request, "error")
        request.finish_reason = "error"

    def stop(self, request: Request, num_output_tokens: int) -> None:
        """A stop string ends the request after ``num_output_tokens`` tokens; later ones are dropped, and the reason is
        "stop" even if one of them (EOS, max_tokens) already ended it."""
        del request.output_token_ids[num_output_tokens:]
        if request.is_finished:
            request.finish_reason = "stop"
        else:
            self.finish(request, "stop")

    def find(self, request_id: str) -> Request:
        for request in (*self.running, *self.waiting):
            if request.request_id == request_id:
                return request
        raise ValueError(f"no unfinished request with id {request_id!r}")


def _decodes(request: Request) -> bool:
    """Its prompt is computed and one token is left: a decode (a prompt's 1-token last chunk is a prefill)."""
    return request.num_uncomputed_tokens == 1 and request.num_computed_tokens >= len(request.prompt_token_ids)
