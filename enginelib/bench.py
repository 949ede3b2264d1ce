"""``python -m enginelib.bench``: every system on the same workload, in one process.

Ratios measured side by side in one process hold on a noisy machine where
absolute numbers do not. The run also measures the machine itself (matmul
peak, memory bandwidth) so the engine can be placed against its limits.

    python -m enginelib.bench --quick --json bench.json
    python -m enginelib.bench --workload seed --systems naive,static,engine
    python -m enginelib.bench --endpoint http://127.0.0.1:8000/v1 --systems engine,endpoint

``--endpoint`` drives any OpenAI-compatible server (ours, vLLM, llama.cpp's)
with the same workload, as one more system. The ``serve`` section starts our
own server on the same engine config and compares its throughput under
concurrent streams with the offline engine's: the cost of HTTP and SSE.
The ``spec_decode`` section runs the engine with and without n-gram
speculation (chapter 12), the ``quant`` section the int8 and int4 models
against the float one (chapter 11): speed ratios and perplexity.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import importlib
import importlib.util
import json
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING
from unittest import mock

import torch
from tqdm import tqdm  # disable=None: bars on a terminal only, none in logs or notebooks

from .baselines import generate_cached, generate_naive, generate_static
from .block_pool import BlockPool
from .checks import check_greedy, float32_reference
from .device import PackedLinear, pick_device, set_threads
from .engine import Engine, EngineConfig
from .loadgen import LoadResult, percentile, run_load_sync
from .model import Transformer
from .outputs import RequestOutput
from .params import SamplingParams
from .scheduler import SchedulerConfig
from .speculative import SpeculativeConfig, SpecStats
from .tokenizer import Tokenizer
from .weights import DEFAULT_MODEL, load_model

if TYPE_CHECKING:
    from .serve import ServerProcess  # imported when used: the server stack is not needed offline

SYSTEMS = ("naive", "kv_cache", "static", "hf_static", "engine")
ENDPOINT = "endpoint"  # an OpenAI-compatible server at --endpoint, run only when one is given
WORKLOADS = ("seed", "mixed", "poisson", "shared-prefix", "long-prompt")

QUESTIONS = [
    "What is the capital of France?", "Write a haiku about the sea.", "Explain gravity to a child.",
    "List three colors.", "Tell me a story about a dragon.", "What is 12 times 7?", "Name a fruit.",
    "How do airplanes fly?", "Give me a recipe for pancakes.", "What is photosynthesis?",
    "Describe a sunset.", "Why do cats purr?", "What is a black hole?", "Write a limerick about a cat.",
    "How does a computer work?", "What causes rain?", "Explain what DNA is.", "What is the speed of light?",
    "Suggest a name for a dog.", "Why is the sky blue?", "What is an atom?", "How do vaccines work?",
    "What is the tallest mountain?", "Write a short poem about autumn.", "What are prime numbers?",
    "How do bees make honey?", "What is inflation?", "Describe the water cycle.", "Who wrote Hamlet?",
    "What is machine learning?", "How do magnets work?", "What is a volcano?", "Explain recursion.",
    "What do pandas eat?", "How far is the Moon?", "What is the internet?",
]


# --- workloads ---------------------------------------------------------------------------

@dataclass(frozen=True)
class BenchRequest:
    prompt_ids: list[int]
    max_tokens: int
    arrival_s: float = 0.0   # seconds after the start (Poisson arrivals)
    arrival_step: int = 0    # engine steps after the start (requests injected mid-decode)


@dataclass(frozen=True)
class Workload:
    name: str
    requests: list[BenchRequest]
    ignore_eos: bool = True

    def params(self, request: BenchRequest) -> SamplingParams:
        return SamplingParams(temperature=0, max_tokens=request.max_tokens, ignore_eos=self.ignore_eos)


def _chat(tok: Tokenizer, question: str, system: str | None = None) -> list[int]:
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": question}]
    return tok.encode(tok.apply_chat_template(messages))


def make_workload(name: str, tok: Tokenizer, quick: bool = False, rate: float = 2.0) -> Workload:
    """The named workload, deterministic (seeded); ``quick`` shrinks it to fit a 2-core CPU in minutes."""
    rng = random.Random(0)
    if name == "seed":  # the seed project's benchmark: 28 prompts, 6 more after the 5th step, 128 tokens
        first, later, new = (12, 4, 32) if quick else (28, 6, 128)
        reqs = [BenchRequest(_chat(tok, QUESTIONS[i % len(QUESTIONS)]), new, arrival_step=0 if i < first else 5)
                for i in range(first + later)]
        return Workload(name, reqs)
    if name == "mixed":  # long-tailed prompt and output lengths
        n, cap = (12, 64) if quick else (32, 256)
        reqs = []
        for i in range(n):
            words = min(300, int(rng.lognormvariate(3.0, 1.0)))
            question = QUESTIONS[i % len(QUESTIONS)] + " " + " ".join(rng.choice(QUESTIONS).split()[:1] * words)
            reqs.append(BenchRequest(_chat(tok, question), max(4, min(cap, int(rng.lognormvariate(3.5, 0.8))))))
        return Workload(name, reqs)
    if name == "poisson":  # arrivals at `rate` requests per second
        n, new = (12, 24) if quick else (32, 64)
        t, reqs = 0.0, []
        for i in range(n):
            t += rng.expovariate(rate)
            reqs.append(BenchRequest(_chat(tok, QUESTIONS[i % len(QUESTIONS)]), new, arrival_s=t))
        return Workload(name, reqs)
    if name == "shared-prefix":  # many requests behind one long system prompt
        n, new = (12, 24) if quick else (32, 64)
        system = ("You are a meticulous assistant for a bakery. Answer briefly and kindly. " * 12).strip()
        reqs = [BenchRequest(_chat(tok, QUESTIONS[i % len(QUESTIONS)], system), new) for i in range(n)]
        return Workload(name, reqs)
    if name == "long-prompt":  # short requests decoding when long documents arrive (chunked prefill, chapter 10)
        short, new, long_tokens, at = (6, 40, 700, (6, 18)) if quick else (12, 96, 1500, (8, 30, 60))
        reqs = [BenchRequest(_chat(tok, QUESTIONS[i % len(QUESTIONS)]), new) for i in range(short)]
        words = " ".join(QUESTIONS).split()
        for i, step in enumerate(at):
            document = " ".join(words[(i * 7 + j) % len(words)] for j in range(long_tokens))
            ids = _chat(tok, "Summarize this text: " + document)[-long_tokens:]
            reqs.append(BenchRequest(ids, 4, arrival_step=step))
        return Workload(name, reqs)
    raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")


# --- measuring one system ---------------------------------------------------------------

@dataclass
class SystemResult:
    """What one system did on one workload: throughput and per-request latencies (seconds)."""

    name: str
    requests: int
    output_tokens: int
    seconds: float
    ttft: list[float] = field(default_factory=list)
    tpot: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)  # every gap between two tokens of a request
    e2e: list[float] = field(default_factory=list)
    note: str = ""
    prefix_hit_rate: float | None = None  # the engine's, when it caches prefixes
    outputs: list[list[int]] = field(default_factory=list, repr=False)
    texts: list[str] = field(default_factory=list, repr=False)  # the engine's and an endpoint's, to compare
    timings: list[tuple[float, list[float]]] = field(default_factory=list, repr=False)  # (arrival, token times)

    @property
    def tok_per_s(self) -> float:
        return self.output_tokens / self.seconds

    def summary(self) -> dict:
        return {"tok_per_s": self.tok_per_s, "output_tokens": self.output_tokens, "seconds": self.seconds,
                "requests": self.requests,
                "ttft_p50_s": _pct(self.ttft, 50), "ttft_p99_s": _pct(self.ttft, 99),
                "tpot_p50_s": _pct(self.tpot, 50), "tpot_p99_s": _pct(self.tpot, 99),
                "itl_p99_s": _pct(self.itl, 99), "prefix_hit_rate": self.prefix_hit_rate,
                "e2e_p50_s": _pct(self.e2e, 50), "note": self.note}


_pct = percentile  # nearest rank: every percentile reported is a latency that was measured


def _latencies(result: SystemResult, arrival: float, token_times: list[float]) -> None:
    """Add one request's TTFT, TPOT and end-to-end latency (absolute perf_counter times)."""
    result.ttft.append(token_times[0] - arrival)
    if len(token_times) > 1:
        result.tpot.append((token_times[-1] - token_times[0]) / (len(token_times) - 1))
        result.itl += [b - a for a, b in zip(token_times, token_times[1:])]
    result.e2e.append(token_times[-1] - arrival)


