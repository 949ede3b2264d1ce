"""The load generator, against a real server process: its timings, its bound, its errors, its texts.

One server runs for the module on a free loopback port (one thread); the offline
``LLM`` on the same model is the oracle for greedy texts. Every run is a few
short requests, so the module stays within a minute on a small CPU.
"""
from __future__ import annotations

import asyncio
import re
import urllib.request

import pytest

from enginelib import LLM, SamplingParams, bench
from enginelib.serve import ServerProcess
from enginelib.bench.loadgen import LoadResult, StreamTiming, percentile, run_load, run_load_sync

MODEL = "smollm2-135m"
PROMPTS = ["The capital of France is", "Once upon a time, a dragon", "Three colors are", "Bees make honey by"]


@pytest.fixture(scope="module")
def server():
    with ServerProcess(["--threads", "1"], timeout=240) as s:
        yield s


@pytest.fixture(scope="module")
def offline(real):
    return LLM.from_model(*real)


def scrape(server: ServerProcess, name: str) -> float:
    with urllib.request.urlopen(server.url.removesuffix("/v1") + "/metrics", timeout=30) as r:
        text = r.read().decode()
    found = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    assert found, f"{name} not in /metrics"
    return float(found.group(1))


def test_percentiles_and_tpot_are_over_measured_values():
    assert percentile([], 50) is None
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0 and percentile([3.0, 1.0, 2.0], 99) == 3.0
    # Two chunks for 5 tokens (a chunk held text back): TPOT divides by the 4 gaps the server counted.
    t = StreamTiming(sent=10.0, token_times=[10.5, 11.3], text="ab", finish_reason="length",
                     num_prompt_tokens=3, num_output_tokens=5)
    assert t.ttft == pytest.approx(0.5) and t.e2e == pytest.approx(1.3)
    assert t.tpot == pytest.approx(0.2) and t.itl == [pytest.approx(0.8)]
    failed = StreamTiming(10.0, [], "", None, 0, 0, error="BadRequestError: too long")
    result = LoadResult([t, failed], duration=2.0, concurrency=2)
    assert result.errors == ["BadRequestError: too long"] and result.output_tokens == 5
    assert result.throughput == pytest.approx(2.5) and result.requests_per_s == pytest.approx(0.5)
    assert result.summary()["ttft_p50_s"] == pytest.approx(0.5)


def test_bad_arguments_say_what_to_change():
    with pytest.raises(ValueError, match="concurrency"):
        run_load_sync("http://127.0.0.1:9/v1", MODEL, ["a"], 4, concurrency=0)
    with pytest.raises(ValueError, match="one per prompt"):
        run_load_sync("http://127.0.0.1:9/v1", MODEL, ["a", "b"], [4], concurrency=1)
    with pytest.raises(ValueError, match="one per prompt"):
        run_load_sync("http://127.0.0.1:9/v1", MODEL, ["a"], 4, concurrency=1, arrivals=[0.0, 1.0])


def test_timings_are_consistent_and_counts_match_usage(server, real):
    _, tok = real
    result = run_load_sync(server.url, MODEL, PROMPTS, 8, concurrency=4, ignore_eos=True)
    assert result.errors == [] and len(result.timings) == len(PROMPTS)
    for prompt, t in zip(PROMPTS, result.timings):
        assert t.due <= t.sent < t.token_times[0]
        assert t.token_times == sorted(t.token_times)
        assert t.finish_reason == "length" and t.num_output_tokens == 8  # ignore_eos: runs to max_tokens
        assert t.num_prompt_tokens == len(tok.encode(prompt))
        assert 1 <= len(t.token_times) <= t.num_output_tokens  # a chunk carries one token or more
        assert t.text and len(t.itl) == len(t.token_times) - 1
        assert t.e2e <= result.duration
    assert result.output_tokens == 8 * len(PROMPTS)
    assert result.throughput == pytest.approx(result.output_tokens / result.duration)
    assert 0 < result.p50("ttft") <= result.p99("ttft") < result.duration


def test_the_concurrency_bound_holds_at_the_server(server):
    """The engine never holds more than ``concurrency`` of our requests, and does reach that many."""
    concurrency, seen = 2, []

    async def main() -> LoadResult:
        load = asyncio.create_task(run_load(server.url, MODEL, PROMPTS + PROMPTS[:2], 8, concurrency=concurrency,
                                            ignore_eos=True))
        while not load.done():
            running, waiting = await asyncio.gather(
                asyncio.to_thread(scrape, server, "enginelib_num_requests_running"),
                asyncio.to_thread(scrape, server, "enginelib_num_requests_waiting"))
            seen.append(running + waiting)
            await asyncio.sleep(0.02)
        return await load

    result = asyncio.run(main())
    assert result.errors == [] and result.concurrency == concurrency
    assert max(seen) == concurrency, seen


def test_an_error_response_is_recorded_not_raised(server):
    too_long = "word " * 9000  # past the model's 8192-token context
    result = run_load_sync(server.url, MODEL, [PROMPTS[0], too_long], 4, concurrency=2)
    good, bad = result.timings
    assert good.ok and good.num_output_tokens > 0
    assert not bad.ok and "400" in bad.error and "context" in bad.error and bad.token_times == []
    assert result.errors == [bad.error] and result.output_tokens == good.num_output_tokens


def test_greedy_texts_equal_the_offline_llm(server, offline):
    params = SamplingParams(temperature=0, max_tokens=12)
    completions = run_load_sync(server.url, MODEL, PROMPTS, 12, concurrency=4)
    assert [t.text for t in completions.timings] == [o.outputs[0].text for o in offline.generate(PROMPTS, params)]
    chats = run_load_sync(server.url, MODEL, PROMPTS[:2], 12, concurrency=2, chat=True)
    expected = offline.chat([[{"role": "user", "content": p}] for p in PROMPTS[:2]], params)
    assert [t.text for t in chats.timings] == [o.outputs[0].text for o in expected]


def test_the_bench_drives_an_endpoint_with_token_id_prompts(server, real):
    model, tok = real
    assert bench.served_model_name(server.url) == MODEL
    wl = bench.Workload("tiny", [bench.BenchRequest(bench.chat_prompt(tok, q), 6) for q in bench.QUESTIONS[:3]])
    result = bench.run_endpoint(server.url, MODEL, tok, wl, concurrency=3)
    assert result.output_tokens == 18 and len(result.ttft) == len(result.tpot) == 3
    engine = bench.run_engine(model, tok, wl, bench.EngineConfig())
    assert result.texts == engine.texts, "ids sent as ids: the server computes what the engine does"
