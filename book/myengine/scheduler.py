"""Chapter 6: requests and the scheduler that decides, every step, who computes how many tokens."""
from collections import deque
from dataclasses import dataclass, field

from .block_pool import MiniBlockPool


@dataclass
class Request:
    """What the scheduler tracks about one request: token ids and counters, no tensors."""
    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    output_token_ids: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    status: str = "waiting"       # waiting, running, preempted, finished
    finish_reason: str | None = None
    num_preemptions: int = 0

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == "finished"


@dataclass
class ScheduledWork:
    request: Request
    num_tokens: int
    is_prefill: bool


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledWork] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(w.num_tokens for w in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class MiniScheduler:
    """Waiting queue + running list over a block pool. It decides; it never touches a tensor."""

    def __init__(self, pool: MiniBlockPool, max_num_seqs: int, max_num_batched_tokens: int, eos_token_id: int):
        self.pool, self.eos_token_id = pool, eos_token_id
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order: the newest is last
        self.thrown_away = 0               # computed tokens dropped by preemptions
        self.head_waits = ""               # why the queue's head was not admitted this step

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        # 1. Running requests decode, oldest first; a full last block means they need a new one.
        for request in list(self.running):
            need = self.pool.blocks_for(request.num_tokens) - len(request.block_table)
            while request in self.running and need > self.pool.num_free:
                victim = self.pick_victim()
                self.preempt(victim)
                out.preempted.append(victim)
            if request in self.running:  # (it may have been its own victim)
                request.block_table += self.pool.allocate(need)
        out.scheduled = [ScheduledWork(r, r.num_uncomputed_tokens, is_prefill=False) for r in self.running]
        budget = self.max_num_batched_tokens - out.num_tokens
        # 2. Admit from the front of the queue while a seat, the token budget and the blocks allow.
        self.head_waits = ""
        while self.waiting:
            request = self.waiting[0]
            need = self.pool.blocks_for(request.num_tokens)
            why = ("this step preempted" if out.preempted else
                   "no free seat" if len(self.running) >= self.max_num_seqs else
                   "token budget" if request.num_uncomputed_tokens > budget else
                   "blocks" if need > self.pool.num_free else "")
            if why:
                self.head_waits = f"{request.request_id}: {why}"
                break
            self.waiting.popleft()
            self.allocate_prompt(request, need)
            request.status = "running"
            self.running.append(request)
            out.scheduled.append(ScheduledWork(request, request.num_uncomputed_tokens, is_prefill=True))
            budget -= request.num_uncomputed_tokens
        return out

    def allocate_prompt(self, request: Request, need: int) -> None:
        """Blocks for an admitted request's tokens (chapter 9's prefix cache finds some already computed)."""
        request.block_table = self.pool.allocate(need)

    def pick_victim(self) -> Request:
        return self.running[-1]  # the newest: first come, first served, so the oldest keep their progress

    def preempt(self, request: Request) -> None:
        """Recompute policy: free its blocks, forget its cache, put it at the FRONT of the queue."""
        self.running.remove(request)
        self.pool.free(request.block_table)
        request.block_table = []
        self.thrown_away += request.num_computed_tokens
        request.num_computed_tokens = 0
        request.status = "preempted"
        request.num_preemptions += 1
        self.waiting.appendleft(request)

    def update(self, out: SchedulerOutput, tokens: list[int]) -> list[Request]:
        """Each scheduled request computed its tokens and got one new token; finish those that stop."""
        finished = []
        for work, token in zip(out.scheduled, tokens, strict=True):
            request = work.request
            request.num_computed_tokens += work.num_tokens
            if request.num_computed_tokens < request.num_tokens:
                continue  # a prefill cut short (chapter 10's chunks): its sampled token is not the next one
            request.output_token_ids.append(token)
            if token == self.eos_token_id or len(request.output_token_ids) >= request.max_tokens:
                self.finish(request, "stop" if token == self.eos_token_id else "length")
                finished.append(request)
        return finished

    def finish(self, request: Request, reason: str) -> None:
        self.running.remove(request)
        self.pool.free(request.block_table)
        request.block_table = []
        request.status, request.finish_reason = "finished", reason