def _sync(model: Transformer) -> None:
    if model.device.type == "cuda":
        torch.cuda.synchronize()


def run_one_at_a_time(name: str, generate: Callable, model: Transformer, tok: Tokenizer,
                      wl: Workload, limit: int | None = None) -> SystemResult:
    """Serve requests one after another in arrival order (naive or with a contiguous cache)."""
    reqs = wl.requests[:limit] if limit else wl.requests
    result = SystemResult(name, len(reqs), 0, 0.0,
                          note=f"measured on the first {len(reqs)} of {len(wl.requests)} requests" if limit else "")
    start = time.perf_counter()
    for r in tqdm(reqs, desc=name, leave=False, disable=None):
        arrival = start + r.arrival_s
        if time.perf_counter() < arrival:
            time.sleep(arrival - time.perf_counter())
        began = time.perf_counter()
        gen = generate(model, r.prompt_ids, wl.params(r), tok.eos_token_id)
        _sync(model)
        result.output_tokens += len(gen.token_ids)
        result.outputs.append(gen.token_ids)
        _latencies(result, arrival, [began + t for t in gen.token_times])
    result.seconds = time.perf_counter() - start
    return result


def run_static(model: Transformer, tok: Tokenizer, wl: Workload, batch_size: int) -> SystemResult:
    """Padded static batches of ``batch_size`` in arrival order; each runs to its longest request."""
    result = SystemResult("static", len(wl.requests), 0, 0.0, note=f"B={batch_size}")
    start = time.perf_counter()
    for i in tqdm(range(0, len(wl.requests), batch_size), desc="static", leave=False, disable=None):
        group = wl.requests[i:i + batch_size]
        ready = start + max(r.arrival_s for r in group)
        if time.perf_counter() < ready:
            time.sleep(ready - time.perf_counter())
        began = time.perf_counter()
        longest = max(r.max_tokens for r in group)
        run = generate_static(model, [r.prompt_ids for r in group],
                              SamplingParams(temperature=0, max_tokens=longest, ignore_eos=wl.ignore_eos),
                              tok.eos_token_id)
        _sync(model)
        for r, gen in zip(group, run.generations):
            mine = gen.token_ids[:r.max_tokens]  # tokens past a request's own limit are waste, not output
            result.output_tokens += len(mine)
            result.outputs.append(mine)
            _latencies(result, start + r.arrival_s, [began + t for t in gen.token_times[:len(mine)]])
    result.seconds = time.perf_counter() - start
    return result


def run_engine(model: Transformer, tok: Tokenizer, wl: Workload, config: EngineConfig) -> SystemResult:
    """Continuous batching: each request joins at its arrival (in seconds or in engine steps)."""
    engine = Engine(model, tok, config)
    result = SystemResult("engine", len(wl.requests), 0, 0.0, note=f"max_num_seqs={config.scheduler.max_num_seqs}")
    pending = sorted(range(len(wl.requests)), key=lambda i: (wl.requests[i].arrival_step, wl.requests[i].arrival_s))
    ids: dict[str, int] = {}
    finals: dict[str, RequestOutput] = {}
    start = time.perf_counter()
    with tqdm(total=len(wl.requests), desc="engine", leave=False, disable=None) as bar:
        while pending or engine.has_unfinished_requests():
            now = time.perf_counter() - start
            while pending and wl.requests[pending[0]].arrival_step <= engine.steps \
                    and wl.requests[pending[0]].arrival_s <= now:
                i = pending.pop(0)
                ids[engine.add_request(wl.requests[i].prompt_ids, wl.params(wl.requests[i]))] = i
            if not engine.has_unfinished_requests() and wl.requests[pending[0]].arrival_s > now:
                time.sleep(wl.requests[pending[0]].arrival_s - now)
                continue
            done = [out for out in engine.step() if out.finished]
            finals |= {out.request_id: out for out in done}
            bar.update(len(done))
    _sync(model)
    result.seconds = time.perf_counter() - start
    if config.enable_prefix_caching:
        result.prefix_hit_rate = engine.kv.stats.hit_rate
    for rid, i in sorted(ids.items(), key=lambda kv: kv[1]):
        out = finals[rid]
        result.output_tokens += len(out.outputs[0].token_ids)
        result.outputs.append(out.outputs[0].token_ids)
        result.texts.append(out.outputs[0].text)
        # A request injected at a step arrives when it is added; one with an arrival time arrives then,
        # even if a busy step delayed its add (that wait is part of its latency).
        arrival = out.metrics.arrival_time if wl.requests[i].arrival_step else start + wl.requests[i].arrival_s
        _latencies(result, arrival, out.metrics.token_times)
        result.timings.append((arrival, out.metrics.token_times))
    return result


def prefix_cache_effect(model: Transformer, tok: Tokenizer, config: EngineConfig, quick: bool) -> dict:
    """The ``shared-prefix`` workload with the prefix cache on and off, same process: TTFT and hit rate."""
    wl = make_workload("shared-prefix", tok, quick)
    on = run_engine(model, tok, wl, dataclasses.replace(config, enable_prefix_caching=True))
    off = run_engine(model, tok, wl, dataclasses.replace(config, enable_prefix_caching=False))
    _check_same_tokens(model, wl, {"kv_cache": off, "engine": on})  # off is the reference here
    return {"ttft_p50_on_s": _pct(on.ttft, 50), "ttft_p50_off_s": _pct(off.ttft, 50),
            "ttft_ratio": _pct(on.ttft, 50) / _pct(off.ttft, 50), "hit_rate": on.prefix_hit_rate,
            "tok_per_s_on": on.tok_per_s, "tok_per_s_off": off.tok_per_s, "note": on.note.strip("; ")}


