"""The engine loop: schedule, build a batch, run the model over the paged cache, sample, update.

Requests can be added at any time, also while others decode: each step the
scheduler sees them. That is continuous batching.
"""
from __future__ import annotations

import operator
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import torch
from torch.profiler import record_function

from .batch import Batch, SequenceWork
from .block_pool import BlockPool, PoolStats
from .device import free_gpu_memory
from .kv_cache import PagedKVCache
from .model import Transformer
from .outputs import CompletionOutput, RequestMetrics, RequestOutput, StreamDelta
from .request import Request, RequestStatus
from .sampling import SamplingParams, make_generator, sample
from .scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from .tokenizer import Tokenizer

DEFAULT_CPU_KV_MEMORY = 512 * 2**20  # bytes of K/V on a CPU when nothing else is said


@dataclass(frozen=True)
class EngineConfig:
    block_size: int = 16
    num_blocks: int | None = None       # the pool's size; else from kv_cache_memory
    kv_cache_memory: int | None = None  # bytes for K/V; default 512 MiB on a CPU, else the fraction below
    gpu_memory_fraction: float = 0.4    # of the free GPU memory (device.free_gpu_memory), when kv_cache_memory is not given
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 2048
    record: bool = False                # keep a StepRecord per step (for timelines and block maps)


@dataclass(frozen=True)
class StepRecord:
    """A snapshot after one step: enough to draw the block map and the timeline."""

    step: int
    time: float
    scheduled: dict[str, int]           # request id -> tokens computed this step
    prefill: frozenset[str]             # which of them were prefills
    preempted: tuple[str, ...]
    states: dict[str, str]              # every request seen so far -> its status
    block_tables: dict[str, list[int]]  # running requests -> their blocks
    num_cached: dict[str, int]          # running requests -> tokens in the cache
    num_blocks: int
    block_size: int


@dataclass(frozen=True)
class EngineStats:
    steps: int
    running: int
    waiting: int
    finished: int
    preemptions: int
    generated_tokens: int
    pool: PoolStats


@dataclass
class _Tracked:
    """Engine-side state of a request that the scheduler does not need."""

    request: Request
    generator: torch.Generator | None
    text: str = ""
    streamed_text: int = 0
    streamed_tokens: int = 0
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(0.0))


