"""The engine loop: schedule, run the model, process the outputs. Requests may join at any step, also while others
decode (continuous batching). Each part has its own module: the :class:`Scheduler` decides who computes what, the
:class:`ModelRunner` turns that plan into tokens (and, with a speculative config, proposes guesses and verifies them),
the :class:`OutputProcessor` turns tokens into text, stop strings and metrics. What goes wrong for one request alone
(its sampling, its text) ends it with ``finish_reason="error"`` and the others go on; a failed step (the forward pass)
raises."""
from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace

import torch

from enginelib.config import EngineConfig, SamplingParams, SchedulerConfig
from enginelib.core.block_pool import BlockPool, PoolStats
from enginelib.core.kv_manager import KVCacheManager, PrefixCacheStats
from enginelib.core.output_processor import OutputProcessor
from enginelib.core.outputs import RequestMetrics, RequestOutput, StreamDelta
from enginelib.core.paged_cache import PagedKVCache
from enginelib.core.prompt import CheckedPrompt, check_prompt
from enginelib.core.record import StepRecord, snapshot
from enginelib.core.request import Request, RequestStatus
from enginelib.core.runner import ModelRunner, SpecStats
from enginelib.core.scheduler import Scheduler, SchedulerOutput
from enginelib.model.device import free_gpu_memory, record_function
from enginelib.model.tokenizer import Tokenizer
from enginelib.model.transformer import Transformer
from enginelib.model.structured import StructuredOutputManager

DEFAULT_CPU_KV_MEMORY = 512 * 2**20  # bytes of K/V on a CPU when nothing else is said
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineStats:
    """Counters at one moment (a copy: later steps do not change it)."""
    steps: int
    running: int
    waiting: int
    finished: int
    preemptions: int
    generated_tokens: int
    pool: PoolStats
    prefix_cache: PrefixCacheStats
    spec_decode: SpecStats  # guesses proposed and accepted (all zero without speculation)