def chunked_prefill_effect(model: Transformer, tok: Tokenizer, config: EngineConfig, quick: bool,
                           budget: int) -> dict:
    """The ``long-prompt`` workload with and without chunked prefill: decode latency of the running requests.

    Without chunking a long prompt is prefilled in one step and every running
    request waits for it; with a token budget of ``budget`` it is split. The
    tail of the gaps between tokens (p99 inter-token latency, the TPOT a
    streaming reader feels) is compared on the short requests only.
    """
    wl = make_workload("long-prompt", tok, quick)
    short = Workload(wl.name, [r for r in wl.requests if r.arrival_step == 0], wl.ignore_eos)
    runs = {}
    for chunked in (True, False):
        sched = dataclasses.replace(config.scheduler, enable_chunked_prefill=chunked,
                                    max_num_batched_tokens=budget if chunked else 4096)
        runs[chunked] = run_engine(model, tok, wl, dataclasses.replace(config, scheduler=sched))
    decode_itl = {}
    for chunked, r in runs.items():
        gaps = SystemResult("short", 0, 0, 1.0)
        for req, (arrival, times) in zip(wl.requests, r.timings):
            if req.arrival_step == 0:
                _latencies(gaps, arrival, times)
        decode_itl[chunked] = _pct(gaps.itl, 99)
    _check_same_tokens(model, wl, {"kv_cache": runs[False], "engine": runs[True]})
    return {"budget": budget, "short_requests": len(short.requests),
            "tpot_p99_on_s": decode_itl[True], "tpot_p99_off_s": decode_itl[False],
            "tpot_p99_ratio": decode_itl[True] / decode_itl[False],
            "ttft_p50_long_on_s": _pct([t for q, t in zip(wl.requests, runs[True].ttft) if q.arrival_step], 50),
            "ttft_p50_long_off_s": _pct([t for q, t in zip(wl.requests, runs[False].ttft) if q.arrival_step], 50),
            "note": runs[True].note.strip("; ")}


def run_endpoint(url: str, served_model: str, tok: Tokenizer, wl: Workload, concurrency: int,
                 text_prompts: bool = False, name: str = ENDPOINT) -> SystemResult:
    """The workload through an OpenAI-compatible server: streamed completions, timed as the client sees them.

    Prompts go to ``/v1/completions`` as the workload's own token ids, so the
    server computes exactly the tokens the other systems do (no chat template
    applied twice, no re-tokenizing drift); ours and vLLM take token-id prompts.
    ``text_prompts`` sends the decoded text instead, for a server whose
    tokenizer differs. Requests arrive at their ``arrival_s``; one the workload
    injects at an engine step cannot be timed so over HTTP and is sent at the
    start. At most ``concurrency`` are in flight; waiting for a free slot counts
    in a request's TTFT, as waiting in the engine's queue does.
    """
    prompts = [tok.decode(r.prompt_ids) if text_prompts else r.prompt_ids for r in wl.requests]
    arrivals = [r.arrival_s for r in wl.requests]
    extra = {"ignore_eos": True} if wl.ignore_eos else {}
    load = run_load_sync(url, served_model, prompts, [r.max_tokens for r in wl.requests], concurrency=concurrency,
                         arrivals=arrivals if any(arrivals) else None, **extra)
    return _endpoint_result(name, wl, load)


def _endpoint_result(name: str, wl: Workload, load: LoadResult) -> SystemResult:
    result = SystemResult(name, len(wl.requests), load.output_tokens, load.duration,
                          note=f"{load.concurrency} streams at most")
    result.texts = [t.text for t in load.timings]  # in request order; a failed request's is empty
    for t in load.ok:
        if t.token_times:  # latencies from when the request was due, as run_engine counts from arrival
            result.ttft.append(t.token_times[0] - t.due)
            result.e2e.append(t.token_times[-1] - t.due)
        if t.tpot is not None:  # a chunk may carry several tokens: TPOT is over the tokens the server counted
            result.tpot.append(t.tpot)
        result.itl += t.itl
    if stepped := sum(r.arrival_step > 0 for r in wl.requests):
        result.note += f"; {stepped} requests injected at an engine step were sent at the start"
    if load.errors:
        result.note += f"; {len(load.errors)} requests failed, first: {load.errors[0]}"
    return result


def _same_texts(a: SystemResult, b: SystemResult) -> float | None:
    """Fraction of requests whose texts are equal (greedy: the server must say what the engine says)."""
    n = min(len(a.texts), len(b.texts))
    return sum(x == y for x, y in zip(a.texts, b.texts)) / n if n else None


def served_model_name(url: str) -> str:
    """The model an OpenAI-compatible server serves (the first its ``/v1/models`` lists)."""
    import openai

    models = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=30).models.list().data
    if not models:
        raise ValueError(f"{url}/models lists no model: pass --served-model NAME")
    return models[0].id


def serve_args(args: argparse.Namespace, device: torch.device, threads: int, config: EngineConfig,
               concurrency: int) -> list[str]:
    """``python -m enginelib.serve`` flags for the engine config the offline runs use, ``concurrency`` seats."""
    sched = config.scheduler
    flags = ["--model", str(args.model), "--threads", str(threads), "--device", str(device),
             "--block-size", str(config.block_size), "--max-num-seqs", str(concurrency),
             "--max-num-batched-tokens", str(sched.max_num_batched_tokens), "--max-waiting", str(concurrency)]
    flags += ["--dtype", args.dtype] if args.dtype else []
    flags += ["--num-blocks", str(config.num_blocks)] if config.num_blocks is not None else []
    flags += [] if config.enable_prefix_caching else ["--no-prefix-caching"]
    return flags + ([] if sched.enable_chunked_prefill else ["--no-chunked-prefill"])


def serve_effect(server: ServerProcess, model: Transformer, tok: Tokenizer, wl: Workload, config: EngineConfig,
                 concurrency: int) -> dict:
    """Our server against the offline engine on the same workload, same engine config: the cost of HTTP and SSE.

    Both get ``max_num_seqs = concurrency`` (the client keeps that many streams
    open; the offline engine runs that many at once), the same threads, and the
    workload's requests all at the start (as ``run_endpoint`` sends them). The
    server (a started :class:`~enginelib.serve.ServerProcess`, flags from
    :func:`serve_args`) runs in a child process, so on a small CPU the client
    competes with it for cores; that is part of what is measured.
    """
    flat = Workload(wl.name, [dataclasses.replace(r, arrival_step=0) for r in wl.requests], wl.ignore_eos)
    sched = dataclasses.replace(config.scheduler, max_num_seqs=concurrency)
    same = dataclasses.replace(config, scheduler=sched)
    warm = Workload("warm-up", [BenchRequest(_chat(tok, "hi"), 4)])
    run_engine(model, tok, warm, same)  # one-off costs out of the measurement, as the server's warm-up below
    offline = run_engine(model, tok, flat, same)
    name = served_model_name(server.url)
    run_load_sync(server.url, name, [warm.requests[0].prompt_ids], 4, concurrency=1)
    served = run_endpoint(server.url, name, tok, flat, concurrency, name="server")
    return {"throughput_ratio": served.tok_per_s / offline.tok_per_s, "server_tok_per_s": served.tok_per_s,
            "offline_tok_per_s": offline.tok_per_s, "concurrency": concurrency, "requests": len(flat.requests),
            "ttft_p50": _pct(served.ttft, 50), "ttft_p99": _pct(served.ttft, 99),
            "tpot_p50": _pct(served.tpot, 50), "tpot_p99": _pct(served.tpot, 99),
            "offline_ttft_p50": _pct(offline.ttft, 50), "offline_tpot_p50": _pct(offline.tpot, 50),
            "texts_equal": _same_texts(served, offline), "note": served.note}


