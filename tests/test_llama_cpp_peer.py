"""llama.cpp as a peer in the benchmark: optional, on the same GGUF file, with clear errors where it cannot run."""
from __future__ import annotations

import contextlib
import copy
import functools
import io
import json
import runpy
import sys
from pathlib import Path

import pytest
import torch

from enginelib import EngineConfig, bench
from enginelib.bench import cli
from enginelib.bench import llama_cpp as llama
from enginelib.bench import llama_cpp_tools as tools
from enginelib.bench.llama_cpp_tools import parse_llama_bench, tg_tok_per_s

from .test_llama_cpp_tools import fake_tools, recorded

MISSING = "ModuleNotFoundError: No module named 'llama_cpp'"


def test_asking_for_llama_cpp_without_it_names_the_install_command(monkeypatch, capsys):
    monkeypatch.setattr(llama, "import_error", lambda: MISSING)
    with pytest.raises(SystemExit):
        bench.main(["--quick", "--systems", "engine,llama_cpp"])
    err = capsys.readouterr().err
    assert "--systems llama_cpp needs llama-cpp-python" in err and "pip install llama-cpp-python" in err
    assert MISSING in err
    with pytest.raises(SystemExit):  # and it is not offered
        bench.main(["--help"])
    out = capsys.readouterr().out
    assert "llama_cpp" not in out[out.index("--systems"):out.index("--model")]  # not a system or section
    assert "--llama-cpp-bin DIR" in out  # llama.cpp's own tools need no llama-cpp-python
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # an import that fails, also where it is installed
    with pytest.raises(ValueError, match="pip install llama-cpp-python"):
        llama.LlamaCpp(llama.gguf_path("smollm2-135m"), threads=1)


def test_llama_cpp_needs_a_gguf_file(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="needs a GGUF file"):
        llama.gguf_path(tmp_path)


def test_the_formats_say_what_each_side_computes_with(real):
    model, _ = real
    assert llama.gguf_format(llama.gguf_path("smollm2-135m")) == "Q4_1 (token_embd.weight Q8_0)"
    assert llama.engine_format(model) == str(model.dtype).removeprefix("torch.")


def test_llama_cpp_runs_two_requests_on_the_same_gguf(real):
    pytest.importorskip("llama_cpp")
    model, tok = real
    wl = bench.Workload("two", [bench.BenchRequest(bench.chat_prompt(tok, q), 8) for q in bench.QUESTIONS[:2]])
    with llama.open_peer("smollm2-135m", 1, 4, [wl]) as peer:
        result = llama.run_llama_cpp(peer, tok, wl)
        step = llama.decode_step_time(peer, tok, 2, 4)
    assert result.name == "llama_cpp" and result.requests == 2 and result.output_tokens == 16
    assert [len(o) for o in result.outputs] == [8, 8] and len(result.texts) == 2
    assert len(result.ttft) == 2 and all(0 < t for t in result.tpot) and result.tok_per_s > 0 and step > 0
    assert set(result.summary()) == set(bench.SystemResult("x", 1, 1, 1.0).summary())
    # Q4_1 against float32 (and llama.cpp against itself at another batch size) may part at a near-tie, so
    # the texts need not match; but read with the same ids at the same positions, each token llama.cpp
    # picks is one our model ranks near the top, given llama.cpp's own text so far. A wrong token id,
    # position or sequence would give tokens our model finds unlikely.
    for req, out in zip(wl.requests, result.outputs):
        with torch.inference_mode():
            logits = model(torch.tensor([req.prompt_ids + out]))[0, len(req.prompt_ids) - 1:-1]
        chosen = logits.gather(1, torch.tensor(out)[:, None])
        ranks = (logits > chosen).sum(1)
        assert (ranks < 5).float().mean() >= 0.9, (ranks.tolist(), tok.decode(out))
    engine = bench.run_engine(model, tok, wl, EngineConfig())
    same = llama.agreement(engine, result)
    assert 0 <= same["texts_equal"] <= 1 and 0 <= same["common_prefix_frac"] <= 1