class Engine:
    def __init__(self, model: Transformer, tokenizer: Tokenizer, config: EngineConfig | None = None) -> None:
        self.model, self.tokenizer = model, tokenizer
        self.config = config = config or EngineConfig()
        num_blocks = config.num_blocks or PagedKVCache.blocks_in_budget(
            model.cfg, config.block_size, model.dtype, self._kv_memory())
        if num_blocks < 1:
            block_bytes = config.block_size * model.cfg.kv_bytes_per_token(model.dtype)
            raise ValueError(f"the KV cache memory ({self._kv_memory()} bytes) holds no block of "
                             f"{config.block_size} tokens ({block_bytes} bytes): give it more memory")
        self.pool = BlockPool(num_blocks, config.block_size)
        self.cache = PagedKVCache(model.cfg, num_blocks, config.block_size, device=model.device, dtype=model.dtype)
        self.scheduler = Scheduler(SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens),
                                   self.pool, tokenizer.eos_token_id)
        self.history: list[StepRecord] = []
        self.steps = 0
        self._tracked: dict[str, _Tracked] = {}
        self._next_id = 0
        self._pending: list[RequestOutput] = []  # aborted outputs, returned by the next step

    def _kv_memory(self) -> int:
        if self.config.kv_cache_memory is not None:
            return self.config.kv_cache_memory
        if self.model.device.type == "cuda":  # free memory counts what PyTorch caches but no tensor holds
            return int(free_gpu_memory(self.model.device) * self.config.gpu_memory_fraction)
        return DEFAULT_CPU_KV_MEMORY

    # --- requests in and out -------------------------------------------------------------

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        """Queue a request (text or token ids); it joins the running batch at a later step."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}: "
                             "pass SamplingParams(...) or None for the defaults")
        text = prompt if isinstance(prompt, str) else None
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else _token_ids(prompt)
        numbered = request_id is None
        while numbered and str(self._next_id) in self._tracked:  # skip ids the caller chose
            self._next_id += 1
        request_id = str(self._next_id) if numbered else str(request_id)
        if request_id in self._tracked:
            raise ValueError(f"request id {request_id!r} is already in use: pick another")
        cfg = self.model.cfg
        if not ids:
            raise ValueError("the prompt is empty: give at least one token")
        if any(not 0 <= t < cfg.vocab_size for t in ids):
            raise ValueError(f"prompt token ids must be in 0..{cfg.vocab_size - 1}")
        if len(ids) + params.max_tokens > cfg.context_length:
            raise ValueError(f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the model's "
                             f"context of {cfg.context_length} tokens: shorten the prompt or lower max_tokens")
        now = time.perf_counter()
        request = Request(request_id, ids, params, prompt=text, arrival_time=now)
        self.scheduler.add(request)  # raises if the pool could never hold it
        self._next_id += numbered  # a refused request uses up no id
        self._tracked[request_id] = _Tracked(request, make_generator(params.seed, self.model.device),
                                             metrics=RequestMetrics(arrival_time=now))
        return request_id

    def abort(self, request_id: str) -> RequestOutput:
        """Stop a request now; its blocks go back to the pool. Unknown or finished ids raise."""
        request = self.scheduler.find(request_id)
        self.scheduler.finish(request, "abort")
        self._finished(self._tracked[request_id], time.perf_counter())
        out = self._output(self._tracked[request_id])
        self._pending.append(out)
        return out

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def stats(self) -> EngineStats:
        done = [t for t in self._tracked.values() if t.request.is_finished]
        return EngineStats(self.steps, len(self.scheduler.running), len(self.scheduler.waiting), len(done),
                           sum(t.request.num_preemptions for t in self._tracked.values()),
                           sum(len(t.request.output_token_ids) for t in self._tracked.values()),
                           self.pool.stats())

    # --- the loop ------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """Run one step; return the outputs of every request that moved (and any just aborted)."""
        with record_function("schedule"):  # named phases show up in torch.profiler (chapter 8)
            plan = self.scheduler.schedule()
        outputs, self._pending = self._pending, []
        if not plan.is_empty:
            tokens = self._run_model(plan)
            with record_function("update"):
                now = time.perf_counter()
                self.scheduler.update(plan, tokens)
                for work in plan.scheduled:
                    tracked = self._tracked[work.request.request_id]
                    self._record_token(tracked, work.request, now)
                    outputs.append(self._output(tracked))
        self.steps += 1
        if self.config.record:
            self.history.append(self._snapshot(plan))
        return outputs

    def _run_model(self, plan: SchedulerOutput) -> list[int]:
        with record_function("prepare"):
            seqs = [SequenceWork(w.request.all_token_ids[w.request.num_computed_tokens:],
                                 w.request.num_computed_tokens, w.request.block_table) for w in plan.scheduled]
            batch = Batch.build(seqs, self.pool.block_size, self.model.device)
            cache = self.cache.bind(batch)
        with record_function("forward"):
            logits = self.model(batch.token_ids[None], cache, logits_indices=batch.logits_indices)
        with record_function("sample"):
            # Every row is sampled on the device first (greedy rows by argmax, the others with their own
            # generators), then one transfer brings the whole step's tokens to the host: one sync per step.
            tokens = logits.argmax(dim=-1)
            for row, work in enumerate(plan.scheduled):
                params = work.request.params
                if not params.greedy:
                    generator = self._tracked[work.request.request_id].generator
                    tokens[row:row + 1] = sample(logits[row:row + 1], params, generator)
            return tokens.tolist()

    def _record_token(self, tracked: _Tracked, request: Request, now: float) -> None:
        m = tracked.metrics
        m.first_scheduled_time = m.first_scheduled_time or now
        m.first_token_time = m.first_token_time or now
        m.last_token_time = now
        m.num_output_tokens = len(request.output_token_ids)
        m.num_preemptions = request.num_preemptions
        request.token_times.append(now)
        tracked.text = self.tokenizer.decode(request.output_token_ids, skip_special_tokens=True)
        if not request.is_finished:
            self._check_stop_strings(tracked, request)
        if request.is_finished:
            self._finished(tracked, now)

    def _check_stop_strings(self, tracked: _Tracked, request: Request) -> None:
        """End the request when its text contains a stop string; the text is cut before it."""
        hits = [i for s in request.params.stop if (i := tracked.text.find(s)) >= 0]
        if hits:
            tracked.text = tracked.text[:min(hits)]
            self.scheduler.finish(request, "stop")

    def _finished(self, tracked: _Tracked, now: float) -> None:
        tracked.request.finish_time = now
        tracked.metrics.finished_time = now

    def _output(self, tracked: _Tracked) -> RequestOutput:
        r = tracked.request
        return RequestOutput(r.request_id, r.prompt, r.prompt_token_ids,
                             [CompletionOutput(0, tracked.text, list(r.output_token_ids), r.finish_reason)],
                             r.is_finished, tracked.metrics)

    def stream(self) -> Iterator[StreamDelta]:
        """Step until every request is done, yielding each request's new text as it comes.

        Text that ends in a partial UTF-8 character is held back until the
        character is complete; so are the last ``max(len(stop)) - 1`` characters,
        which a stop string completed by a later token would cut off the final text.
        A finished request's last delta has ``finished`` and brings what was held back.
        """
        while self.has_unfinished_requests() or self._pending:
            for out in self.step():
                tracked = self._tracked[out.request_id]
                text = out.outputs[0].text
                ready = len(text) if out.finished else max(
                    tracked.streamed_text, len(text.rstrip("\ufffd")) - _stop_hold_back(tracked.request.params))
                delta = StreamDelta(out.request_id, text[tracked.streamed_text:ready],
                                    out.outputs[0].token_ids[tracked.streamed_tokens:],
                                    out.finished, out.outputs[0].finish_reason)
                tracked.streamed_text, tracked.streamed_tokens = ready, len(out.outputs[0].token_ids)
                yield delta

    def _snapshot(self, plan: SchedulerOutput) -> StepRecord:
        running = self.scheduler.running
        return StepRecord(
            step=self.steps - 1, time=time.perf_counter(),
            scheduled={w.request.request_id: w.num_tokens for w in plan.scheduled},
            prefill=frozenset(w.request.request_id for w in plan.scheduled if w.is_prefill),
            preempted=tuple(r.request_id for r in plan.preempted),
            states={rid: t.request.status.value for rid, t in self._tracked.items()},
            block_tables={r.request_id: list(r.block_table) for r in running},
            num_cached={r.request_id: r.num_computed_tokens for r in running},
            num_blocks=self.pool.num_blocks, block_size=self.pool.block_size)

    def request(self, request_id: str) -> Request:
        """The scheduler's record of a request (finished ones too)."""
        return self._tracked[request_id].request