# --- speculative decoding and quantization ----------------------------------------------

def decode_seconds(token_times: list[list[float]]) -> float:
    """Seconds during which some request was decoding: the union of each request's [first token, last token].

    One request at a time, that is the sum of their decode spans; a batch
    decoding together counts its shared time once. Prefill (before a request's
    first token) and gaps between requests are left out, with or without speculation alike.
    """
    spans = sorted((t[0], t[-1]) for t in token_times if len(t) > 1)
    total, end = 0.0, -float("inf")
    for a, b in spans:
        if b > end:
            total += b - max(a, end)
            end = b
    return total


@dataclass
class SpecRun:
    """One engine run of a prompt set: its greedy texts, decode speed and guess counters."""

    texts: list[str]
    decode_tok_per_s: float
    stats: SpecStats


def run_spec(model: Transformer, tok: Tokenizer, prompts: list[list[int]], max_tokens: int, batch: int,
             speculative: SpeculativeConfig | None) -> SpecRun:
    """All ``prompts`` through one engine, at most ``batch`` running at once (1: one request at a time), greedy."""
    config = EngineConfig(speculative=speculative, scheduler=SchedulerConfig(max_num_seqs=batch))
    engine = Engine(model, tok, config)
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    ids = [engine.add_request(p, params) for p in prompts]
    finals: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests():
        finals |= {out.request_id: out for out in engine.step() if out.finished}
    _sync(model)
    outs = [finals[i] for i in ids]
    times = [o.metrics.token_times for o in outs]
    decoded = sum(len(t) - 1 for t in times)
    return SpecRun([o.outputs[0].text for o in outs], decoded / decode_seconds(times), engine.spec_stats)


def _spec_compare(model: Transformer, tok: Tokenizer, prompts: list[list[int]], max_tokens: int, batch: int,
                  spec: SpeculativeConfig) -> tuple[SpecRun, SpecRun]:
    """The same prompts without, then with speculation."""
    return (run_spec(model, tok, prompts, max_tokens, batch, None),
            run_spec(model, tok, prompts, max_tokens, batch, spec))


def _spec_figures(plain: SpecRun, spec: SpecRun) -> dict:
    return {"speedup": spec.decode_tok_per_s / plain.decode_tok_per_s, "tok_per_s": spec.decode_tok_per_s,
            "tok_per_s_plain": plain.decode_tok_per_s, "acceptance": spec.stats.acceptance_rate,
            "mean_accepted_length": spec.stats.mean_accepted_length, "proposed": spec.stats.proposed,
            "accepted": spec.stats.accepted,
            "texts_equal": sum(a == b for a, b in zip(plain.texts, spec.texts)) / len(plain.texts)}


def extractive_prompts(tok: Tokenizer, n: int) -> list[list[int]]:
    """Chats that ask the model to copy a passage of the shipped Shakespeare: what prompt lookup is made for."""
    from .quant import shakespeare

    lines = [line.strip() for line in shakespeare().splitlines() if len(line.split()) >= 4]
    return [_chat(tok, "Repeat this passage exactly, word for word:\n\n" + "\n".join(lines[6 * i:6 * i + 6]))
            for i in range(n)]


def spec_decode_effect(model: Transformer, tok: Tokenizer, quick: bool, k: int) -> dict:
    """Decode speed with n-gram speculation ÷ without, greedy, same prompts and max_tokens.

    Batch 1 (one request at a time) on the seed workload's chats, the honest
    case; the same on extractive prompts (copy a passage), the favourable one;
    and at batch 8, where a plain step is no longer bound by reading the
    weights, so the extra verified rows cost more and the gain shrinks.
    """
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=k)
    n, new, new8, n_ext = (2, 24, 12, 1) if quick else (8, 128, 64, 4)
    chats = [_chat(tok, q) for q in QUESTIONS[:max(n, 8)]]
    copy = extractive_prompts(tok, n_ext)
    for cfg in (None, spec):  # one-off costs out of the measurement: a short run of each, guesses included
        run_spec(model, tok, copy[:1], 6, 1, cfg)
    plain, fast = _spec_compare(model, tok, chats[:n], new, 1, spec)
    b1 = _spec_figures(plain, fast)
    plain8, fast8 = _spec_compare(model, tok, chats[:8], new8, 8, spec)
    b8 = _spec_figures(plain8, fast8)
    ext_plain, ext_fast = _spec_compare(model, tok, copy, new, 1, spec)
    extractive = _spec_figures(ext_plain, ext_fast)
    return {"speedup_b1": b1.pop("speedup"), **b1, "k": k, "method": "ngram", "prompts": n, "max_tokens": new,
            "speedup_b8": b8["speedup"], "texts_equal_b8": b8["texts_equal"], "acceptance_b8": b8["acceptance"],
            "extractive": {"speedup_b1": extractive.pop("speedup"), **extractive, "prompts": n_ext},
            "note": "seed-workload chats, greedy, stop at EOS; n-gram lookup finds little to copy in a chat "
                    "answer, so its gain there is small: 'extractive' (copy a passage) is the case it is made for"}


def quant_effect(model: Transformer, tok: Tokenizer, quick: bool, kernel: str = "auto") -> dict:
    """int8 and int4 against the model as loaded: single-stream decode tok/s ratio and perplexity change.

    Perplexity is on the shipped Shakespeare (its first 256 tokens quick, 2048
    full), decode speed from :func:`quant.decode_tokens_per_second`. ``ppl_delta``
    is relative (0.006 = +0.6%). ``kernels``: what ``quantize`` chose per weight shape.
    """
    from . import quant

    ppl_tokens, new = (256, 8) if quick else (2048, 64)

    def figures(m: Transformer) -> dict:
        return {"ppl": quant.perplexity(m, tok, max_tokens=ppl_tokens).perplexity,
                "tok_per_s": quant.decode_tokens_per_second(m, tok, max_tokens=new),
                "bytes_per_param": quant.linear_bytes_per_param(m), "weight_bytes": quant.weight_bytes(m)}

    quant.decode_tokens_per_second(model, tok, max_tokens=2)  # warm-up
    base = figures(model)
    report: dict = {"float": {**base, "dtype": str(model.dtype).removeprefix("torch.")}, "kernel": kernel,
                    "ppl_tokens": ppl_tokens, "decode_tokens": new,
                    "note": "kernels chosen by timing the candidates per weight shape" if kernel == "auto" else
                            f"kernel {kernel!r} everywhere (not timed against the others: run with "
                            "--quant-kernel auto, the full run's default, for the fastest exact kernels)"}
    for fmt in ("int8", "int4"):
        start = time.perf_counter()
        q = quant.quantize(model, fmt, kernel)
        took = time.perf_counter() - start
        quant.decode_tokens_per_second(q, tok, max_tokens=2)  # warm-up
        row = figures(q)
        report[fmt] = {**row, "tok_per_s_ratio": row["tok_per_s"] / base["tok_per_s"],
                       "ppl_delta": row["ppl"] / base["ppl"] - 1, "quantize_s": took,
                       "kernels": {f"{shape[0]}x{shape[1]}": name
                                   for (_, shape), name in sorted(q.quant_info.kernels.items())}}
        del q
    return report