FAKE = Path(__file__).parent / "fixtures" / "fake_llama_cpp"
THREADS = 2  # what the fake tools check the benchmark passes them
# The core sections these two tests assert nothing about (tests/test_bench.py runs them for real) answer with
# these placeholders: measured, they were 26 s of each quick run on 2 cores. The summary still prints them.
CORE_PLACEHOLDERS = {
    "roofline_figures": {"machine_peak_flops": 1e11, "machine_read_bandwidth": 1e10, "mfu_decode_b32": 0.1,
                         "decode_b32_step_s": 0.1, "single_stream_tok_per_s": 10.0,
                         "single_stream_roofline_tok_per_s": 20.0, "single_stream_roofline_frac": 0.5,
                         "hf_single_stream_tok_per_s": None, "single_stream_vs_hf": None},
    "prefix_cache_effect": {"ttft_p50_on_s": 0.1, "ttft_p50_off_s": 0.2, "ttft_ratio": 0.5, "hit_rate": 0.5},
    "chunked_prefill_effect": {"budget": 256, "long_prompt_tokens": 1024, "itl_p99_on_s": 0.1,
                               "itl_p99_off_s": 0.2, "itl_p99_ratio": 0.5},
    "structured_effect": {"requests": 1, "mask_ms": 0.1, "mask_ms_per_step": 0.1, "mask_fraction": 0.01,
                          "step_ms": 10.0, "step_ms_plain": 10.0, "valid": 1.0,
                          "jump_forward": {"steps": 1, "steps_plain": 1, "forced_tokens": 0}},
}


@pytest.fixture(scope="module")
def crashed_peer_and_tools(tmp_path_factory):
    """One quick benchmark serving the two tests below: ``python -m enginelib.bench --quick --systems
    engine,llama_cpp --llama-cpp-bin DIR --json FILE``, run as ``-m`` runs it (its ``__main__``, here in-process),
    with a stand-in llama_cpp that segfaults in its first llama_decode (in the peer's child process, as a real
    one would) and llama.cpp's tools a DIR of scripts printing recorded output (tests/test_llama_cpp_tools.py).

    Cut from it, for time: the core sections (:data:`CORE_PLACEHOLDERS`), compiling the fastest engines (they run
    eager; compiling them takes minutes, the comparison's path is the same) and the tools' second round (the
    alternation is tested in tests/test_llama_cpp_tools.py). Returns (exit code, report as written, stdout,
    stderr, the tools' DIR).
    """
    tmp = tmp_path_factory.mktemp("bench")
    bin_dir = fake_tools(tmp, gguf=llama.gguf_path("smollm2-135m"), threads=THREADS)
    out = tmp / "bench.json"
    argv = ["--quick", "--systems", "engine,llama_cpp", "--naive-requests", "1", "--threads", str(THREADS),
            "--llama-cpp-bin", str(bin_dir), "--json", str(out)]
    stdout, stderr = io.StringIO(), io.StringIO()
    before = sys.modules.get("llama_cpp")
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(FAKE))  # the children (the import probe, the peer) start with our sys.path
        mp.setattr(sys, "argv", ["python -m enginelib.bench", *argv])
        mp.setattr(cli, "compile_unavailable", lambda device: "eager in this test")
        mp.setattr(tools, "tools_effect", functools.partial(tools.tools_effect, rounds=1))
        for name, figures in CORE_PLACEHOLDERS.items():
            mp.setattr(cli, name, lambda *args, figures=figures, **kwargs: copy.deepcopy(figures))
        llama.import_error.cache_clear()  # asked again, with the stand-in on the path (and after, without it)
        try:
            with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
                runpy.run_module("enginelib.bench", run_name="__main__")
            code = 0
        except SystemExit as stop:  # what `python -m` would exit with
            code = stop.code
        finally:
            llama.import_error.cache_clear()
            if sys.modules.get("llama_cpp") is not before:  # the stand-in, had anything here imported it
                if before is None:
                    del sys.modules["llama_cpp"]
                else:
                    sys.modules["llama_cpp"] = before
    return code, json.loads(out.read_text()), stdout.getvalue(), stderr.getvalue(), bin_dir


