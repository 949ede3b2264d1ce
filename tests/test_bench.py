"""The benchmark runs end to end and writes the JSON schema other tools read."""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import math
import os
import statistics
import time
from pathlib import Path

import pytest
import torch

from enginelib import Engine, EngineConfig, SamplingParams, SchedulerConfig, bench
from enginelib.bench.cli import parse_sections
from enginelib.bench.roofline import best_time
from enginelib.bench.spec_decode import compiled_target_effect
from enginelib.speed.compiled import compile_unavailable
from enginelib.speed.speculative import SpeculativeConfig

from .conftest import DEVICE, tiny_tokenizer

SCHEMA = [  # the core: every run has these
    "systems.engine.tok_per_s", "systems.engine.ttft_p50_s", "systems.engine.tpot_p50_s",
    "systems.kv_cache.tok_per_s", "ratios.engine_vs_naive", "ratios.engine_vs_static",
    "ratios.engine_vs_hf_static", "ratios.single_stream_vs_hf", "single_stream_roofline_frac",
    "mfu_decode_b32", "kv_waste.paged", "kv_waste.contiguous", "concurrency_ratio",
    "machine.torch", "machine.threads", "machine.device", "machine.dtype", "machine.formats.engine",
    "machine.formats.llama_cpp", "machine.sections", "ratios.engine_vs_llama_cpp", "ratios.single_stream_vs_llama_cpp",
    "ratios.decode_b32_vs_llama_cpp",
    "prefix_cache.ttft_ratio", "prefix_cache.hit_rate", "chunked_prefill.itl_p99_ratio",
    "chunked_prefill.long_prompt_tokens", "machine.gpu",
    "structured.mask_ms", "structured.mask_ms_per_step", "structured.step_ms", "structured.step_ms_plain",
    "structured.mask_fraction", "structured.valid", "structured.compile_ms", "structured.jump_forward.steps",
]
SECTION_SCHEMA = {  # the slow sections (--sections): checked where the run has them
    "serve": ["serve.throughput_ratio", "serve.server_tok_per_s", "serve.offline_tok_per_s", "serve.concurrency",
              "serve.ttft_p50", "serve.ttft_p99", "serve.tpot_p50", "serve.tpot_p99", "serve.ttft_overhead_ms",
              "serve.refused_flood", "serve.engine_cpus", "serve.client_cpus"],
    "spec_decode": [
        "spec_decode.speedup_b1", "spec_decode.acceptance", "spec_decode.mean_accepted_length", "spec_decode.k",
        "spec_decode.tok_per_s", "spec_decode.tok_per_s_plain", "spec_decode.texts_equal", "spec_decode.draft",
        "spec_decode.ngram.speedup_b1", "spec_decode.ngram.acceptance", "spec_decode.ngram.speedup_b8",
        "spec_decode.extractive.speedup_b1", "spec_decode.extractive.acceptance"],
    "quant": [f"quant.{fmt}.{key}" for fmt in ("int8", "int4") for key in
              ("tok_per_s_ratio", "ppl_delta", "ppl", "bytes_per_param", "weight_bytes", "kernels")],
    "compile": ["compile.speedup_b1", "compile.tok_per_s_b1", "compile.tok_per_s_eager_b1", "compile.compile_seconds",
                "compile.tokens_equal_b1"],
}


def lookup(report: dict, dotted: str):
    for key in dotted.split("."):
        report = report[key]
    return report