def latency_curve(model: Transformer, tok: Tokenizer, rates: list[float], config: EngineConfig,
                  quick: bool = True) -> list[dict]:
    """The engine on the ``poisson`` workload at each arrival rate: throughput against latency."""
    rows = []
    for rate in rates:
        result = run_engine(model, tok, make_workload("poisson", tok, quick, rate), config)
        rows.append({"rate": rate, **result.summary()})
    return rows


def load_hf(device: torch.device, dtype: torch.dtype):
    """transformers' own model on the same GGUF file, or None when transformers is absent."""
    try:
        import transformers
        from transformers.utils import logging as hf_logging
    except ImportError:
        return None
    from .weights import fetch

    path = fetch()
    bars = hf_logging.is_progress_bar_enabled()
    quiet = contextlib.nullcontext()
    if not sys.stderr.isatty():  # like our own bars: none in logs or notebooks
        hf_logging.disable_progress_bar()
        # The GGUF loader draws its own tqdm.auto bar ("Converting and de-quantizing GGUF tensors"),
        # which disable_progress_bar() does not reach and a notebook shows as a widget.
        gguf = sys.modules.get("transformers.modeling_gguf_pytorch_utils")
        if gguf is None and importlib.util.find_spec("transformers.modeling_gguf_pytorch_utils"):
            gguf = importlib.import_module("transformers.modeling_gguf_pytorch_utils")
        if gguf is not None and hasattr(gguf, "tqdm"):
            quiet = mock.patch.object(gguf, "tqdm", functools.partial(gguf.tqdm, disable=True))
    try:
        with quiet:
            hf = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                                   dtype=dtype)
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    return hf.to(device).eval()


@torch.inference_mode()
def run_hf_static(hf, tok: Tokenizer, wl: Workload, batch_size: int, device: torch.device) -> SystemResult:
    """Hugging Face ``generate``, greedy, in padded static batches of ``batch_size``."""
    result = SystemResult("hf_static", len(wl.requests), 0, 0.0, note=f"transformers generate, B={batch_size}")
    pad = tok.eos_token_id
    start = time.perf_counter()
    for i in tqdm(range(0, len(wl.requests), batch_size), desc="hf_static", leave=False, disable=None):
        group = wl.requests[i:i + batch_size]
        width = max(len(r.prompt_ids) for r in group)
        ids = torch.tensor([[pad] * (width - len(r.prompt_ids)) + r.prompt_ids for r in group], device=device)
        mask = torch.tensor([[0] * (width - len(r.prompt_ids)) + [1] * len(r.prompt_ids) for r in group],
                            device=device)
        longest = max(r.max_tokens for r in group)
        # eos_token_id=None: run to max_new_tokens as our systems do with ignore_eos (min_new_tokens
        # would instead forbid EOS and change the tokens).
        out = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=longest, do_sample=False,
                          pad_token_id=pad, eos_token_id=None if wl.ignore_eos else tok.eos_token_id)
        if device.type == "cuda":
            torch.cuda.synchronize()
        done = time.perf_counter()
        for row, r in enumerate(group):
            mine = out[row, width:width + r.max_tokens].tolist()
            result.output_tokens += len(mine)
            result.outputs.append(mine)
            result.e2e.append(done - (start + r.arrival_s))
    result.seconds = time.perf_counter() - start
    return result


# --- the machine and the engine against it ------------------------------------------------

def matmul_peak(device: torch.device, dtype: torch.dtype, n: int = 2048, repeats: int = 5) -> float:
    """Best FLOP/s of a square matmul: the compute roof."""
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    times = []
    for _ in range(repeats + 1):
        t = time.perf_counter()
        a @ b
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return 2 * n ** 3 / min(times[1:])


