"""The book's own systems on a workload: one request at a time, static batches, and the engine."""
from __future__ import annotations

import time
from collections.abc import Callable

from tqdm import tqdm  # disable=None: bars on a terminal only, none in logs or notebooks

from enginelib.baselines.generate import generate_static
from enginelib.bench.results import SystemResult, add_latencies, sync_device
from enginelib.bench.workloads import Workload
from enginelib.config import EngineConfig, SamplingParams
from enginelib.core.engine import Engine
from enginelib.core.outputs import RequestOutput
from enginelib.model.tokenizer import Tokenizer
from enginelib.model.transformer import Transformer

SYSTEMS = ("naive", "kv_cache", "static", "hf_static", "engine")


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
        sync_device(model)
        result.output_tokens += len(gen.token_ids)
        result.outputs.append(gen.token_ids)
        add_latencies(result, arrival, [began + t for t in gen.token_times])
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
        sync_device(model)
        for r, gen in zip(group, run.generations):
            mine = gen.token_ids[:r.max_tokens]  # tokens past a request's own limit are waste, not output
            result.output_tokens += len(mine)
            result.outputs.append(mine)
            add_latencies(result, start + r.arrival_s, [began + t for t in gen.token_times[:len(mine)]])
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
    sync_device(model)
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
        add_latencies(result, arrival, out.metrics.token_times)
        result.timings.append((arrival, out.metrics.token_times))
    return result
