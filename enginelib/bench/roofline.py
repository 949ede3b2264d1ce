"""The machine's limits (matmul peak, read bandwidth) and the engine's decode placed against them."""
from __future__ import annotations

import statistics
import time

import torch

from enginelib.bench.hf import hf_single_stream
from enginelib.bench.quality import weight_bytes
from enginelib.bench.workloads import QUESTIONS, chat_prompt
from enginelib.config import EngineConfig, SamplingParams, SchedulerConfig
from enginelib.core.engine import Engine
from enginelib.model.tokenizer import Tokenizer
from enginelib.model.transformer import Transformer


def best_time(work, device: torch.device, repeats: int, min_seconds: float) -> float:
    """Fastest of at least ``repeats`` timed calls (after one warm-up) spread over ``min_seconds``:
    a roof is the best the machine does, and a short burst of other work must not set it."""
    work()
    if device.type == "cuda":
        torch.cuda.synchronize()
    times, start = [], time.perf_counter()
    while len(times) < repeats or time.perf_counter() - start < min_seconds:
        t = time.perf_counter()
        work()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return min(times)


def matmul_peak(device: torch.device, dtype: torch.dtype, n: int = 2048, repeats: int = 5,
                min_seconds: float = 1.5) -> float:
    """Best FLOP/s of a square matmul: the compute roof."""
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    return 2 * n ** 3 / best_time(lambda: a @ b, device, repeats, min_seconds)


def read_bandwidth(device: torch.device, megabytes: int = 512, repeats: int = 10, min_seconds: float = 1.0) -> float:
    """Best bytes/s of summing a large float32 tensor: the memory roof for decode."""
    x = torch.ones(megabytes * 2**20 // 4, device=device)
    return x.nbytes / best_time(x.sum, device, repeats, min_seconds)


def decode_flops_per_token(model: Transformer, context: int) -> float:
    """Matmul FLOPs to decode one token at ``context``: weights (LM head once) plus attention."""
    cfg = model.cfg
    per_layer = cfg.hidden_size * (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim \
        + cfg.num_heads * cfg.head_dim * cfg.hidden_size + 3 * cfg.hidden_size * cfg.intermediate_size
    weights = cfg.num_layers * per_layer + cfg.hidden_size * cfg.vocab_size
    attention = cfg.num_layers * 2 * cfg.num_heads * cfg.head_dim * context
    return 2 * weights + 2 * attention


def decode_read_bytes(model: Transformer) -> int:
    """Weight bytes one decode step reads: all the model holds (:func:`quality.weight_bytes`, quantized layers
    as stored) but the embedding table, of which a token reads one row, unless the table is also the LM head
    (tied and not quantized), which reads it whole. Bandwidth over this is the single stream's roof."""
    embed = model.embed_tokens.weight
    head = getattr(model.lm_head, "weight", None)
    return weight_bytes(model) - (0 if head is embed else embed.numel() * embed.element_size())


def decode_step_time(model: Transformer, tok: Tokenizer, batch: int, new_tokens: int,
                     decode_kernel: bool = False) -> tuple[float, int]:
    """Median time of pure decode steps with ``batch`` running requests, and their mean context
    (``decode_kernel``: EngineConfig's ``cpu_decode_kernel``)."""
    engine = Engine(model, tok, EngineConfig(scheduler=SchedulerConfig(batch, max(2048, batch * 64)),
                                             cpu_decode_kernel=decode_kernel))
    return engine_decode_step_time(engine, tok, batch, new_tokens)


def engine_decode_step_time(engine: Engine, tok: Tokenizer, batch: int, new_tokens: int) -> tuple[float, int]:
    """:func:`decode_step_time` on an engine already built, e.g. one compiled once.

    Each step is timed around ``engine.step()`` itself, as users run it (no step snapshots, ``record``):
    a step counts when all ``batch`` requests run, none waits and each has its first token (pure decode).
    The context is the mean number of cached tokens per request before those steps."""
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    for i in range(batch):
        engine.add_request(chat_prompt(tok, QUESTIONS[i % len(QUESTIONS)]), params)
    times, contexts = [], []
    scheduler = engine.scheduler
    while engine.has_unfinished_requests():
        running = list(scheduler.running)
        decode = not scheduler.waiting and len(running) == batch and all(r.output_token_ids for r in running)
        start = time.perf_counter()
        engine.step()
        if decode:
            times.append(time.perf_counter() - start)
            contexts.append(sum(r.num_computed_tokens for r in running) / batch)
    if not times:
        raise ValueError(f"no step decoded all {batch} requests at once: give each more than 1 new token, and "
                         f"the engine room for {batch} running requests")
    return statistics.median(times), int(statistics.mean(contexts))


def roofline_figures(model: Transformer, tok: Tokenizer, hf, device: torch.device, quick: bool) -> dict:
    """Peak, bandwidth, decode MFU at batch 32, and single-stream decode against the bandwidth roof."""
    peak = matmul_peak(device, model.dtype)
    bandwidth = read_bandwidth(device)
    step, context = decode_step_time(model, tok, 32, 8 if quick else 32)
    mfu = 32 * decode_flops_per_token(model, context) / step / peak
    roof_tok_s = bandwidth / decode_read_bytes(model)
    single, _ = decode_step_time(model, tok, 1, 16 if quick else 64)
    hf_single = hf_single_stream(hf, tok, device, 16 if quick else 64) if hf is not None else None
    return {"machine_peak_flops": peak, "machine_read_bandwidth": bandwidth,
            "mfu_decode_b32": mfu, "decode_b32_step_s": step,
            "single_stream_tok_per_s": 1 / single, "single_stream_roofline_tok_per_s": roof_tok_s,
            "single_stream_roofline_frac": (1 / single) / roof_tok_s,
            "hf_single_stream_tok_per_s": hf_single,
            "single_stream_vs_hf": (1 / single) / hf_single if hf_single else None}