def read_bandwidth(device: torch.device, megabytes: int = 512, repeats: int = 10) -> float:
    """Best bytes/s of summing a large float32 tensor: the memory roof for decode."""
    x = torch.ones(megabytes * 2**20 // 4, device=device)
    times = []
    for _ in range(repeats + 1):
        t = time.perf_counter()
        x.sum()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return x.nbytes / min(times[1:])


def decode_flops_per_token(model: Transformer, context: int) -> float:
    """Matmul FLOPs to decode one token at ``context``: weights (LM head once) plus attention."""
    cfg = model.cfg
    per_layer = cfg.hidden_size * (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim \
        + cfg.num_heads * cfg.head_dim * cfg.hidden_size + 3 * cfg.hidden_size * cfg.intermediate_size
    weights = cfg.num_layers * per_layer + cfg.hidden_size * cfg.vocab_size
    attention = cfg.num_layers * 2 * cfg.num_heads * cfg.head_dim * context
    return 2 * weights + 2 * attention


def decode_step_time(model: Transformer, tok: Tokenizer, batch: int, new_tokens: int) -> tuple[float, int]:
    """Median time of pure decode steps with ``batch`` running requests, and their mean context."""
    engine = Engine(model, tok, EngineConfig(scheduler=SchedulerConfig(batch, max(2048, batch * 64)), record=True))
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    for i in range(batch):
        engine.add_request(_chat(tok, QUESTIONS[i % len(QUESTIONS)]), params)
    while engine.has_unfinished_requests():
        engine.step()
    times = [b.time - a.time for a, b in zip(engine.history, engine.history[1:])
             if not b.prefill and len(b.scheduled) == batch]
    context = statistics.mean(sum(b.num_cached.values()) / batch for b in engine.history if b.num_cached)
    return statistics.median(times), int(context)


PHASES = ("schedule", "prepare", "forward", "sample", "update")
OP_KINDS = {"aten::linear": "matmuls", "aten::matmul": "matmuls", "aten::mm": "matmuls",
            "aten::addmm": "matmuls", "aten::index_select": "KV gather", "aten::index_copy_": "KV write",
            "mkldnn::_linear_pointwise": "matmuls"}


def _op_kind(name: str) -> str:
    if "scaled_dot_product" in name:
        return "attention"
    return OP_KINDS.get(name, "other ops")


def profile_steps(engine: Engine, steps: int = 8) -> dict[str, float]:
    """Run ``steps`` engine steps under torch.profiler; seconds per step by where they went.

    The step's phases (schedule, prepare, forward, sample, update) are the
    engine's own ``record_function`` ranges. The forward pass is split further
    into kinds of operators by their self time (the "KV gather" is every
    ``index_select``: keys and values through block tables, plus, in a step
    that mixes prefills and decodes, the few query rows shuffled into groups);
    what is left of it is Python and dispatch overhead: time between operators.

    On a CPU these are CPU times. On a GPU the host only launches kernels and
    waits for them where it reads results back (in "sample"), so CPU times would
    book the kernels' work there. There the CUDA activity is recorded too, and
    each phase and operator kind is booked with the device time of the kernels
    it launched; the host's own time per phase is kept as "host: <phase>", and
    "forward: python & dispatch" is then the forward's host time less its kernels'.
    """
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    on_gpu = engine.model.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            engine.step()
        if on_gpu:
            torch.cuda.synchronize()

    def spent(event) -> float:  # microseconds booked to an event: on a GPU, the kernels it and its children ran
        return event.device_time_total if on_gpu else event.cpu_time_total

    per_step: dict[str, float] = {}
    for event in prof.events():
        if event.device_type != DeviceType.CPU:
            continue  # the GPU-side copies of the ranges ("gpu_user_annotation"): their kernels are counted above
        if event.name in PHASES:
            per_step[event.name] = per_step.get(event.name, 0.0) + spent(event)
            if on_gpu:
                key = "host: " + event.name
                per_step[key] = per_step.get(key, 0.0) + event.cpu_time_total
        parent = event.cpu_parent
        while parent is not None and parent.name not in PHASES:
            parent = parent.cpu_parent
        if parent is not None and parent.name == "forward" and _is_op(event) and not _under_op(event):
            kind = "forward: " + _op_kind(event.name)
            per_step[kind] = per_step.get(kind, 0.0) + spent(event)
    ops = sum(v for k, v in per_step.items() if k.startswith("forward: "))
    forward = per_step.get("host: forward", 0.0) if on_gpu else per_step.get("forward", 0.0)
    per_step["forward: python & dispatch"] = forward - ops
    return {k: v / 1e6 / steps for k, v in per_step.items()}  # profiler times are in microseconds


def _is_op(event) -> bool:
    return event.name.startswith(("aten::", "mkldnn::"))


def _under_op(event) -> bool:
    """Whether an operator was called by another operator (count only the outermost)."""
    parent = event.cpu_parent
    while parent is not None:
        if _is_op(parent):
            return True
        parent = parent.cpu_parent
    return False


def kv_waste(wl: Workload, block_size: int, max_len: int, outputs: list[list[int]]) -> dict:
    """Share of reserved KV slots holding no token: paged (a block at a time) vs reserve-max-len."""
    lengths = [len(r.prompt_ids) + len(o) - 1 for r, o in zip(wl.requests, outputs)]
    paged_slots = sum(-(-n // block_size) * block_size for n in lengths)
    return {"paged": 1 - sum(lengths) / paged_slots, "contiguous": 1 - sum(lengths) / (max_len * len(lengths)),
            "max_len": max_len, "block_size": block_size}


def concurrency(wl: Workload, outputs: list[list[int]], block_size: int, max_len: int,
                budget_tokens: int) -> dict:
    """How many of the workload's requests one KV budget holds at once, paged vs contiguous."""
    pool = BlockPool(budget_tokens // block_size, block_size)
    held = 0
    for r, o in zip(wl.requests * 1000, outputs * 1000):  # as many as fit, cycling through the workload
        need = pool.blocks_for(len(r.prompt_ids) + len(o) - 1)
        if not pool.can_allocate(need):
            break
        pool.allocate(need)
        held += 1
    return {"paged": held, "contiguous": budget_tokens // max_len, "budget_tokens": budget_tokens}


# --- the command -------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m enginelib.bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small workloads: about 3 minutes on a 2-core CPU")
    ap.add_argument("--workload", default="seed", help=f"comma-separated, from {', '.join(WORKLOADS)}, or 'all'")
    ap.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated, from {', '.join(SYSTEMS)}")
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    ap.add_argument("--dtype", default=None, choices=["float32", "float16", "bfloat16"])
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: $ENGINELIB_THREADS or <= 4)")
    ap.add_argument("--no-pack", action="store_true", help="keep torch's default CPU matmul (no oneDNN packing)")
    ap.add_argument("--batch-size", type=int, default=8, help="B for the static systems")
    ap.add_argument("--max-num-seqs", type=int, default=64, help="the engine's running-request limit")
    ap.add_argument("--rate", type=float, default=2.0, help="Poisson arrivals per second")
    ap.add_argument("--max-len", type=int, default=2048, help="what a contiguous cache reserves per request")
    ap.add_argument("--naive-requests", type=int, default=None,
                    help="serve only this many requests with naive/kv_cache (they are slow); default 2 quick, 4 full")
    ap.add_argument("--no-prefix-caching", action="store_true", help="the engine without its prefix cache")
    ap.add_argument("--no-chunked-prefill", action="store_true", help="the engine prefills each prompt in one step")
    ap.add_argument("--chunk-budget", type=int, default=256,
                    help="the token budget per step in the chunked-prefill comparison")
    ap.add_argument("--endpoint", default=None, metavar="URL",
                    help="also run the workload through this OpenAI-compatible server (base URL, e.g. "
                         "http://127.0.0.1:8000/v1), reported as the system 'endpoint'")
    ap.add_argument("--served-model", default=None, metavar="NAME",
                    help="the model name to send to --endpoint (default: the first its /v1/models lists)")
    ap.add_argument("--text-prompts", action="store_true",
                    help="send --endpoint the prompts as text, not token ids (a server with another tokenizer)")
    ap.add_argument("--concurrency", type=int, default=32, help="streams in flight at most, for --endpoint and serve")
    ap.add_argument("--no-serve", action="store_true",
                    help="skip the serve section (our server vs the offline engine, same workload)")
    ap.add_argument("--no-spec-decode", action="store_true",
                    help="skip the spec_decode section (n-gram speculation vs plain decoding)")
    ap.add_argument("--spec-k", type=int, default=4, help="guesses per step in the spec_decode section")
    ap.add_argument("--no-quant", action="store_true", help="skip the quant section (int8 and int4 vs float)")
    ap.add_argument("--quant-kernel", default=None,
                    help="the kernel quantize() uses: auto (time the candidates per weight shape; the default "
                         "in full runs) or a name from enginelib.quant.KERNELS; --quick defaults to reference, "
                         "since timing the candidates takes about 10 s per format on a 2-core CPU")
    ap.add_argument("--json", type=Path, default=None, help="write every figure to this file")
    args = ap.parse_args(argv)
    if args.spec_k < 1:
        ap.error(f"--spec-k must be at least 1 (guesses per step), got {args.spec_k}")
    if args.quant_kernel is None:
        args.quant_kernel = "reference" if args.quick else "auto"
    from .quant import KERNELS

    if args.quant_kernel not in ("auto", *KERNELS):
        ap.error(f"unknown --quant-kernel {args.quant_kernel!r}; choose from auto, {', '.join(KERNELS)}")

    systems = tuple(args.systems.split(","))
    if args.endpoint and ENDPOINT not in systems:
        systems += (ENDPOINT,)
    for s in systems:
        if s not in SYSTEMS + (ENDPOINT,):
            ap.error(f"unknown system {s!r}; choose from {', '.join(SYSTEMS + (ENDPOINT,))}")
    if ENDPOINT in systems and not args.endpoint:
        ap.error("the endpoint system needs --endpoint URL (an OpenAI-compatible server's base URL)")
    if args.concurrency < 1:
        ap.error(f"--concurrency must be at least 1, got {args.concurrency}")
    served = (args.served_model or served_model_name(args.endpoint)) if args.endpoint else None
    threads = set_threads(args.threads)
    device = pick_device(args.device)
    config = EngineConfig(enable_prefix_caching=not args.no_prefix_caching,
                          scheduler=SchedulerConfig(args.max_num_seqs, 4096, not args.no_chunked_prefill))
    server = None
    if not args.no_serve:  # our server loads its model while we load ours; it idles until the serve section
        from .serve import ServerProcess

        server = ServerProcess(serve_args(args, device, threads, config, args.concurrency)).launch()
    try:
        model, tok = load_model(args.model, device=device, dtype=getattr(torch, args.dtype) if args.dtype else None,
                                progress=False, pack=False if args.no_pack else None)
        if server is not None:
            server.wait_ready()  # healthy before anything is timed: its loading must not slow our measurements
        return _measure(args, systems, served, threads, device, config, model, tok, server)
    finally:
        if server is not None:
            server.stop()  # also when our own load failed: a half-started server is terminated


def _measure(args: argparse.Namespace, systems: tuple[str, ...], served: str | None, threads: int,
             device: torch.device, config: EngineConfig, model: Transformer, tok: Tokenizer,
             server: ServerProcess | None) -> dict:
    """Every system on every workload, then the sections; the report as a dict (and a JSON file)."""
    workloads = WORKLOADS if args.workload == "all" else tuple(args.workload.split(","))
    few = args.naive_requests or (2 if args.quick else 4)
    hf = load_hf(device, model.dtype) if "hf_static" in systems else None
    warm = Workload("warm-up", [BenchRequest(_chat(tok, "hi"), 4)])
    run_engine(model, tok, warm, config)
    run_one_at_a_time("warm-up", generate_cached, model, tok, warm)

    report: dict = {"machine": {"torch": torch.__version__, "threads": threads, "device": str(device),
                                "dtype": str(model.dtype).removeprefix("torch."), "model": str(args.model),
                                "packed_linears": any(isinstance(m, PackedLinear) for m in model.modules()),
                                "quick": args.quick},
                    "workloads": {}}
    for name in workloads:
        wl = make_workload(name, tok, args.quick, args.rate)
        results: dict[str, SystemResult] = {}
        for system in systems:
            if system == "naive":
                results[system] = run_one_at_a_time("naive", generate_naive, model, tok, wl, few)
            elif system == "kv_cache":
                results[system] = run_one_at_a_time("kv_cache", generate_cached, model, tok, wl, 2 * few)
            elif system == "static":
                results[system] = run_static(model, tok, wl, args.batch_size)
            elif system == "hf_static" and hf is not None:
                results[system] = run_hf_static(hf, tok, wl, args.batch_size, device)
            elif system == "engine":
                results[system] = run_engine(model, tok, wl, config)
            elif system == ENDPOINT:
                results[system] = run_endpoint(args.endpoint, served, tok, wl, args.concurrency, args.text_prompts)
                if "engine" in results:
                    same = _same_texts(results[system], results["engine"])
                    results[system].note += f"; {same:.0%} of texts equal the engine's"
        _check_same_tokens(model, wl, results)
        report["workloads"][name] = {s: r.summary() for s, r in results.items()}
        if name == workloads[0]:
            report["systems"] = report["workloads"][name]
            first = results
        _print_table(name, results)

    report["ratios"] = _ratios(report["systems"])
    if hf is None and "hf_static" in systems:
        report["notes"] = ["transformers is not installed: hf_static skipped"]
    report |= _roofline(model, tok, hf, device, args.quick)
    if "engine" in systems:
        report["prefix_cache"] = prefix_cache_effect(model, tok, config, args.quick)
        report["chunked_prefill"] = chunked_prefill_effect(model, tok, config, args.quick, args.chunk_budget)
    if server is not None:
        wl0 = make_workload(workloads[0], tok, args.quick, args.rate)
        report["serve"] = serve_effect(server, model, tok, wl0, config, args.concurrency)
        if args.no_pack:
            report["serve"]["note"] += "; the server packs its linears (serve has no --no-pack)"
    report["ratios"]["single_stream_vs_hf"] = report.pop("_single_stream_vs_hf")
    if not args.no_spec_decode:
        start = time.perf_counter()
        report["spec_decode"] = spec_decode_effect(model, tok, args.quick, args.spec_k)
        report["spec_decode"]["seconds"] = time.perf_counter() - start
    if not args.no_quant:
        start = time.perf_counter()
        report["quant"] = quant_effect(model, tok, args.quick, args.quant_kernel)
        report["quant"]["seconds"] = time.perf_counter() - start
    engine_outputs = first["engine"].outputs if "engine" in first else None
    wl0 = make_workload(workloads[0], tok, args.quick, args.rate)
    if engine_outputs:
        report["kv_waste"] = kv_waste(wl0, config.block_size, args.max_len, engine_outputs)
        budget = concurrency(wl0, engine_outputs, config.block_size, args.max_len, budget_tokens=32 * args.max_len)
        report["concurrency"] = budget
        report["concurrency_ratio"] = budget["paged"] / budget["contiguous"]
    _print_summary(report)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
        print(f"wrote {args.json}")
    return report


def _check_same_tokens(model: Transformer, wl: Workload, results: dict[str, SystemResult]) -> None:
    """Every system must produce the same greedy tokens per request: note any that differ.

    Identical, or diverging only at a near-tie of the float32 reference
    (:func:`checks.check_greedy`): transformers' kernels, or float16, may round
    a close call the other way. A real difference is noted ("differs").
    """
    ref = results.get("kv_cache") or results.get("naive")
    if ref is None:
        return
    reference = None  # a float32 copy, made once, only if some system diverges
    for name, r in results.items():
        n = min(len(ref.outputs), len(r.outputs))
        if r is ref or r.outputs[:n] == ref.outputs[:n]:
            continue
        if reference is None:
            reference = float32_reference(model)
        prompts = [req.prompt_ids for req in wl.requests[:n]]
        try:
            verdict = check_greedy(model, prompts, r.outputs[:n], ref.outputs[:n], reference=reference)
            r.note += f"; {len(verdict.near_ties)} of {n} requests diverge from {ref.name} at a near-tie"
        except AssertionError as err:
            r.note += f"; differs from {ref.name}: {err}".split(". ")[0]


def _ratios(systems: dict) -> dict:
    def ratio(a: str, b: str) -> float | None:
        return systems[a]["tok_per_s"] / systems[b]["tok_per_s"] if a in systems and b in systems else None

    return {"engine_vs_naive": ratio("engine", "naive"), "engine_vs_kv_cache": ratio("engine", "kv_cache"),
            "engine_vs_static": ratio("engine", "static"), "engine_vs_hf_static": ratio("engine", "hf_static"),
            "endpoint_vs_engine": ratio(ENDPOINT, "engine")}


def _roofline(model: Transformer, tok: Tokenizer, hf, device: torch.device, quick: bool) -> dict:
    """Peak, bandwidth, decode MFU at batch 32, and single-stream decode against the bandwidth roof."""
    peak = matmul_peak(device, model.dtype)
    bandwidth = read_bandwidth(device)
    step, context = decode_step_time(model, tok, 32, 8 if quick else 32)
    mfu = 32 * decode_flops_per_token(model, context) / step / peak
    weight_bytes = model.num_parameters() * model.dtype.itemsize
    roof_tok_s = bandwidth / weight_bytes
    single, _ = decode_step_time(model, tok, 1, 16 if quick else 64)
    hf_single = _hf_single_stream(hf, tok, device, 16 if quick else 64) if hf is not None else None
    return {"machine_peak_flops": peak, "machine_read_bandwidth": bandwidth,
            "mfu_decode_b32": mfu, "decode_b32_step_s": step,
            "single_stream_tok_per_s": 1 / single, "single_stream_roofline_tok_per_s": roof_tok_s,
            "single_stream_roofline_frac": (1 / single) / roof_tok_s,
            "hf_single_stream_tok_per_s": hf_single,
            "_single_stream_vs_hf": (1 / single) / hf_single if hf_single else None}


@torch.inference_mode()
def _hf_single_stream(hf, tok: Tokenizer, device: torch.device, new_tokens: int) -> float:
    ids = torch.tensor([_chat(tok, QUESTIONS[0])], device=device)
    hf.generate(ids, max_new_tokens=2, do_sample=False)
    t = time.perf_counter()
    hf.generate(ids, max_new_tokens=new_tokens + 1, do_sample=False, eos_token_id=None)
    t1 = time.perf_counter()
    hf.generate(ids, max_new_tokens=1, do_sample=False)
    prefill = time.perf_counter() - t1
    return new_tokens / (t1 - t - prefill)


def _fmt(x: float | None, scale: float = 1.0, digits: int = 1) -> str:
    return "-" if x is None else f"{x * scale:.{digits}f}"


def _print_table(name: str, results: dict[str, SystemResult]) -> None:
    base = results.get("naive")
    print(f"\nworkload {name}")
    print(f"{'system':<10} {'tok/s':>8} {'x naive':>8} {'TTFT p50':>9} {'TTFT p99':>9} {'TPOT p50':>9} "
          f"{'TPOT p99':>9} {'e2e p50':>8}  note")
    for r in results.values():
        s = r.summary()
        print(f"{r.name:<10} {r.tok_per_s:>8.1f} {_fmt(r.tok_per_s / base.tok_per_s if base else None):>8} "
              f"{_fmt(s['ttft_p50_s'], 1e3, 0):>7}ms {_fmt(s['ttft_p99_s'], 1e3, 0):>7}ms "
              f"{_fmt(s['tpot_p50_s'], 1e3, 0):>7}ms {_fmt(s['tpot_p99_s'], 1e3, 0):>7}ms "
              f"{_fmt(s['e2e_p50_s'], 1, 2):>7}s  {r.note.strip('; ')}")


def _print_summary(report: dict) -> None:
    r = report["ratios"]
    print("\nratios: " + ", ".join(f"{k} {_fmt(v, 1, 2)}" for k, v in r.items()))
    print(f"machine: {report['machine_peak_flops'] / 1e9:.0f} GFLOP/s matmul peak, "
          f"{report['machine_read_bandwidth'] / 1e9:.1f} GB/s read bandwidth "
          f"({report['machine']['threads']} threads, {report['machine']['device']}, {report['machine']['dtype']})")
    print(f"decode MFU at batch 32: {report['mfu_decode_b32']:.1%}; single stream "
          f"{report['single_stream_tok_per_s']:.1f} tok/s = {report['single_stream_roofline_frac']:.0%} of the "
          f"bandwidth roofline ({report['single_stream_roofline_tok_per_s']:.1f} tok/s)")
    if "prefix_cache" in report:
        p, c = report["prefix_cache"], report["chunked_prefill"]
        print(f"prefix cache (shared-prefix): TTFT p50 {_fmt(p['ttft_p50_on_s'], 1e3, 0)} ms with, "
              f"{_fmt(p['ttft_p50_off_s'], 1e3, 0)} ms without (ratio {p['ttft_ratio']:.2f}); "
              f"hit rate {p['hit_rate']:.0%}")
        print(f"chunked prefill (long-prompt, budget {c['budget']}): decode p99 gap {_fmt(c['tpot_p99_on_s'], 1e3, 0)} ms "
              f"with, {_fmt(c['tpot_p99_off_s'], 1e3, 0)} ms without (ratio {c['tpot_p99_ratio']:.2f})")
    if "serve" in report:
        s = report["serve"]
        print(f"serve ({s['concurrency']} streams, {s['requests']} requests): server {s['server_tok_per_s']:.1f} tok/s "
              f"vs offline {s['offline_tok_per_s']:.1f} tok/s = {s['throughput_ratio']:.2f}x; TTFT p50 "
              f"{_fmt(s['ttft_p50'], 1e3, 0)} ms, p99 {_fmt(s['ttft_p99'], 1e3, 0)} ms; TPOT p50 "
              f"{_fmt(s['tpot_p50'], 1e3, 0)} ms, p99 {_fmt(s['tpot_p99'], 1e3, 0)} ms; "
              f"{_fmt(s['texts_equal'], 100, 0)}% of texts equal the offline engine's")
    if "spec_decode" in report:
        d = report["spec_decode"]
        e = d["extractive"]
        print(f"spec decode (ngram, k={d['k']}): {d['speedup_b1']:.2f}x at batch 1 on chats (acceptance "
              f"{d['acceptance']:.0%}, {d['mean_accepted_length']:.2f} kept per check), {d['speedup_b8']:.2f}x at "
              f"batch 8, {e['speedup_b1']:.2f}x copying a passage (acceptance {e['acceptance']:.0%}); "
              f"{d['texts_equal']:.0%} of texts equal plain greedy's")
    if "quant" in report:
        q = report["quant"]
        for fmt in ("int8", "int4"):
            r = q[fmt]
            print(f"{fmt}: {r['bytes_per_param']:.2f} bytes/param, {r['weight_bytes'] / 2**20:.0f} MiB, decode "
                  f"{r['tok_per_s_ratio']:.2f}x float, perplexity {r['ppl']:.2f} ({r['ppl_delta']:+.1%}), "
                  f"kernels {', '.join(sorted(set(r['kernels'].values())))}")
    if "kv_waste" in report:
        w, c = report["kv_waste"], report["concurrency"]
        print(f"KV waste: paged {w['paged']:.1%} vs reserve-{w['max_len']} {w['contiguous']:.1%}; "
              f"a {c['budget_tokens']}-token budget holds {c['paged']} requests paged vs {c['contiguous']} contiguous "
              f"({report['concurrency_ratio']:.1f}x)")


if __name__ == "__main__":
    main()
