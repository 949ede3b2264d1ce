"""Chapter 10: chunked prefill. Decodes first, then prompts under way, then new ones, each a chunk of the budget left."""
from .engine import MiniEngine
from .scheduler import MiniScheduler, Request, ScheduledWork, SchedulerOutput


def is_decoding(request: Request) -> bool:
    """Its prompt is in the cache and one token is left to feed: the one it sampled last step."""
    return request.num_uncomputed_tokens == 1 and request.num_computed_tokens >= len(request.prompt_token_ids)


class ChunkedScheduler(MiniScheduler):
    """Chapter 6's scheduler, but a prompt need not fit one step: it is fed a chunk at a time, within the budget."""

    def schedule(self) -> SchedulerOutput:
        out, budget = SchedulerOutput(), self.max_num_batched_tokens
        # 1. Plan the running requests' tokens: every decode takes one, then prompts under way, oldest first.
        plan = {}
        for request in sorted(self.running, key=lambda r: not is_decoding(r)):  # stable: admission order kept
            plan[request.request_id] = n = self.chunk(request, budget)
            budget -= n
        # 2. Blocks for what they will hold; preempt the newest when the pool runs dry (its tokens are not refunded).
        for request in list(self.running):
            need = self.pool.blocks_for(request.num_computed_tokens + plan[request.request_id]) - len(request.block_table)
            while request in self.running and need > self.pool.num_free:
                victim = self.pick_victim()
                self.preempt(victim)
                out.preempted.append(victim)
            if request in self.running:
                request.block_table += self.pool.allocate(max(need, 0))
        out.scheduled = [ScheduledWork(r, plan[r.request_id], not is_decoding(r))
                         for r in self.running if plan[r.request_id] > 0]
        # 3. Admit in order while seats and blocks allow; the last one admitted may take only a chunk of its prompt.
        self.head_waits = ""
        while self.waiting and budget > 0 and not out.preempted and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            n = self.chunk(request, budget)
            need = self.pool.blocks_for(request.num_computed_tokens + n)
            if need > self.pool.num_free:
                self.head_waits = f"{request.request_id}: blocks"
                break
            self.waiting.popleft()
            self.allocate_prompt(request, need)
            request.status = "running"
            self.running.append(request)
            out.scheduled.append(ScheduledWork(request, n, is_prefill=True))
            budget -= n
        return out

    def chunk(self, request: Request, budget: int) -> int:
        """Tokens a request computes this step: all it has left, as far as the budget goes."""
        return min(request.num_uncomputed_tokens, budget)


def chunked_engine(model, eos_token_id: int, num_blocks: int = 256, block_size: int = 16, max_num_seqs: int = 8,
                   max_num_batched_tokens: int = 64) -> MiniEngine:
    """Chapter 7's engine with the chunking scheduler: no step computes more than max_num_batched_tokens."""
    engine = MiniEngine(model, eos_token_id, num_blocks, block_size, max_num_seqs, max_num_batched_tokens)
    engine.scheduler = ChunkedScheduler(engine.pool, max_num_seqs, max_num_batched_tokens, eos_token_id)
    return engine
