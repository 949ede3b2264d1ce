"""Chapter 7: the engine loop. Continuous batching, greedy, over chapters 5 and 6's parts."""
import torch

from .block_pool import MiniBlockPool
from .paged_cache import Batch, MiniPagedKVCache, SequenceWork
from .scheduler import MiniScheduler, Request, SchedulerOutput


class MiniEngine:
    """Requests join and leave the running batch at every step: schedule, one forward pass, sample, update."""

    def __init__(self, model, eos_token_id: int, num_blocks: int = 256, block_size: int = 16,
                 max_num_seqs: int = 8, max_num_batched_tokens: int = 2048) -> None:
        self.model = model
        self.pool = MiniBlockPool(num_blocks, block_size)                # which request owns which block
        self.cache = MiniPagedKVCache(model.cfg, num_blocks, block_size,  # the blocks' keys and values
                                      device=model.device, dtype=model.dtype)
        self.scheduler = MiniScheduler(self.pool, max_num_seqs, max_num_batched_tokens, eos_token_id)
        self.requests: dict[str, Request] = {}

    def add(self, prompt_ids: list[int], max_tokens: int) -> str:
        """Queue a request. It joins the running batch at a later step, whoever else is running."""
        request = Request(str(len(self.requests)), list(prompt_ids), max_tokens)
        self.scheduler.add(request)
        self.requests[request.request_id] = request
        return request.request_id

    @torch.inference_mode()
    def step(self) -> tuple[SchedulerOutput, list[Request]]:
        """One engine step. Returns the plan it ran and the requests that finished in it."""
        plan = self.scheduler.schedule()  # decodes of the running requests, then prefills of admitted ones
        if plan.is_empty:
            return plan, []
        work = [SequenceWork(w.request.all_token_ids[w.request.num_computed_tokens:][:w.num_tokens],  # not yet cached
                             w.request.num_computed_tokens,                                          # first position
                             w.request.block_table)                                                  # where K/V live
                for w in plan.scheduled]
        batch = Batch.build(work, self.pool.block_size, self.model.device)
        logits = self.model(batch.token_ids, self.cache.bind(batch), positions=batch.positions,
                            logits_indices=batch.logits_indices)
        tokens = self.sample(plan, logits)              # one new token per scheduled request
        finished = self.scheduler.update(plan, tokens)  # append them; finished requests free their blocks
        return plan, finished

    def sample(self, plan: SchedulerOutput, logits: torch.Tensor) -> list[int]:
        """Greedy: each row's most likely token (chapter 12 masks some rows first)."""
        return logits.argmax(dim=-1).tolist()

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def generate(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        """Serve a workload to the end: every request's output tokens, in order."""
        ids = [self.add(p, max_tokens) for p in prompts]
        while self.has_unfinished():
            self.step()
        return [self.requests[i].output_token_ids for i in ids]