class Engine:
    def __init__(self, model: Transformer, tokenizer: Tokenizer, config: EngineConfig | None = None) -> None:
        self.model, self.tokenizer = model, tokenizer
        self.config = config = config or EngineConfig()
        self.pool = BlockPool(self._num_blocks(), config.block_size)
        self.kv = KVCacheManager(self.pool, config.enable_prefix_caching)
        self.scheduler = Scheduler(config.scheduler, self.kv, tokenizer.eos_token_id)
        self.structured = StructuredOutputManager(tokenizer, model.cfg.vocab_size, model.device)  # grammars' state
        self.runner = ModelRunner(model, config, self.pool.num_blocks, tokenizer.eos_token_id, self.structured)
        self.output = OutputProcessor(tokenizer)
        self.history: list[StepRecord] = []
        self.steps = 0
        self._next_id = 0

    @property
    def cache(self) -> PagedKVCache:
        """The runner's paged KV cache; chapter 5 swaps in one of its own (same pool shape) to show it works."""
        return self.runner.cache

    @cache.setter
    def cache(self, cache: PagedKVCache) -> None:
        self.runner.cache = cache

    def _num_blocks(self) -> int:
        config, cfg, dtype = self.config, self.model.cfg, self.model.dtype
        memory = config.kv_cache_memory
        if memory is None:  # on a GPU, free memory counts what PyTorch caches but no tensor holds
            memory = (int(free_gpu_memory(self.model.device) * config.gpu_memory_fraction)
                      if self.model.device.type == "cuda" else DEFAULT_CPU_KV_MEMORY)
        num_blocks = config.num_blocks or PagedKVCache.blocks_in_budget(cfg, config.block_size, dtype, memory)
        if num_blocks < 1:
            raise ValueError(f"the KV cache memory ({memory} bytes) holds no block of {config.block_size} tokens "
                             f"({config.block_size * cfg.kv_bytes_per_token(dtype)} bytes): give it more memory")
        return num_blocks

    def add_request(self, prompt: str | list[int] | CheckedPrompt, params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        """Queue a request (text or token ids, checked here; or a :class:`CheckedPrompt`, which carries its params and
        was checked already); it joins the running batch at a later step."""
        if isinstance(prompt, CheckedPrompt):
            if params is not None and params is not prompt.params:
                raise ValueError("a CheckedPrompt carries its own params: pass params=None")
            checked = prompt
        else:
            checked = check_prompt(prompt, SamplingParams() if params is None else params, self.tokenizer,
                                   self.model.cfg.vocab_size, self.model.cfg.context_length)
        ids, params = checked.token_ids, checked.params
        numbered = request_id is None
        while numbered and str(self._next_id) in self.output.live:  # skip ids the caller chose
            self._next_id += 1
        request_id = str(self._next_id) if numbered else str(request_id)
        if request_id in self.output.live:
            raise ValueError(f"request id {request_id!r} is already in use: pick another")
        request = Request(request_id, ids, params, prompt=checked.text, metrics=RequestMetrics(time.perf_counter()))
        self.structured.add(request_id, params.structured_output)  # compiled (or refused) before anything else
        self.runner.add(request_id, params)  # its generator first: nothing reaches the scheduler half-made
        try:
            self.scheduler.add(request)  # raises if the pool could never hold it
        except ValueError:
            self.runner.release(request_id)
            self.structured.release(request_id)
            raise
        self._next_id += numbered  # a refused request uses up no id
        self.output.add(request)
        return request_id

    def abort(self, request_id: str) -> RequestOutput:
        """Stop a request now; its blocks go back to the pool. Unknown or finished ids raise."""
        request = self.scheduler.find(request_id)
        self.scheduler.finish(request, "abort")
        self.runner.release(request_id)
        self.structured.release(request_id)
        return self.output.abort(request, time.perf_counter())  # its last output comes with the next step too

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def stats(self) -> EngineStats:
        """Counters kept as things happen (nothing here walks past requests), copied."""
        out = self.output
        return EngineStats(self.steps, len(self.scheduler.running), len(self.scheduler.waiting), out.num_finished,
                           out.num_preemptions, out.num_generated, self.pool.stats(), replace(self.kv.stats),
                           replace(self.runner.spec_stats))

    def request(self, request_id: str) -> Request:
        """The scheduler's record of a request: an unfinished one, or one of the last to end."""
        return self.output.request(request_id)

    def step(self) -> list[RequestOutput]:
        """Run one step; return the outputs of every request that moved (and any just aborted)."""
        return self._step(deltas=False)

    def step_deltas(self) -> list[StreamDelta]:
        """Run one step; return each request's text and tokens new since its last delta (what a stream sends)."""
        return self._step(deltas=True)

    @torch.inference_mode()
    def _step(self, deltas: bool) -> list[RequestOutput] | list[StreamDelta]:
        drafts = None
        if self.runner.proposer is not None:
            with record_function("propose"):
                drafts, failed = self.runner.propose(self.scheduler.running)
            for request, error in failed:  # its proposer failed: it ends alone, its output comes this step
                self._fail(request, error)
                self.output.abort(request, time.perf_counter())
        with record_function("schedule"):  # named phases show up in torch.profiler (chapter 8)
            plan = self.scheduler.schedule(drafts)
        scheduled_time = time.perf_counter()
        if not plan.is_empty:
            tokens, failed = self.runner.execute(plan)
            for request, error in failed:
                self._fail(request, error)
            with record_function("update"):
                self.scheduler.update(plan, tokens)
            if self.structured.grammars:
                with record_function("grammar"):
                    self._follow_grammars(plan)
        outputs = self.output.process(plan, scheduled_time, time.perf_counter(), self.scheduler.stop, self._fail,
                                       deltas)
        ended = [out.request_id for out in outputs if out.finished]
        for request_id in ended:
            self.runner.release(request_id)
            self.structured.release(request_id)
        self.steps += 1
        if self.config.record:
            self.history.append(snapshot(self.steps - 1, plan, (live.request for live in self.output.live.values()),
                                         ended, self.scheduler.running, self.pool))
        return outputs

    def _follow_grammars(self, plan: SchedulerOutput) -> None:
        """Each request with a grammar that sampled this step: its matcher takes the new tokens, and a grammar now
        complete ends the request ("stop"). With ``jump_forward``, the tokens its grammar forces next are appended
        now, unsampled, and computed with its next step's (not for a request asking for logprobs: they have none)."""
        for work in plan.scheduled:
            request, rid = work.request, work.request.request_id
            if not work.samples or request.is_finished or rid not in self.structured.grammars:
                continue
            try:
                complete = self.structured.advance(rid, request.output_token_ids)
                if not complete and self.config.jump_forward and request.params.logprobs is None:
                    self.structured.stats.forced_tokens += self.scheduler.append_forced(
                        request, self.structured.forced_tokens(rid))
                    complete = not request.is_finished and self.structured.advance(rid, request.output_token_ids)
            except ValueError as error:  # its grammar refused a token (a stop token id, say): it fails alone
                self._fail(request, error)
                continue
            if complete:
                self.scheduler.finish(request, "stop")

    def _fail(self, request: Request, error: Exception) -> None:
        """One request's own failure ends it with finish_reason "error" and the message in its output."""
        log.error("request %s failed: %s: %s", request.request_id, type(error).__name__, error, exc_info=error)
        self.scheduler.fail(request)
        self.output.fail(request, f"{type(error).__name__}: {error}")

    def stream(self) -> Iterator[StreamDelta]:
        """Step until every request is done, yielding each request's new text as it comes (:meth:`step_deltas`)."""
        while self.has_unfinished_requests() or self.output.leaving:
            yield from self.step_deltas()


__all__ = ["Engine", "EngineConfig", "EngineStats", "RequestStatus", "SchedulerConfig", "StepRecord"]
