"""The ``serve`` section: our HTTP server against the offline engine, same workload and config."""
from __future__ import annotations

import argparse
import dataclasses
from typing import TYPE_CHECKING

import torch

from enginelib.bench.endpoint import run_endpoint, served_model_name
from enginelib.bench.results import nearest_rank, same_texts
from enginelib.bench.systems import run_engine
from enginelib.bench.workloads import BenchRequest, Workload, chat_prompt
from enginelib.config import EngineConfig
from enginelib.model.tokenizer import Tokenizer
from enginelib.model.transformer import Transformer

if TYPE_CHECKING:
    from enginelib.serve import ServerProcess  # imported when used: the server stack is not needed offline


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
    server (a started :class:`~enginelib.serve.app.ServerProcess`, flags from
    :func:`serve_args`) runs in a child process, so on a small CPU the client
    competes with it for cores; that is part of what is measured.
    """
    from enginelib.serve.loadgen import run_load_sync  # imported when used: it pulls in the openai client

    flat = Workload(wl.name, [dataclasses.replace(r, arrival_step=0) for r in wl.requests], wl.ignore_eos)
    sched = dataclasses.replace(config.scheduler, max_num_seqs=concurrency)
    same = dataclasses.replace(config, scheduler=sched)
    warm = Workload("warm-up", [BenchRequest(chat_prompt(tok, "hi"), 4)])
    run_engine(model, tok, warm, same)  # one-off costs out of the measurement, as the server's warm-up below
    offline = run_engine(model, tok, flat, same)
    name = served_model_name(server.url)
    run_load_sync(server.url, name, [warm.requests[0].prompt_ids], 4, concurrency=1)
    served = run_endpoint(server.url, name, tok, flat, concurrency, name="server")
    return {"throughput_ratio": served.tok_per_s / offline.tok_per_s, "server_tok_per_s": served.tok_per_s,
            "offline_tok_per_s": offline.tok_per_s, "concurrency": concurrency, "requests": len(flat.requests),
            "ttft_p50": nearest_rank(served.ttft, 50), "ttft_p99": nearest_rank(served.ttft, 99),
            "tpot_p50": nearest_rank(served.tpot, 50), "tpot_p99": nearest_rank(served.tpot, 99),
            "offline_ttft_p50": nearest_rank(offline.ttft, 50), "offline_tpot_p50": nearest_rank(offline.tpot, 50),
            "texts_equal": same_texts(served, offline), "note": served.note}
