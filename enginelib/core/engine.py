"""The engine loop: schedule, build a batch, run the model over the paged cache, sample, update.

Requests can be added at any time, also while others decode: each step the
scheduler sees them. That is continuous batching. With a speculative config,
each step first asks a proposer for guesses, and a decode verifies them in the
same forward pass (:mod:`enginelib.speed.speculative`).
"""
from __future__ import annotations

import operator
import time
import warnings
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, fields, replace

import torch
from torch.profiler import record_function

from enginelib.config import SamplingParams, check_request, stop_hold_back
from enginelib.core.batch import Batch, SequenceWork
from enginelib.core.block_pool import BlockPool, PoolStats
from enginelib.core.kv_manager import KVCacheManager, PrefixCacheStats
from enginelib.core.outputs import CompletionOutput, DeltaCursor, RequestMetrics, RequestOutput, StreamDelta
from enginelib.core.paged_cache import PagedKVCache
from enginelib.core.request import Request, RequestStatus
from enginelib.core.scheduler import ScheduledWork, Scheduler, SchedulerConfig, SchedulerOutput
from enginelib.model.device import free_gpu_memory
from enginelib.model.sampling import make_generator, sample
from enginelib.model.tokenizer import IncrementalDetokenizer, Tokenizer
from enginelib.model.transformer import Transformer
from enginelib.speed import cpu_kernels
from enginelib.speed.compiled import CompileConfig, CompiledDecoder, CompileReport, compile_unavailable
from enginelib.speed.speculative import (
    Proposer,
    SpecStats,
    SpeculativeConfig,
    accept_greedy,
    make_proposer,
    rejection_sample,
)

DEFAULT_CPU_KV_MEMORY = 512 * 2**20  # bytes of K/V on a CPU when nothing else is said
KEEP_FINISHED = 1024  # finished requests kept for engine.request(); nothing walks them per step


@dataclass(frozen=True)
class EngineConfig:
    block_size: int = 16
    num_blocks: int | None = None       # the pool's size; else from kv_cache_memory
    kv_cache_memory: int | None = None  # bytes for K/V; default 512 MiB on a CPU, else the fraction below
    gpu_memory_fraction: float = 0.4    # of the free GPU memory (device.free_gpu_memory), when kv_cache_memory is not given
    enable_prefix_caching: bool = True  # reuse computed blocks of a shared prefix (chapter 9)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)  # seats, token budget, chunked prefill
    record: bool = False                # keep a StepRecord per step (for timelines and block maps)
    speculative: SpeculativeConfig | None = None  # guess tokens and verify them in one step (chapter 12); off: None
    compile: CompileConfig | None = None  # decode and verify steps through torch.compile, per bucket; off: None (eager)
    # CPU, float32: eager steps of one token per sequence attend with the C++ kernel a compiled step uses
    # (cpu_kernels.decode_attention: keys read where they lie) instead of gathering them for SDPA
    cpu_decode_kernel: bool = False

    @classmethod
    def from_args(cls, **args) -> "EngineConfig":
        """Flat keyword arguments, as ``LLM(max_num_seqs=8, block_size=16)`` takes them, sorted into the configs."""
        names = {f.name for f in fields(SchedulerConfig)}
        unknown = set(args) - names - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"unknown engine arguments {sorted(unknown)}: use fields of EngineConfig or SchedulerConfig")
        scheduler = SchedulerConfig(**{k: args.pop(k) for k in list(args) if k in names})
        args.setdefault("scheduler", scheduler)
        return cls(**args)


