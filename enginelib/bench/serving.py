"""The ``serve`` section: our HTTP server against the offline engine, same workload and config."""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import os
import statistics
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from enginelib.bench.endpoint import run_endpoint, served_model_name
from enginelib.bench.results import nearest_rank, same_texts
from enginelib.bench.systems import run_engine
from enginelib.bench.workloads import BenchRequest, Workload, chat_prompt
from enginelib.config import EngineConfig, SamplingParams
from enginelib.core.engine import Engine
from enginelib.model.tokenizer import Tokenizer
from enginelib.model.transformer import Transformer

ALONE, ALONE_ROUNDS = 8, 3  # requests sent one at a time for the server's TTFT overhead, and rounds of them
FLOOD_ROUNDS = 3  # streams beside refused prompts, each after a quiet one

if TYPE_CHECKING:
    from enginelib.serve import ServerProcess  # imported when used: the server stack is not needed offline


def _ttfts_one_at_a_time(engine: Engine, requests: list[tuple[list[int], SamplingParams]]) -> list[float]:
    """Each request alone in one warm engine, which has seen each once before (a fresh engine would time its
    first touch of the KV pool; the server has served these prompts already, so its prefix cache holds them)."""
    ttfts = []
    for ids, params in [*requests, *requests]:
        engine.add_request(ids, params)
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    ttfts.append(out.metrics.time_to_first_token)
    return ttfts[len(requests):]