def test_quick_bench_writes_every_figure_of_the_schema(tmp_path, real):
    # CI keeps this run's JSON as its benchmark record ($ENGINELIB_BENCH_JSON), rather than run the bench twice,
    # and asks for every slow section ($ENGINELIB_BENCH_SECTIONS=all); alone, --quick runs the core only.
    out = Path(os.environ.get("ENGINELIB_BENCH_JSON") or tmp_path / "bench.json")
    sections = os.environ.get("ENGINELIB_BENCH_SECTIONS", "none")
    report = bench.main(["--quick", "--naive-requests", "1", "--sections", sections, "--json", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    ran = set(report["machine"]["sections"])
    if sections == "none":
        assert not ran, "--quick runs no slow section unless asked"
    assert not (set(SECTION_SCHEMA) - ran) & set(report), "a section ran that was not asked for"
    for key in SCHEMA + [key for section in ran & set(SECTION_SCHEMA) for key in SECTION_SCHEMA[section]]:
        lookup(report, key)  # present (None where a system was not run)
    peer = "llama_cpp" in ran  # llama.cpp joins the systems with its section (where llama-cpp-python is installed)
    assert report["systems"]["engine"]["tok_per_s"] > 0
    # transformers is a slow section: hf_static runs with it (where transformers imports), never without it
    assert ("hf_static" in report["systems"]) == ("hf" in ran and importlib.util.find_spec("transformers") is not None)
    assert report["ratios"]["engine_vs_naive"] > 1  # one request at a time, without a cache: the slowest
    assert 0 < report["kv_waste"]["paged"] < report["kv_waste"]["contiguous"] < 1
    assert report["concurrency_ratio"] > 1
    assert "differs" not in report["systems"]["engine"]["note"], "the engine must match the kv_cache oracle"
    assert report["prefix_cache"]["hit_rate"] > 0.5  # 12 requests behind one long system prompt
    assert 0 < report["prefix_cache"]["ttft_ratio"] and 0 < report["chunked_prefill"]["itl_p99_ratio"]
    for section in ("prefix_cache", "chunked_prefill"):  # on and off must give the same tokens
        assert "differs" not in report[section]["note"], report[section]["note"]
    check_structured(report["structured"])
    if "serve" in ran:
        check_serve(report["serve"])
    if "spec_decode" in ran:
        check_spec_decode(report["spec_decode"])
    if "quant" in ran:
        check_quant(report["quant"])
    if "compile" in ran:
        check_compile(report["compile"])
    assert report["machine"]["formats"]["engine"] == report["machine"]["dtype"]
    if not peer:
        assert report["ratios"]["single_stream_vs_llama_cpp"] is None and "llama_cpp" not in report["systems"]
        return
    section, system = report["llama_cpp"], report["systems"]["llama_cpp"]  # the same GGUF, threads and prompts
    assert system["output_tokens"] == report["systems"]["engine"]["output_tokens"] and system["tok_per_s"] > 0
    assert report["machine"]["formats"]["llama_cpp"].startswith("Q4_1")
    assert section["threads"] == report["machine"]["threads"]
    assert report["ratios"]["single_stream_vs_llama_cpp"] == pytest.approx(
        section["engine_single_stream_tok_per_s"] / section["single_stream_tok_per_s"])
    assert report["ratios"]["decode_b32_vs_llama_cpp"] > 0 and 0 <= section["texts_equal"] <= 1


def check_structured(structured: dict) -> None:
    """The grammar's mask against the decode step: every constrained output valid, with and without jump-forward."""
    assert structured["valid"] == 1 and structured["jump_forward"]["valid"] == 1, structured["example"]
    assert 0 < structured["mask_ms"] and 0 < structured["mask_fraction"] < 1 and structured["step_ms_plain"] > 0
    per_step = structured["mask_ms_per_step"] / structured["mask_ms"]  # masks per decode step: every request's
    assert 1 - 1e-9 <= per_step <= structured["requests"] + 1e-9
    jump = structured["jump_forward"]
    assert jump["forced_tokens"] > 0 and jump["steps"] < jump["steps_plain"]


def check_serve(serve: dict) -> None:
    """Our server on the same workload, 32 streams at most (all 16 quick requests at once)."""
    assert serve["concurrency"] == 32 and serve["requests"] == 16 and "failed" not in serve["note"], serve["note"]
    assert serve["throughput_ratio"] == pytest.approx(serve["server_tok_per_s"] / serve["offline_tok_per_s"])
    assert 0 < serve["ttft_p50"] <= serve["ttft_p99"] and 0 < serve["tpot_p50"] <= serve["tpot_p99"]
    assert 0 < serve["ttft_alone_p50"] < serve["ttft_p50"]  # alone, no queue: sooner than under 32 streams
    assert serve["ttft_overhead_ms"] == pytest.approx(1000 * (serve["ttft_alone_p50"] - serve["offline_ttft_alone_p50"]))
    assert all(v is None or 0 <= v <= 1 for v in serve["steal"].values())  # the hypervisor's share of those CPUs
    if serve["engine_cpus"] is not None:  # Linux, 2+ CPUs: the engine's CPUs apart from the client's
        engine, client = set(serve["engine_cpus"]), set(serve["client_cpus"])
        assert engine and client and not engine & client and engine | client <= os.sched_getaffinity(0)
    assert (serve["refused_flood"] is None) == (serve["engine_cpus"] is None)  # the flood needs the split too
    if (flood := serve["refused_flood"]) is not None:  # a live stream beside refused prompts
        assert flood["engine_cpus"] == serve["engine_cpus"]
        assert flood["refused_per_s"] > 0 and len(flood["quiet_tok_per_s"]) == len(flood["flooded_tok_per_s"]) + 1
        assert flood["ratio"] == pytest.approx(statistics.median(flood["flooded_tok_per_s"])
                                               / statistics.median(flood["quiet_tok_per_s"]))
    assert serve["texts_equal"] > 0.5, "greedy: the server says what the offline engine says (near-ties aside)"


def check_spec_decode(spec: dict) -> None:
    """Speculation vs plain, greedy: the very same texts, at any batch size."""
    ngram = spec["ngram"]
    assert spec["k"] == 4 and spec["method"] == "draft" and "int4 layers" in spec["draft"]
    assert spec["texts_equal"] == ngram["texts_equal"] == ngram["texts_equal_b8"] == 1.0
    assert spec["extractive"]["texts_equal"] == 1.0
    for figures in (spec, ngram, spec["extractive"]):
        assert figures["speedup_b1"] > 0 and math.isfinite(figures["speedup_b1"])
        assert 0 <= figures["acceptance"] <= 1 and 0 <= figures["mean_accepted_length"] <= spec["k"]
        assert figures["speedup_b1"] == pytest.approx(figures["tok_per_s"] / figures["tok_per_s_plain"])
    assert ngram["speedup_b8"] > 0 and math.isfinite(ngram["speedup_b8"])
    assert spec["acceptance"] > 0.5, "the int4 draft is the target rounded: it should mostly agree"
    assert spec["extractive"]["acceptance"] > 0, "copying a passage: prompt lookup must find some guesses"


def check_quant(quant: dict) -> None:
    """int8 and int4 against float: smaller, close in perplexity."""
    for fmt, bits in (("int8", 8), ("int4", 4)):
        row = quant[fmt]
        assert row["tok_per_s_ratio"] > 0 and math.isfinite(row["tok_per_s_ratio"])
        assert row["ppl_delta"] == pytest.approx(row["ppl"] / quant["float"]["ppl"] - 1)
        assert -0.5 < row["ppl_delta"] < 0.5, f"{fmt} perplexity {row['ppl']} far from float's {quant['float']['ppl']}"
        assert bits / 8 <= row["bytes_per_param"] < quant["float"]["bytes_per_param"]  # scales and minimums on top
        assert 0 < row["weight_bytes"] < quant["float"]["weight_bytes"] and row["kernels"]


def check_compile(comp: dict) -> None:
    """Decode steps through torch.compile (bucket 1 quick): the same greedy tokens."""
    assert comp["speedup_b1"] > 0 and comp["compiled_steps"] > 0
    assert comp["tokens_equal_b1"] >= 0.5  # other float32 kernels: a near-tie may flip, a bug flips everything
    assert set(comp["compile_seconds"]) == {"1"}


def test_workloads_are_deterministic(real):
    _, tok = real
    for name in bench.WORKLOADS:
        a, b = bench.make_workload(name, tok, quick=True), bench.make_workload(name, tok, quick=True)
        assert a == b and len(a.requests) >= 8
    seed = bench.make_workload("seed", tok)
    assert len(seed.requests) == 34 and {r.max_tokens for r in seed.requests} == {128}
    assert sum(r.arrival_step == 5 for r in seed.requests) == 6


def test_the_chunked_prefill_workload_scales_its_long_prompts_to_a_gpu(real, monkeypatch):
    """700 tokens stall no one on a GPU: there the long prompts fill most of the context (faked: no GPU needed)."""
    from enginelib.bench.scheduling import GPU_LONG_PROMPT, long_prompt_tokens
    from enginelib.model.transformer import Transformer

    def longs(wl: bench.Workload) -> list[int]:  # the long prompts' lengths (they arrive later)
        return [len(r.prompt_ids) for r in wl.requests if r.arrival_step]

    model, tok = real
    assert longs(bench.make_workload("long-prompt", tok, quick=True)) == [700, 700]  # a CPU's, as before
    if model.device.type == "cpu":
        assert long_prompt_tokens(model) is None
    monkeypatch.setattr(Transformer, "device", property(lambda self: torch.device("cuda")))
    n = long_prompt_tokens(model)
    assert n == min(GPU_LONG_PROMPT, model.cfg.context_length - 64) == 8000  # SmolLM2: a context of 8192
    wl = bench.make_workload("long-prompt", tok, quick=True, long_tokens=n)
    assert longs(wl) == [n, n] and all(len(r.prompt_ids) + r.max_tokens <= model.cfg.context_length
                                       for r in wl.requests)


def test_the_step_profile_splits_the_forward_pass_without_losing_time(real):
    model, tok = real
    engine = Engine(model, tok, EngineConfig(scheduler=SchedulerConfig(max_num_seqs=4)))
    for question in bench.QUESTIONS[:4]:
        engine.add_request(bench.chat_prompt(tok, question), SamplingParams(max_tokens=6, ignore_eos=True))
    engine.step()  # the prefills
    profile = bench.profile_steps(engine, steps=3)
    assert set(bench.PHASES) <= set(profile)
    parts = {k: v for k, v in profile.items() if k.startswith("forward: ")}
    assert {"forward: matmuls", "forward: attention", "forward: KV gather", "forward: KV write"} <= set(parts)
    assert sum(parts.values()) == pytest.approx(profile["forward"])
    assert profile["forward: matmuls"] > profile["forward: KV write"] > 0
    assert profile[bench.REST] > 0  # the outputs: each new token detokenized, outside every phase


def test_the_phase_ranges_cost_nothing_unless_a_profiler_records():
    from enginelib.model.device import record_function

    assert isinstance(record_function("schedule"), contextlib.nullcontext)  # no RecordFunction made: ~4 us saved
    with torch.profiler.profile() as prof:
        with record_function("schedule"):
            torch.zeros(1)
    assert [e.name for e in prof.events() if e.name == "schedule"] == ["schedule"]


def test_on_a_gpu_every_phase_waits_for_its_kernels_before_it_ends(tiny_dt, monkeypatch):
    """What makes the profile add up on a GPU: while profiling there, each phase range ends with a
    ``torch.cuda.synchronize`` inside it, so its kernels' time is its own (faked here: no GPU needed)."""
    from enginelib.bench.profile import PHASE_MODULES, _synchronized_phases

    def synchronize(device=None):  # marks where it was called from: its range's parent is the phase it ended
        synced.append(device)
        with torch.profiler.record_function("synchronize"):
            pass

    synced = []
    monkeypatch.setattr(torch.cuda, "synchronize", synchronize)
    modules = [importlib.import_module(name) for name in PHASE_MODULES]
    before = [m.record_function for m in modules]
    engine = Engine(tiny_dt, tiny_tokenizer(tiny_dt.cfg.vocab_size), EngineConfig(num_blocks=16))
    engine.add_request([1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True))
    cuda = torch.device("cuda")
    with _synchronized_phases(cuda), torch.profiler.profile() as prof:
        engine.step()
    assert [m.record_function for m in modules] == before  # put back afterwards
    phases = sorted(e.name for e in prof.events() if e.name in bench.PHASES)
    assert phases == sorted(bench.PHASES) and synced == [cuda] * len(phases)
    assert sorted(e.cpu_parent.name for e in prof.events() if e.name == "synchronize") == phases
    with _synchronized_phases(None), torch.profiler.profile():  # a CPU: nothing waits
        engine.step()
    assert len(synced) == len(phases)


def test_the_latency_curve_has_a_row_per_rate(real):
    model, tok = real
    rows = bench.latency_curve(model, tok, [50.0, 100.0], EngineConfig(), quick=True, slo=(1e9, 1e9))
    assert [r["rate"] for r in rows] == [50.0, 100.0]
    assert all(r["tok_per_s"] > 0 and r["ttft_p99_s"] >= r["ttft_p50_s"] > 0 for r in rows)
    # targets nobody misses: goodput is every request over the run's clock
    assert all(r["goodput"] == pytest.approx(r["requests"] / r["seconds"]) for r in rows)


def test_goodput_counts_the_requests_within_both_targets():
    result = bench.SystemResult("x", 3, 6, 2.0, timings=[(0.0, [0.1, 0.2]), (0.0, [0.5, 0.6]), (1.0, [1.1, 1.9])])
    assert result.goodput(0.2, 0.5) == 0.5      # the first only: the second starts late, the third is slow
    assert result.goodput(1.0, 1.0) == 1.5      # all three


def test_decode_seconds_counts_shared_time_once():
    assert bench.decode_seconds([[0.0, 1.0], [2.0, 2.5]]) == pytest.approx(1.5)  # one at a time: the sum
    assert bench.decode_seconds([[0.0, 2.0], [1.0, 3.0], [1.5, 1.6]]) == pytest.approx(3.0)  # a batch: the union
    assert bench.decode_seconds([[5.0], [1.0, 1.0]]) == 0.0  # a single token has no decode time


@pytest.mark.parametrize("flags, message", [(["--spec-k", "0"], "--spec-k must be at least 1"),
                                            (["--quant-kernel", "fast"], "unknown --quant-kernel"),
                                            (["--sections", "quant,fast"], "unknown section 'fast'")])
def test_bad_section_flags_say_what_to_change(flags, message, capsys):
    with pytest.raises(SystemExit):
        bench.main(["--quick", *flags])
    assert message in capsys.readouterr().err


SLOW = {"hf", "serve", "spec_decode", "quant", "compile"}


@pytest.mark.parametrize("value, quick, want", [(None, True, set()), ("none", False, set()), (None, False, SLOW),
                                               ("all", True, SLOW), ("quant, compile", True, {"quant", "compile"})])
def test_quick_runs_no_slow_section_unless_asked_and_a_full_run_all(value, quick, want, monkeypatch):
    monkeypatch.setattr(bench.llama_cpp, "available", lambda: False)  # llama.cpp's section is where it imports
    assert parse_sections(argparse.ArgumentParser(), value, quick) == want


def test_a_roof_is_the_best_of_calls_spread_over_the_minimum_time():
    durations = iter([0.5] + [0.02] * 3 + [0.001] + [0.02] * 1000)  # a warm-up, then one fast call among slow
    calls = []

    def work():
        calls.append(1)
        time.sleep(next(durations))

    best = best_time(work, torch.device("cpu"), repeats=3, min_seconds=0.2)
    assert best < 0.01  # the warm-up does not count, and the fast call after `repeats` calls is kept
    timed = len(calls) - 1
    assert timed >= 10  # not stopped at `repeats` (3): the calls of 0.02 s went on until 0.2 s had passed


@pytest.mark.skipif(compile_unavailable(DEVICE) is not None, reason="needs torch.compile's compiler")
def test_speculation_is_weighed_against_compiled_plain_decode_too(tiny_dt):
    tok = tiny_tokenizer(tiny_dt.cfg.vocab_size)
    prompts = [[3, 4, 5, 3, 4, 5, 3, 4], [5, 6, 5, 6, 5]]
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=3, prompt_lookup_min=1)
    report = compiled_target_effect(tiny_dt, tok, prompts, 10, spec)
    assert report["texts_equal"] == 1.0 and report["proposed"] > 0
    assert report["speedup_b1"] == report["tok_per_s"] / report["tok_per_s_plain"] > 0
    # both sides ran their decode steps in their one bucket (1 token; a verification's 4)
    assert report["compiled_steps"]["plain"] > 0 and report["compiled_steps"]["spec"] > 0
    assert set(report["compile_seconds"]) == {"plain", "spec"}