@dataclass(frozen=True)
class StepRecord:
    """A snapshot after one step: enough to draw the block map and the timeline."""

    step: int
    time: float
    scheduled: dict[str, int]           # request id -> tokens computed this step
    prefill: frozenset[str]             # which of them were prefills (or chunks of one)
    preempted: tuple[str, ...]
    states: dict[str, str]              # requests alive this step (and those that just ended) -> status
    block_tables: dict[str, list[int]]  # running requests -> their blocks
    num_cached: dict[str, int]          # running requests -> tokens in the cache
    num_blocks: int
    block_size: int
    ref_counts: tuple[int, ...] = ()    # per block: how many requests hold it (prefix caching shares blocks)
    block_hashes: dict[int, str] = field(default_factory=dict)  # cached blocks -> short hash (chapter 9)


@dataclass(frozen=True)
class EngineStats:
    steps: int
    running: int
    waiting: int
    finished: int
    preemptions: int
    generated_tokens: int
    pool: PoolStats
    prefix_cache: PrefixCacheStats
    spec_decode: SpecStats  # guesses proposed and accepted (all zero without speculation)


@dataclass
class _Live:
    """Engine-side state of an unfinished request that the scheduler does not need."""

    request: Request
    generator: torch.Generator | None
    detokenizer: IncrementalDetokenizer


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
        self.kv = KVCacheManager(self.pool, config.enable_prefix_caching)
        if config.cpu_decode_kernel:
            self._check_decode_kernel()
        self.cache = PagedKVCache(model.cfg, num_blocks, config.block_size, device=model.device, dtype=model.dtype,
                                  decode_kernel=config.cpu_decode_kernel)
        self.scheduler = Scheduler(config.scheduler, self.kv, tokenizer.eos_token_id)
        self.proposer: Proposer | None = None if config.speculative is None else make_proposer(
            config.speculative, model, config.scheduler.max_num_seqs)
        self.spec_stats = SpecStats()  # proposed / accepted guesses (all zero without speculation)
        self.compiled, self.compile_report = self._compile(config.compile)
        self.history: list[StepRecord] = []
        self.steps = 0
        self._live: dict[str, _Live] = {}                       # unfinished requests
        self._finished: OrderedDict[str, Request] = OrderedDict()  # the last KEEP_FINISHED that ended
        self._num_finished = self._num_preemptions = self._num_generated = 0
        self._next_id = 0
        self._pending: list[RequestOutput] = []  # aborted outputs, returned by the next step

    def _check_decode_kernel(self) -> None:
        if self.model.device.type != "cpu" or self.model.dtype != torch.float32:
            raise ValueError(f"cpu_decode_kernel runs float32 on a CPU, not {str(self.model.dtype).removeprefix('torch.')} "
                             f"on {self.model.device.type}: leave it off there")
        reason = cpu_kernels.unavailable()
        if reason:
            raise ValueError(f"cpu_decode_kernel needs enginelib's C++ kernels: {reason}")

    def _kv_memory(self) -> int:
        if self.config.kv_cache_memory is not None:
            return self.config.kv_cache_memory
        if self.model.device.type == "cuda":  # free memory counts what PyTorch caches but no tensor holds
            return int(free_gpu_memory(self.model.device) * self.config.gpu_memory_fraction)
        return DEFAULT_CPU_KV_MEMORY

    def _compile(self, config: CompileConfig | None) -> tuple[CompiledDecoder | None, CompileReport | None]:
        """Build the compiled decode step for every bucket now, or say why the engine stays eager."""
        if config is None:
            return None, None
        reason = compile_unavailable(self.model.device)
        if reason and config.fallback:
            warnings.warn(f"{reason}; the engine runs eagerly", RuntimeWarning, stacklevel=3)
            return None, None
        decoder = CompiledDecoder(self.model, config)  # raises ValueError with the reason when it cannot compile
        try:
            return decoder, decoder.compile(self.cache)
        except torch._dynamo.exc.BackendCompilerFailed as e:  # e.g. the C++ compiler rejected inductor's code
            inner = e.inner_exception
            message = f"torch.compile failed: {type(inner).__name__}: {str(inner).strip()[:300]}"
            if not config.fallback:
                raise ValueError(f"{message} (CompileConfig(fallback=True) runs eagerly instead)") from e
            warnings.warn(f"{message}; the engine runs eagerly", RuntimeWarning, stacklevel=3)
            return None, None

    # --- requests in and out -------------------------------------------------------------

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        """Queue a request (text or token ids); it joins the running batch at a later step."""
        params = SamplingParams() if params is None else params
        text = prompt if isinstance(prompt, str) else None
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else _token_ids(prompt)
        check_request(ids, params, self.model.cfg.vocab_size, self.model.cfg.context_length)
        numbered = request_id is None
        while numbered and str(self._next_id) in self._live:  # skip ids the caller chose
            self._next_id += 1
        request_id = str(self._next_id) if numbered else str(request_id)
        if request_id in self._live:
            raise ValueError(f"request id {request_id!r} is already in use: pick another")
        request = Request(request_id, ids, params, prompt=text, metrics=RequestMetrics(time.perf_counter()))
        self.scheduler.add(request)  # raises if the pool could never hold it
        self._next_id += numbered  # a refused request uses up no id
        self._finished.pop(request_id, None)  # an id may be used again once its request is done
        self._live[request_id] = _Live(request, make_generator(params.seed, self.model.device),
                                       IncrementalDetokenizer(self.tokenizer))
        return request_id

    def abort(self, request_id: str) -> RequestOutput:
        """Stop a request now; its blocks go back to the pool. Unknown or finished ids raise."""
        request = self.scheduler.find(request_id)
        self.scheduler.finish(request, "abort")
        live = self._live[request_id]
        out = self._output(live)
        self._forget(live, time.perf_counter())
        self._pending.append(out)
        return out

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def stats(self) -> EngineStats:
        """Counters kept as things happen: nothing here walks past requests."""
        return EngineStats(self.steps, len(self.scheduler.running), len(self.scheduler.waiting),
                           self._num_finished, self._num_preemptions, self._num_generated,
                           self.pool.stats(), self.kv.stats, replace(self.spec_stats))

    def request(self, request_id: str) -> Request:
        """The scheduler's record of a request: an unfinished one, or one of the last KEEP_FINISHED to end."""
        live = self._live.get(request_id)
        if live is not None:
            return live.request
        if request_id in self._finished:
            return self._finished[request_id]
        raise ValueError(f"no request {request_id!r}: unknown, or finished more than {KEEP_FINISHED} requests ago "
                         "(keep the RequestOutput that step() returned when it finished)")

    # --- the loop ------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """Run one step; return the outputs of every request that moved (and any just aborted)."""
        drafts = None
        if self.proposer is not None:
            with record_function("propose"):
                drafts = self._propose()
        with record_function("schedule"):  # named phases show up in torch.profiler (chapter 8)
            plan = self.scheduler.schedule(drafts) if drafts else self.scheduler.schedule()
        outputs, self._pending = self._pending, []
        ended = [o.request_id for o in outputs]
        self._num_preemptions += len(plan.preempted)
        if not plan.is_empty:
            tokens = self._run_model(plan)
            with record_function("update"):
                now = time.perf_counter()
                before = [len(w.request.output_token_ids) for w in plan.scheduled]
                self.scheduler.update(plan, tokens)
                for work, n in zip(plan.scheduled, before):
                    if not work.samples:
                        continue  # a prefill chunk: nothing to tell yet
                    live = self._live[work.request.request_id]
                    self._new_tokens(live, now, len(work.request.output_token_ids) - n)
                    self._num_generated += len(work.request.output_token_ids) - n
                    outputs.append(self._output(live))
                    if work.request.is_finished:
                        self._forget(live, now)
                        ended.append(work.request.request_id)
        self.steps += 1
        if self.config.record:
            self.history.append(self._snapshot(plan, ended))
        return outputs

    def _propose(self) -> dict[str, list[int]]:
        """Guesses for every running request that decodes next step, at most k and never past its max_tokens."""
        k, vocab = self.config.speculative.num_speculative_tokens, self.model.cfg.vocab_size
        drafts = {}
        for request in self.scheduler.running:
            n = min(k, request.params.max_tokens - len(request.output_token_ids) - 1)
            decodes = request.num_uncomputed_tokens == 1 and request.num_computed_tokens >= len(request.prompt_token_ids)
            if n < 1 or not decodes:
                continue
            guesses = list(self.proposer.propose(request.all_token_ids, n))[:n]
            if any(not 0 <= t < vocab for t in guesses):
                raise ValueError(f"the proposer guessed token ids outside the vocabulary (0..{vocab - 1}): {guesses}")
            if guesses:
                drafts[request.request_id] = guesses
        return drafts

    def _run_model(self, plan: SchedulerOutput) -> list[int | list[int]]:
        """Compute the step's tokens: one sampled token per work that ``samples``, or a verified run for a
        work with guesses (see :mod:`enginelib.speed.speculative`)."""
        with record_function("prepare"):
            seqs = [SequenceWork(w.request.token_slice(w.start, w.start + w.num_tokens - len(w.draft_token_ids))
                                 + w.draft_token_ids, w.start, w.request.block_table, w.samples, len(w.draft_token_ids))
                    for w in plan.scheduled]
            batch = Batch.build(seqs, self.pool.block_size, self.model.device)
        with record_function("forward"):  # a step of prefill chunks only has no rows of logits
            if self.compiled is not None and self.compiled.serves(batch):
                logits = self.compiled(batch, self.cache)
            else:
                logits = self.model(batch.token_ids, self.cache.bind(batch), positions=batch.positions,
                                    logits_indices=batch.logits_indices)
        with record_function("sample"):
            # Every row is sampled on the device first (greedy rows by argmax, the others with their own
            # generators), then one transfer brings the whole step's tokens to the host: one sync per step.
            tokens = logits.argmax(dim=-1)
            sampling = [w for w in plan.scheduled if w.samples]
            if not any(w.draft_token_ids for w in sampling):
                for row, work in enumerate(sampling):
                    request = work.request
                    if not request.params.greedy:
                        generator = self._live[request.request_id].generator
                        tokens[row:row + 1] = sample(logits[row:row + 1], request.params, generator)
                return tokens.tolist()
            return self._verify(sampling, logits, tokens)

    def _verify(self, sampling: list[ScheduledWork], logits: torch.Tensor, tokens: torch.Tensor) -> list[int | list[int]]:
        """Sample a step with guesses: k + 1 rows per work that guesses, one transfer to the host at the end."""
        rows, verdicts = [], []  # each work's first row; the [accepted, token] tensors of sampled verifications
        row = 0
        for work in sampling:
            request, n = work.request, 1 + len(work.draft_token_ids)
            rows.append(row)
            if not request.params.greedy:
                generator = self._live[request.request_id].generator
                if work.draft_token_ids:
                    verdicts.append(rejection_sample(logits[row:row + n], work.draft_token_ids, request.params,
                                                     generator))
                else:
                    tokens[row:row + 1] = sample(logits[row:row + 1], request.params, generator)
            row += n
        host = torch.cat([tokens, *verdicts]).tolist()
        sampled = iter(zip(host[row::2], host[row + 1::2]))
        out: list[int | list[int]] = []
        for work, first in zip(sampling, rows):
            guesses = work.draft_token_ids
            if not guesses:
                out.append(host[first])
                continue
            if work.request.params.greedy:
                run = accept_greedy(guesses, host[first:first + len(guesses) + 1])
            else:
                kept, token = next(sampled)
                run = guesses[:kept] + [token]
            self.spec_stats.record(len(guesses), len(run) - 1)
            out.append(run)
        return out

    def _new_tokens(self, live: _Live, now: float, count: int) -> None:
        """Stamp each new token's time, extend the text by its new characters only, and look for stop strings
        there, token by token: a stop string found before the last of a verified run cuts the run there."""
        request, detok = live.request, live.detokenizer
        ids = request.output_token_ids
        for end in range(len(ids) - count + 1, len(ids) + 1):
            request.metrics.token_times.append(now)
            before = len(detok.text)
            detok.step(ids if end == len(ids) else ids[:end])
            if end == len(ids) and request.is_finished:
                detok.flush(ids)  # ended by a token (EOS, a stop id, max_tokens): nothing is held back any more
                return
            if request.params.stop and self._check_stop_strings(live, before):
                del ids[end:]  # nothing past a stop
                return

    def _check_stop_strings(self, live: _Live, before: int) -> bool:
        """End the request when its text contains a stop string; the text is cut before it.

        Only the new characters can complete a match, so the search starts
        ``max(len(stop)) - 1`` characters before them: the work per token stays
        constant however long the text grows.
        """
        text, params = live.detokenizer.text, live.request.params
        start = max(0, before - stop_hold_back(params))
        hits = [i for s in params.stop if (i := text.find(s, start)) >= 0]
        if hits:
            live.detokenizer.text = text[:min(hits)]
            if live.request.is_finished:  # a later token of the same verified run ended it: the stop string came first
                live.request.finish_reason = "stop"
            self.scheduler.finish(live.request, "stop")
        return bool(hits)

    def _forget(self, live: _Live, now: float) -> None:
        """A finished request leaves the engine's per-step state; counters and a bounded record remain."""
        request = live.request
        request.metrics.finished_time = now
        del self._live[request.request_id]
        self._finished[request.request_id] = request
        if len(self._finished) > KEEP_FINISHED:
            self._finished.popitem(last=False)
        self._num_finished += 1

    def _output(self, live: _Live) -> RequestOutput:
        r = live.request
        return RequestOutput(r.request_id, r.prompt, r.prompt_token_ids,
                             [CompletionOutput(0, live.detokenizer.text, list(r.output_token_ids), r.finish_reason)],
                             r.is_finished, r.metrics)

    def stream(self) -> Iterator[StreamDelta]:
        """Step until every request is done, yielding each request's new text as it comes.

        What a :class:`DeltaCursor` holds back (a partial character, the last
        ``max(len(stop)) - 1`` characters) comes in a later delta; a finished
        request's last delta has ``finished`` and its metrics.
        """
        cursors: dict[str, DeltaCursor] = {}
        while self.has_unfinished_requests() or self._pending:
            for out in self.step():
                if out.request_id not in cursors:
                    cursors[out.request_id] = DeltaCursor(stop_hold_back(self.request(out.request_id).params))
                yield cursors[out.request_id].delta(out)
                if out.finished:
                    del cursors[out.request_id]

    def _snapshot(self, plan: SchedulerOutput, ended: list[str]) -> StepRecord:
        running = self.scheduler.running
        states = {rid: live.request.status.value for rid, live in self._live.items()}
        states |= {rid: RequestStatus.FINISHED.value for rid in ended}
        return StepRecord(
            step=self.steps - 1, time=time.perf_counter(),
            scheduled={w.request.request_id: w.num_tokens for w in plan.scheduled},
            prefill=frozenset(w.request.request_id for w in plan.scheduled if w.is_prefill),
            preempted=tuple(r.request_id for r in plan.preempted),
            states=states,
            block_tables={r.request_id: list(r.block_table) for r in running},
            num_cached={r.request_id: r.num_computed_tokens for r in running},
            num_blocks=self.pool.num_blocks, block_size=self.pool.block_size,
            ref_counts=tuple(self.pool.ref_counts),
            block_hashes={b: f"{h & 0xFFFFFFFF:08x}" for b, h in enumerate(self.pool.block_hashes) if h is not None})


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


__all__ = ["Engine", "EngineConfig", "EngineStats", "RequestStatus", "StepRecord"]
