"""Sections on the engine's scheduling features: the prefix cache, chunked prefill, load against latency."""
from __future__ import annotations

import dataclasses

from enginelib.bench.results import SystemResult, add_latencies, check_same_tokens, nearest_rank
from enginelib.bench.systems import run_engine
from enginelib.bench.workloads import Workload, make_workload
from enginelib.config import EngineConfig
from enginelib.model.tokenizer import Tokenizer
from enginelib.model.transformer import Transformer


def prefix_cache_effect(model: Transformer, tok: Tokenizer, config: EngineConfig, quick: bool) -> dict:
    """The ``shared-prefix`` workload with the prefix cache on and off, same process: TTFT and hit rate."""
    wl = make_workload("shared-prefix", tok, quick)
    on = run_engine(model, tok, wl, dataclasses.replace(config, enable_prefix_caching=True))
    off = run_engine(model, tok, wl, dataclasses.replace(config, enable_prefix_caching=False))
    check_same_tokens(model, wl, {"kv_cache": off, "engine": on})  # off is the reference here
    return {"ttft_p50_on_s": nearest_rank(on.ttft, 50), "ttft_p50_off_s": nearest_rank(off.ttft, 50),
            "ttft_ratio": nearest_rank(on.ttft, 50) / nearest_rank(off.ttft, 50), "hit_rate": on.prefix_hit_rate,
            "tok_per_s_on": on.tok_per_s, "tok_per_s_off": off.tok_per_s, "note": on.note.strip("; ")}


GPU_LONG_PROMPT = 8000  # tokens in each long prompt of the chunked-prefill comparison on a GPU (SmolLM2: 8192 context)


def long_prompt_tokens(model: Transformer) -> int | None:
    """The long prompts' length in the chunked-prefill comparison: None (the workload's own, 700 quick and
    1,500 full) on a CPU; on a GPU, :data:`GPU_LONG_PROMPT` tokens, or less to fit the model's context.

    A GPU prefills 700 tokens in about the time of a decode step (it is far from busy at either size),
    so prefilling one in a single step stalls nobody and chunking it shows no gain; several thousand
    tokens take many decode steps' time there, as 700 do on a CPU.
    """
    if model.device.type != "cuda":
        return None
    return min(GPU_LONG_PROMPT, model.cfg.context_length - 64)  # the 4 answer tokens fit, with room to spare


def chunked_prefill_effect(model: Transformer, tok: Tokenizer, config: EngineConfig, quick: bool,
                           budget: int) -> dict:
    """The ``long-prompt`` workload with and without chunked prefill: decode latency of the running requests.

    Without chunking a long prompt is prefilled in one step and every running
    request waits for it; with a token budget of ``budget`` it is split. The
    tail of the gaps between tokens (p99 inter-token latency, ITL: the stall a
    streaming reader feels) is compared on the short requests only. On a GPU
    the long prompts are scaled up to the device (:func:`long_prompt_tokens`).
    """
    wl = make_workload("long-prompt", tok, quick, long_tokens=long_prompt_tokens(model))
    short = Workload(wl.name, [r for r in wl.requests if r.arrival_step == 0], wl.ignore_eos)
    longest = max(len(r.prompt_ids) for r in wl.requests if r.arrival_step)
    whole = max(4096, max(len(r.prompt_ids) + r.max_tokens for r in wl.requests))  # unchunked: any prompt in one step
    runs = {}
    for chunked in (True, False):
        sched = dataclasses.replace(config.scheduler, enable_chunked_prefill=chunked,
                                    max_num_batched_tokens=budget if chunked else whole)
        runs[chunked] = run_engine(model, tok, wl, dataclasses.replace(config, scheduler=sched))
    decode_itl = {}
    for chunked, r in runs.items():
        gaps = SystemResult("short", 0, 0, 1.0)
        for req, (arrival, times) in zip(wl.requests, r.timings):
            if req.arrival_step == 0:
                add_latencies(gaps, arrival, times)
        decode_itl[chunked] = nearest_rank(gaps.itl, 99)
    check_same_tokens(model, wl, {"kv_cache": runs[False], "engine": runs[True]})
    long_ttft = {on: nearest_rank([t for q, t in zip(wl.requests, runs[on].ttft) if q.arrival_step], 50)
                 for on in (True, False)}
    return {"budget": budget, "short_requests": len(short.requests), "long_prompt_tokens": longest,
            "itl_p99_on_s": decode_itl[True], "itl_p99_off_s": decode_itl[False],
            "itl_p99_ratio": decode_itl[True] / decode_itl[False],
            "ttft_p50_long_on_s": long_ttft[True], "ttft_p50_long_off_s": long_ttft[False],
            "note": runs[True].note.strip("; ")}


def latency_curve(model: Transformer, tok: Tokenizer, rates: list[float], config: EngineConfig,
                  quick: bool = True, slo: tuple[float, float] | None = None) -> list[dict]:
    """The engine on the ``poisson`` workload at each arrival rate: throughput against latency, and the
    goodput (requests/s within ``slo`` = (TTFT, TPOT) seconds) where one is given."""
    rows = []
    for rate in rates:
        result = run_engine(model, tok, make_workload("poisson", tok, quick, rate), config)
        rows.append({"rate": rate, **result.summary(), **({"goodput": result.goodput(*slo)} if slo else {})})
    return rows
