"""The benchmark runs end to end and writes the JSON schema other tools read."""
from __future__ import annotations

import json

import pytest

from enginelib import Engine, EngineConfig, SamplingParams, SchedulerConfig, bench

SCHEMA = [
    "systems.engine.tok_per_s", "systems.engine.ttft_p50_s", "systems.engine.tpot_p50_s",
    "systems.kv_cache.tok_per_s", "ratios.engine_vs_naive", "ratios.engine_vs_static",
    "ratios.engine_vs_hf_static", "ratios.single_stream_vs_hf", "single_stream_roofline_frac",
    "mfu_decode_b32", "kv_waste.paged", "kv_waste.contiguous", "concurrency_ratio",
    "machine.torch", "machine.threads", "machine.device", "machine.dtype",
    "prefix_cache.ttft_ratio", "prefix_cache.hit_rate", "chunked_prefill.tpot_p99_ratio",
    "serve.throughput_ratio", "serve.server_tok_per_s", "serve.offline_tok_per_s", "serve.concurrency",
    "serve.ttft_p50", "serve.ttft_p99", "serve.tpot_p50", "serve.tpot_p99",
]


def lookup(report: dict, dotted: str):
    for key in dotted.split("."):
        report = report[key]
    return report


def test_quick_bench_writes_every_figure_of_the_schema(tmp_path, real):
    out = tmp_path / "bench.json"
    report = bench.main(["--quick", "--systems", "kv_cache,static,engine", "--naive-requests", "1",
                         "--json", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    for key in SCHEMA:
        lookup(report, key)  # present (None where a system was not run)
    assert report["systems"]["engine"]["tok_per_s"] > 0
    assert report["ratios"]["engine_vs_naive"] is None  # naive was not asked for
    assert 0 < report["kv_waste"]["paged"] < report["kv_waste"]["contiguous"] < 1
    assert report["concurrency_ratio"] > 1
    assert "differs" not in report["systems"]["engine"]["note"], "the engine must match the kv_cache oracle"
    assert report["prefix_cache"]["hit_rate"] > 0.5  # 12 requests behind one long system prompt
    assert 0 < report["prefix_cache"]["ttft_ratio"] and 0 < report["chunked_prefill"]["tpot_p99_ratio"]
    for section in ("prefix_cache", "chunked_prefill"):  # on and off must give the same tokens
        assert "differs" not in report[section]["note"], report[section]["note"]
    serve = report["serve"]  # our server on the same workload, 32 streams at most (all 16 quick requests at once)
    assert serve["concurrency"] == 32 and serve["requests"] == 16 and "failed" not in serve["note"], serve["note"]
    assert serve["throughput_ratio"] == pytest.approx(serve["server_tok_per_s"] / serve["offline_tok_per_s"])
    assert 0 < serve["ttft_p50"] <= serve["ttft_p99"] and 0 < serve["tpot_p50"] <= serve["tpot_p99"]
    assert serve["texts_equal"] > 0.5, "greedy: the server says what the offline engine says (near-ties aside)"


def test_workloads_are_deterministic(real):
    _, tok = real
    for name in bench.WORKLOADS:
        a, b = bench.make_workload(name, tok, quick=True), bench.make_workload(name, tok, quick=True)
        assert a == b and len(a.requests) >= 8
    seed = bench.make_workload("seed", tok)
    assert len(seed.requests) == 34 and {r.max_tokens for r in seed.requests} == {128}
    assert sum(r.arrival_step == 5 for r in seed.requests) == 6


def test_the_step_profile_splits_the_forward_pass_without_losing_time(real):
    model, tok = real
    engine = Engine(model, tok, EngineConfig(scheduler=SchedulerConfig(max_num_seqs=4)))
    for question in bench.QUESTIONS[:4]:
        engine.add_request(bench._chat(tok, question), SamplingParams(max_tokens=6, ignore_eos=True))
    engine.step()  # the prefills
    profile = bench.profile_steps(engine, steps=3)
    assert set(bench.PHASES) <= set(profile)
    parts = {k: v for k, v in profile.items() if k.startswith("forward: ")}
    assert {"forward: matmuls", "forward: attention", "forward: KV gather", "forward: KV write"} <= set(parts)
    assert sum(parts.values()) == pytest.approx(profile["forward"])
    assert profile["forward: matmuls"] > profile["forward: KV write"] > 0


def test_the_latency_curve_has_a_row_per_rate(real):
    model, tok = real
    rows = bench.latency_curve(model, tok, [50.0, 100.0], EngineConfig(), quick=True)
    assert [r["rate"] for r in rows] == [50.0, 100.0]
    assert all(r["tok_per_s"] > 0 and r["ttft_p99_s"] >= r["ttft_p50_s"] > 0 for r in rows)