def test_a_llama_cpp_that_segfaults_ends_with_a_report_and_exit_code_0(crashed_peer_and_tools):
    # the benchmark as `python -m` runs it, with a stand-in llama_cpp that segfaults in its first llama_decode
    code, report, stdout, stderr, _ = crashed_peer_and_tools
    assert code == 0, stderr[-3000:]
    crashed = "llama.cpp crashed: signal 11 (SIGSEGV) in llama_decode"
    assert crashed in stdout and "the rest of the benchmark ran without it" in stdout
    assert f"bench: {crashed}; the benchmark goes on without it" in stderr  # said when it happened
    section = report["llama_cpp"]
    assert section["crashed"] == crashed and section["signal"] == 11 and section["call"] == "llama_decode"
    assert section["cpu"] == report["machine"]["cpu_label"] and report["machine"]["cpu"]["model"]
    assert any(crashed in note for note in report["notes"])
    assert "llama_cpp" not in report["systems"] and report["systems"]["engine"]["tok_per_s"] > 0
    assert report["ratios"]["single_stream_vs_llama_cpp"] is None  # nothing measured is made up
    assert report["kv_waste"]["paged"] > 0  # the sections after the crash ran (the tools' too: the test below)


def test_llama_cpp_bin_puts_the_tools_beside_the_engine_in_the_report(crashed_peer_and_tools):
    # the whole --llama-cpp-bin path in a quick run (the same run as above: the tools do not need the peer)
    _, report, out, _, bin_dir = crashed_peer_and_tools
    section = report["llama_cpp_bin"]
    assert section["bin"] == str(bin_dir) and section["threads"] == THREADS and section["cmake"]["GGML_NATIVE"] == "ON"
    assert section["format"] == "Q4_1 (token_embd.weight Q8_0)" and section["cpu"] == report["machine"]["cpu_label"]
    assert section["single_stream_tok_per_s"] == max(map(tg_tok_per_s, parse_llama_bench(recorded("llama-bench.json"))))
    for key, ours in (("single_stream_vs_llama_cpp_bin", "engine_single_stream_tok_per_s"),
                      ("single_stream_fastest_vs_llama_cpp_bin", "fast_single_stream_tok_per_s"),
                      ("decode_b32_vs_llama_cpp_bin", "engine_decode_b32_tok_per_s"),
                      ("decode_b32_fastest_vs_llama_cpp_bin", "fast_decode_b32_tok_per_s")):
        theirs = section["decode_b32_tok_per_s" if "b32" in key else "single_stream_tok_per_s"]
        assert report["ratios"][key] == pytest.approx(section[ours] / theirs) and section[ours] > 0
    assert "int4 layers" in section["fast_format"] and "compiled" not in section["fast_format"]
    from enginelib.speed import cpu_kernels
    fused = "one C++ call a step" in section["fast_format"]  # the fused step, where our kernels build
    assert fused == (cpu_kernels.unavailable("cpu") is None)
    # batch 32: the float32 engine and, where it runs, the one-call step, timed against each other here
    assert ("faster here than" in section["fast_b32_format"]) == fused
    # its roof: the bandwidth over the bytes a step of the GGUF's model reads, 92 MiB (the embedding table's
    # 108 MiB of float32 rows left out: a token reads one row)
    roof = section["fast_single_stream_roofline_tok_per_s"]
    assert 91 * 2**20 < section["fast_single_stream_read_bandwidth"] / roof < 93 * 2**20  # read over 92 MiB too
    frac = section["fast_single_stream_roofline_frac"]
    assert frac == pytest.approx(section["fast_single_stream_tok_per_s"] / roof) and f"{frac:.0%} of its bandwidth roofline" in out
    theirs = section["single_stream_roofline_frac"]  # llama.cpp's against the same roof: the same GGUF's bytes
    assert theirs == pytest.approx(section["single_stream_tok_per_s"] / roof) and f"tools at {theirs:.0%} of it" in out
    assert f"ratios (on {report['machine']['cpu_label']})" in out
    assert "llama.cpp's tools (commit" in out and "GGML_NATIVE=ON" in out and "llama-batched-bench pp64 tg32 B32" in out