def _token_ids(prompt: object) -> list[int]:
    """A prompt that is not text must be a sequence of int token ids; anything else is refused here,
    before it reaches the scheduler, with what to pass instead."""
    what = f"a prompt must be text (str) or a list of int token ids, got {type(prompt).__name__}"
    if prompt is None or isinstance(prompt, (bytes, Mapping, set, frozenset)) or not hasattr(prompt, "__iter__"):
        raise ValueError(f"{what}: pass a string, or tokenizer.encode(text)")
    ids = []
    for t in prompt:
        if isinstance(t, bool):
            raise ValueError(f"{what} holding a bool ({t!r}): pass int token ids")
        try:
            ids.append(operator.index(t))  # int, numpy and 0-d torch ints; not floats or strings
        except TypeError:
            raise ValueError(f"{what} holding {type(t).__name__} {t!r}: pass int token ids, "
                             "or a single string (one prompt) as text") from None
    return ids


def _stop_hold_back(params: SamplingParams) -> int:
    """How many trailing characters a stream keeps back: a stop string may start in them and end in a
    token still to come, and then the final text ends before it (0 without stop strings)."""
    return max((len(s) for s in params.stop), default=1) - 1


__all__ = ["Engine", "EngineConfig", "EngineStats", "RequestStatus", "StepRecord"]