def split_cpus(threads: int) -> tuple[set[int], set[int]] | None:
    """The serve section's CPUs: up to ``threads`` for the engine (the server's core and the offline engine alike),
    at least one for the rest (the client, the API process), so that neither measures the other's share of the
    cores. None where CPUs cannot be pinned (not Linux, or one CPU): then everything shares them."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if len(cpus) < 2:
        return None
    engine = min(threads, len(cpus) - 1)
    return set(cpus[:engine]), set(cpus[engine:])


def pin_process(pid: int, cpus: set[int]) -> None:
    """Every thread of process ``pid`` (torch's pool too) onto ``cpus``; threads it starts later inherit it."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(ProcessLookupError):  # a thread that ended since the listing has nothing to pin
            os.sched_setaffinity(int(tid), cpus)


def cpu_times() -> dict[int, tuple[int, int]] | None:
    """Each CPU's (stolen, total) clock ticks so far, from /proc/stat (Linux; None elsewhere). Stolen time is
    time the hypervisor gave another guest: on a shared VM it slows one CPU and not the other."""
    try:
        with open("/proc/stat") as f:
            rows = [line.split() for line in f if line.startswith("cpu") and line[3].isdigit()]
    except OSError:
        return None
    return {int(r[0][3:]): (int(r[8]) if len(r) > 8 else 0, sum(int(x) for x in r[1:9])) for r in rows}


def steal_share(before: dict | None, after: dict | None, cpus: set[int] | None) -> float | None:
    """The share of ``cpus``' time stolen between two :func:`cpu_times`."""
    if before is None or after is None or not cpus:
        return None
    stolen = sum(after[c][0] - before[c][0] for c in cpus)
    total = sum(after[c][1] - before[c][1] for c in cpus)
    return stolen / total if total else 0.0


@contextlib.contextmanager
def _on_cpus(cpus: set[int] | None, threads: int | None = None) -> Iterator[None]:
    """This process on ``cpus`` with ``threads`` torch threads, put back as they were on exit (no-op for None)."""
    if cpus is None:
        yield
        return
    before, before_threads = os.sched_getaffinity(0), torch.get_num_threads()
    pin_process(os.getpid(), cpus)
    torch.set_num_threads(threads or before_threads)
    try:
        yield
    finally:
        pin_process(os.getpid(), before)
        torch.set_num_threads(before_threads)


def serve_args(args: argparse.Namespace, device: torch.device, threads: int, config: EngineConfig,
               concurrency: int, engine_cpus: set[int] | None = None) -> list[str]:
    """``python -m enginelib.serve`` flags for the engine config the offline runs use, ``concurrency`` seats, the
    engine core on ``engine_cpus`` (one thread each) if given."""
    sched = config.scheduler
    if engine_cpus is not None:
        threads = len(engine_cpus)
    flags = ["--model", str(args.model), "--threads", str(threads), "--device", str(device),
             "--block-size", str(config.block_size), "--max-num-seqs", str(concurrency),
             "--max-num-batched-tokens", str(sched.max_num_batched_tokens), "--max-waiting", str(concurrency)]
    flags += ["--dtype", args.dtype] if args.dtype else []
    flags += ["--engine-cpus", ",".join(map(str, sorted(engine_cpus)))] if engine_cpus is not None else []
    flags += ["--num-blocks", str(config.num_blocks)] if config.num_blocks is not None else []
    flags += [] if config.enable_prefix_caching else ["--no-prefix-caching"]
    return flags + ([] if sched.enable_chunked_prefill else ["--no-chunked-prefill"])


def serve_effect(server: ServerProcess, model: Transformer, tok: Tokenizer, wl: Workload, config: EngineConfig,
                 concurrency: int, cpus: tuple[set[int], set[int]] | None = None) -> dict:
    """Our server against the offline engine on the same workload, same engine config: the cost of HTTP and SSE.

    Both get ``max_num_seqs = concurrency`` (the client keeps that many streams
    open; the offline engine runs that many at once) and the workload's
    requests all at the start (as ``run_endpoint`` sends them). With ``cpus``
    (:func:`split_cpus`; the server started with ``serve_args(...,
    engine_cpus=cpus[0])``) the server's engine core and the offline engine run
    on the same CPUs with the same threads, and the client and the API process
    on the others, as a deployment gives the engine its cores: what is measured
    is what serving costs the engine, not the client's share of a small CPU.
    Without, everything shares the cores.

    ``ttft_overhead_ms`` is what the server adds to one request's time to first
    token (HTTP, JSON, the prompt's checks, the hop to the engine core and back,
    SSE): the median over :data:`ALONE` short requests sent one at a time, minus
    the same requests' median alone in the offline engine, in
    :data:`ALONE_ROUNDS` interleaved rounds. They are timed with a plain HTTP
    client, as vLLM's benchmark times servers, since an SDK's own parsing of
    every chunk is the client's cost, not the server's (the ``openai`` client
    adds about 3 ms a request on a 2-core CPU). Under load, TTFT also
    holds the queueing that the arrivals' spread causes (the offline engine has
    every request before its first step), so it cannot say what serving costs.
    """
    from enginelib.bench.loadgen import run_load_sync  # imported when used: it pulls in the openai client

    engine_cpus, client_cpus = cpus or (None, None)
    times = cpu_times()
    if client_cpus is not None:
        pin_process(server.process.pid, client_cpus)  # the API process; its engine core pinned itself
    flat = Workload(wl.name, [dataclasses.replace(r, arrival_step=0) for r in wl.requests], wl.ignore_eos)
    sched = dataclasses.replace(config.scheduler, max_num_seqs=concurrency)
    same = dataclasses.replace(config, scheduler=sched)
    warm = Workload("warm-up", [BenchRequest(chat_prompt(tok, "hi"), 4)])
    alone = [dataclasses.replace(r, max_tokens=2) for r in flat.requests[:ALONE]]
    on_engine_cpus = functools.partial(_on_cpus, engine_cpus, len(engine_cpus or ()))
    with on_engine_cpus():
        run_engine(model, tok, warm, same)  # one-off costs out of the measurement, as the server's warm-up below
        offline = run_engine(model, tok, flat, same)
        alone_engine = Engine(model, tok, same)
    name = served_model_name(server.url)
    with _on_cpus(client_cpus):
        run_load_sync(server.url, name, [warm.requests[0].prompt_ids], 4, concurrency=1)
        served = run_endpoint(server.url, name, tok, flat, concurrency, name="server")
    offline_alone, served_alone = [], []
    for _ in range(ALONE_ROUNDS):  # interleaved: a few ms is the size of one run's drift
        with on_engine_cpus():
            offline_alone += _ttfts_one_at_a_time(alone_engine, [(r.prompt_ids, flat.params(r)) for r in alone])
        with _on_cpus(client_cpus):
            served_alone += [_ttft_plain(server.url, name, r.prompt_ids) for r in alone]
    overhead = statistics.median(served_alone) - statistics.median(offline_alone)
    now = cpu_times()
    return {"throughput_ratio": served.tok_per_s / offline.tok_per_s, "server_tok_per_s": served.tok_per_s,
            "offline_tok_per_s": offline.tok_per_s, "concurrency": concurrency, "requests": len(flat.requests),
            "engine_cpus": sorted(engine_cpus) if engine_cpus else None,
            "client_cpus": sorted(client_cpus) if client_cpus else None,
            "ttft_p50": nearest_rank(served.ttft, 50), "ttft_p99": nearest_rank(served.ttft, 99),
            "tpot_p50": nearest_rank(served.tpot, 50), "tpot_p99": nearest_rank(served.tpot, 99),
            "offline_ttft_p50": nearest_rank(offline.ttft, 50), "offline_tpot_p50": nearest_rank(offline.tpot, 50),
            "ttft_overhead_ms": 1000 * overhead, "ttft_alone_p50": statistics.median(served_alone),
            "offline_ttft_alone_p50": statistics.median(offline_alone),
            "steal": {"engine_cpus": steal_share(times, now, engine_cpus),
                      "client_cpus": steal_share(times, now, client_cpus)},
            "texts_equal": same_texts(served, offline), "note": served.note}


def refused_flood_effect(server: ServerProcess, cpus: tuple[set[int], set[int]] | None, tokens: int = 48,
                         rounds: int = FLOOD_ROUNDS) -> dict | None:
    """One live stream's speed while two clients keep sending prompts the server refuses (past the context), as
    a ratio to its speed without them: what refusals cost the engine.

    The server is :func:`serve_effect`'s, its engine core on ``cpus[0]``, everything else (the API process, the
    clients, this one) on ``cpus[1]``, so the ratio shows the engine's own work, not the sharing of cores on a
    small machine. One client's prompts are long enough to refuse by their length alone, the other's must be
    tokenized first. Quiet and flooded streams take turns, ``rounds`` of each after a quiet one (medians), so a
    drift of the machine's speed falls on both. None without ``cpus`` (not Linux, or one CPU).
    """
    if cpus is None:
        return None
    pin_process(server.process.pid, cpus[1])
    with _on_cpus(cpus[1]):  # this thread, and the flooding threads it starts
        name = served_model_name(server.url)
        _stream_tok_per_s(server.url, name, 8)  # warm-up
        quiet, flooded, refused, seconds = [_stream_tok_per_s(server.url, name, tokens)], [], [0], 0.0
        for _ in range(rounds):
            stop = threading.Event()

            def flood(prompt: str) -> None:
                while not stop.is_set():
                    refused[0] += _post(server.url, {"model": name, "prompt": prompt, "max_tokens": 4}) == 400
            floods = [threading.Thread(target=flood, args=("word " * n,), daemon=True) for n in (150_000, 40_000)]
            for thread in floods:
                thread.start()
            start = time.perf_counter()
            flooded.append(_stream_tok_per_s(server.url, name, tokens))
            seconds += time.perf_counter() - start
            stop.set()
            for thread in floods:
                thread.join()
            quiet.append(_stream_tok_per_s(server.url, name, tokens))
    return {"ratio": statistics.median(flooded) / statistics.median(quiet), "quiet_tok_per_s": quiet,
            "flooded_tok_per_s": flooded, "refused_per_s": refused[0] / seconds, "engine_cpus": sorted(cpus[0])}


def _ttft_plain(url: str, name: str, prompt_ids: list[int]) -> float:
    """One short greedy stream: seconds from sending it to its first chunk, read with ``urllib``."""
    body = {"model": name, "prompt": prompt_ids, "max_tokens": 2, "stream": True, "temperature": 0,
            "ignore_eos": True}
    start = time.perf_counter()
    with urllib.request.urlopen(_completion(url, body), timeout=300) as answer:
        first = next(time.perf_counter() for line in answer if line.startswith(b"data: {"))
        answer.read()
    return first - start


def _completion(url: str, body: dict) -> urllib.request.Request:
    return urllib.request.Request(url + "/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})


def _post(url: str, body: dict) -> int:
    """POST a completion, read the answer; its HTTP status."""
    try:
        with urllib.request.urlopen(_completion(url, body), timeout=120) as answer:
            answer.read()
            return answer.status
    except urllib.error.HTTPError as error:
        error.read()
        return error.code


def _stream_tok_per_s(url: str, name: str, tokens: int) -> float:
    """One greedy stream of ``tokens`` tokens: chunks per second after the first (one token per chunk)."""
    body = {"model": name, "prompt": "Count to a thousand:", "max_tokens": tokens, "stream": True,
            "temperature": 0, "ignore_eos": True}
    with urllib.request.urlopen(_completion(url, body), timeout=300) as answer:
        times = [time.perf_counter() for line in answer if line.startswith(b"data: {")]
    return (len(times) - 1) / (times[-1] - times[0])
