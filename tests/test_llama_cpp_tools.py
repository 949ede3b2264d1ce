"""llama.cpp's own tools as the peer (``--llama-cpp-bin DIR``), on output recorded from real runs.

CI does not build llama.cpp, so tests/fixtures/llama_cpp_tools holds what ``llama-bench`` and
``llama-batched-bench`` printed when built by .ci/build_llama_cpp.sh and run on the shipped GGUF at 2 threads
(see its README). The parsers read it as is, and a DIR of small scripts that check their arguments and print
it runs the whole path: the subprocesses, the parsing, the comparison with the engine, the report.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import pytest

from enginelib import bench
from enginelib.bench import cli
from enginelib.bench import llama_cpp_tools as tools
from enginelib.bench.report import print_llama_cpp_tools

RECORDED = Path(__file__).parent / "fixtures" / "llama_cpp_tools"
GGUF = Path("/models/SmolLM2-135M-Instruct.Q4_1.gguf")  # any path: the fake tools check it is the one passed


def recorded(name: str) -> str:
    return (RECORDED / name).read_text()


def test_llama_bench_json_is_read_as_recorded():
    records = tools.parse_llama_bench(recorded("llama-bench.json"))
    assert [(r["n_prompt"], r["n_gen"], r["n_threads"]) for r in records] == [(0, 64, 2), (0, 64, 2)]
    assert {r["flash_attn"] for r in records} == {0, 1}
    assert all(r["avg_ts"] > 0 and len(r["samples_ts"]) == 5 for r in records)
    assert records[0]["model_filename"].endswith("SmolLM2-135M-Instruct.Q4_1.gguf")


def test_batched_bench_jsonl_is_read_among_its_log_lines():
    text = recorded("llama-batched-bench.stdout")
    points = tools.parse_batched_bench(text)
    assert len(text.splitlines()) > len(points)  # the tool prints other lines to the same stream: they are skipped
    assert [(p["pl"], p["pp"], p["tg"], p["n_threads"]) for p in points] == [(1, 64, 32, 2), (32, 64, 32, 2)]
    assert all(p["speed_tg"] > 0 for p in points)
    with pytest.raises(ValueError, match="no JSON lines"):
        tools.parse_batched_bench("main: n_kv_max = 3328\n\n")


def test_the_build_flags_come_from_the_cache_the_isa_flags_and_the_compiler():
    cmake = {}
    for line in recorded("CMakeCache.txt").splitlines():
        if m := tools._CMAKE_FLAG.match(line):
            cmake[m.group(1)] = m.group(2)
    assert cmake["GGML_NATIVE"] == "ON" and cmake["GGML_AVX512"] == "OFF"  # native: -march=native, options OFF
    compiled = tools.parse_defines(recorded("cxx-march-native-defines.txt"))
    assert compiled["AVX512"] == "1" and compiled["AVX512_VNNI"] == "1" and compiled["AVX2"] == "1"
    assert "AMX_INT8" not in compiled  # this EPYC has no AMX, so a native build has none either
    line = tools.build_flags(cmake, ["-march=native"], compiled)
    assert line.startswith("GGML_CPU_REPACK=ON") and "GGML_NATIVE=ON" in line and "GGML_AVX512=" not in line
    assert line.endswith("; -march=native: AVX AVX2 FMA F16C AVX512 AVX512_VBMI AVX512_VNNI AVX512_BF16")
    assert tools.build_flags({}, [], {}) == "CMake options unknown (no CMakeCache.txt beside the tools)"


def fake_tools(root: Path, gguf: Path = GGUF, threads: int = 2) -> Path:
    """A build tree like .ci/build_llama_cpp.sh's, from recorded files: build/CMakeCache.txt (its compiler a
    script that prints the recorded ``-march=native`` defines), ggml-cpu's flags.make, and build/bin/llama-bench
    and llama-batched-bench, scripts that check the flags the benchmark must pass and print the recorded output."""
    build = root / "build"
    (build / "bin").mkdir(parents=True)
    compiler = script(root / "fake-c++", ["-march=native", "-dM", "-E"], "cxx-march-native-defines.txt", None)
    cache = recorded("CMakeCache.txt").replace("CMAKE_CXX_COMPILER:FILEPATH=/usr/bin/c++",
                                               f"CMAKE_CXX_COMPILER:FILEPATH={compiler}")
    (build / "CMakeCache.txt").write_text(cache)
    flags_make = build / "ggml" / "src" / "CMakeFiles" / "ggml-cpu.dir" / "flags.make"
    flags_make.parent.mkdir(parents=True)
    flags_make.write_text(recorded("ggml-cpu-flags.make"))
    script(build / "bin" / "llama-bench",
           ["-m", str(gguf), "-t", str(threads), "-p", "0", "-n", "64", "-fa", "0,1", "-o", "json"],
           "llama-bench.json", None)
    script(build / "bin" / "llama-batched-bench",
           ["-m", str(gguf), "-t", str(threads), "-tb", str(threads), "-npp", "64", "-npl", "1,32",
            "--output-format", "jsonl"], "llama-batched-bench.stdout", "llama-batched-bench.stderr")
    return build / "bin"


def script(path: Path, want: list[str], stdout: str, stderr: str | None) -> Path:
    """An executable that exits 2 unless its arguments hold ``want`` (flags with their values, or lone flags)
    and otherwise prints the recorded ``stdout`` (and ``stderr``)."""
    path.write_text(f"""#!{sys.executable}
import sys
args = sys.argv[1:]
want = {want!r}
i = 0
while i < len(want):
    flag = want[i]
    value = want[i + 1] if i + 1 < len(want) and not want[i + 1].startswith("-") else None
    if flag not in args or (value is not None and args[args.index(flag) + 1] != value):
        sys.exit(f"{path.name}: expected {{flag}} {{value or ''}} in {{args}}")
    i += 2 if value is not None else 1
sys.stdout.write(open({str(RECORDED / stdout)!r}).read())
{f"sys.stderr.write(open({str(RECORDED / stderr)!r}).read())" if stderr else ""}
""")
    path.chmod(0o755)
    return path


def test_the_tools_run_on_the_gguf_and_threads_and_compare_with_the_engine(tmp_path, capsys):
    bin_dir = fake_tools(tmp_path)
    assert tools.tools_missing(bin_dir) is None
    run = tools.run_tools(bin_dir, GGUF, threads=2, quick=False)
    single = tools.parse_llama_bench(recorded("llama-bench.json"))
    batched = {p["pl"]: p for p in tools.parse_batched_bench(recorded("llama-batched-bench.stdout"))}
    assert run["single_stream_tok_per_s"] == max(statistics.median(r["samples_ts"]) for r in single)
    assert run["decode_b32_tok_per_s"] == batched[32]["speed_tg"]
    assert run["batched_b1_tok_per_s"] == batched[1]["speed_tg"]
    assert run["threads"] == 2 and run["cmake"]["GGML_NATIVE"] == "ON" and run["isa_flags"] == ["-march=native"]
    assert run["compiled"]["AVX512_VNNI"] == "1" and "AMX_INT8" not in run["compiled"]  # the fake compiler's answer
    assert run["build"].endswith("-march=native: AVX AVX2 FMA F16C AVX512 AVX512_VBMI AVX512_VNNI AVX512_BF16")
    assert run["single_stream_test"] == "llama-bench tg64"
    assert run["batched_test"] == "llama-batched-bench pp64 tg32 B32"

    # the engine's side: steps of known length, alternated with the tools, best of each
    steps = {1: 0.010, 32: 0.050}
    effect = tools.tools_effect(lambda: tools.run_tools(bin_dir, GGUF, 2, quick=False),
                                lambda batch, new: steps[batch], quick=False,
                                fast_step=lambda batch, new: steps[batch] / 2)
    assert effect["engine_single_stream_tok_per_s"] == pytest.approx(100.0)
    assert effect["single_stream_ratio"] == pytest.approx(100.0 / run["single_stream_tok_per_s"])
    assert effect["decode_b32_ratio"] == pytest.approx(32 / 0.050 / run["decode_b32_tok_per_s"])
    assert effect["fast_single_stream_ratio"] == pytest.approx(2 * effect["single_stream_ratio"])
    assert effect["fast_decode_b32_ratio"] is None  # not measured, so not made up
    assert effect["rounds"] == 2 and len(effect["single_stream_runs"]) == 2

    section = {"bin": str(bin_dir), "cpu": "AMD EPYC (x86_64, 2 cores: AVX-512 VNNI; no AMX)",
               "engine_format": "float32", "fast_format": "int4"} | effect
    print_llama_cpp_tools(section)
    out = capsys.readouterr().out
    assert "llama.cpp's tools (commit" in out and "GGML_NATIVE=ON" in out and "AVX-512 VNNI; no AMX" in out
    assert f"({effect['single_stream_ratio']:.2f}x, llama-bench tg64" in out
    assert f"{effect['fast_single_stream_ratio']:.2f}x llama.cpp's tools" in out


CRASH = "#!/bin/sh\necho 'llama_decode: bad batch' >&2\nkill -SEGV $$\n"


def test_a_tool_that_crashes_is_named_with_its_signal(tmp_path):
    bin_dir = fake_tools(tmp_path)
    (bin_dir / "llama-bench").write_text(CRASH)
    with pytest.raises(tools.ToolFailed, match=r"llama-bench crashed: signal 11 \(SIGSEGV\): "
                                                r"llama_decode: bad batch"):
        tools.run_tools(bin_dir, GGUF, threads=2, quick=True)


def test_a_crashing_batched_bench_keeps_the_builds_single_stream(tmp_path):
    # the GGML_NATIVE build on an AMX Xeon: llama-bench runs, llama-batched-bench segfaults on any multi-token batch
    bin_dir = fake_tools(tmp_path)
    (bin_dir / "llama-batched-bench").write_text(CRASH)
    run = tools.run_tools(bin_dir, GGUF, threads=2, quick=True)
    assert run["single_stream_tok_per_s"] > 0 and run["decode_b32_tok_per_s"] is None
    assert run["batched_failed"].startswith("llama-batched-bench crashed: signal 11 (SIGSEGV): llama_decode: bad")
    assert run["batched_bin"] is None and run["batched_test"] is None


def test_of_several_builds_each_batch_size_takes_its_fastest(tmp_path, capsys):
    native = fake_tools(tmp_path / "native")  # llama-bench faster, llama-batched-bench crashes
    (native / "llama-batched-bench").write_text(CRASH)
    records = json.loads(recorded("llama-bench.json"))
    for r in records:
        r["samples_ts"] = [2 * t for t in r["samples_ts"]]
    faster = tmp_path / "faster-llama-bench.json"
    faster.write_text(json.dumps(records))
    (native / "llama-bench").write_text(f"#!/bin/sh\ncat {faster}\n")
    plain = fake_tools(tmp_path / "plain")
    broken = fake_tools(tmp_path / "broken")
    (broken / "llama-bench").write_text(CRASH)

    run = tools.run_builds([native, plain, broken], GGUF, threads=2, quick=True)
    alone = tools.run_tools(plain, GGUF, threads=2, quick=True)
    assert run["single_stream_tok_per_s"] == pytest.approx(2 * alone["single_stream_tok_per_s"])
    assert run["bin"] == str(native) and run["batched_bin"] == str(plain)
    assert run["decode_b32_tok_per_s"] == alone["decode_b32_tok_per_s"] and run["batched_failed"].startswith(
        "llama-batched-bench crashed")
    assert [b["bin"] for b in run["builds"]] == [str(native), str(plain), str(broken)]
    assert run["builds"][2]["failed"].startswith("llama-bench crashed: signal 11")
    with pytest.raises(tools.ToolFailed, match=f"{broken}: llama-bench crashed"):
        tools.run_builds([broken], GGUF, threads=2, quick=True)

    steps = {1: 0.010, 32: 0.050}
    effect = tools.tools_effect(lambda: run, lambda batch, new: steps[batch], quick=True)
    print_llama_cpp_tools({"cpu": "a CPU", "engine_format": "float32"} | effect)
    out = capsys.readouterr().out
    assert f"vs {run['single_stream_tok_per_s']:.1f} tok/s" in out and f"vs {alone['decode_b32_tok_per_s']:.1f}" in out
    assert out.count("  build ") == 3 and "batch 32 failed: llama-batched-bench crashed" in out
    assert "failed: llama-bench crashed" in out


def test_llama_cpp_bin_without_the_tools_is_refused_with_the_build_command(tmp_path, capsys):
    with pytest.raises(SystemExit):
        bench.main(["--quick", "--llama-cpp-bin", str(tmp_path)])
    err = capsys.readouterr().err
    assert "--llama-cpp-bin" in err and "has no llama-bench or llama-batched-bench" in err
    assert "bash .ci/build_llama_cpp.sh" in err


def test_the_recorded_fixtures_say_where_they_came_from():
    about = recorded("README.md")
    assert "build_llama_cpp.sh" in about and "llama-bench" in about and "2 threads" in about
    assert json.loads(recorded("llama-bench.json"))[0]["build_commit"] in about


def test_a_tool_that_prints_nothing_readable_fails_its_section_and_the_run_goes_on(tmp_path, capsys):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")  # a path to pass: the fake tools never read it
    bin_dir = fake_tools(tmp_path, gguf=gguf)
    (bin_dir / "llama-batched-bench").write_text("#!/bin/sh\necho 'main: n_kv_max = 3328'\n")  # no JSON lines
    run = tools.run_tools(bin_dir, gguf, threads=2, quick=True)  # batch 32 not measured; the single stream was
    assert run["batched_failed"] == "llama-batched-bench printed no JSON lines: 'main: n_kv_max = 3328\\n'"
    assert run["decode_b32_tok_per_s"] is None and run["single_stream_tok_per_s"] > 0
    (bin_dir / "llama-bench").write_text("#!/bin/sh\necho '[{\"n_gen\": 64}]'\n")  # JSON without the figures
    with pytest.raises(tools.ToolFailed, match="cannot read: KeyError: 'avg_ts'"):
        tools.run_tools(bin_dir, gguf, threads=2, quick=True)

    class Sides:  # the engine's side stood in by steps of a known length (its fastest engines compile for minutes)
        engine_format = "float32"

        def engine_step(self, batch: int, new_tokens: int) -> float:
            return 0.01

        fast_step = fast_b32_step = engine_step

    report = {"machine": {"cpu_label": "a CPU"}, "ratios": {}}
    args = argparse.Namespace(model=str(gguf), llama_cpp_bin=[bin_dir], quick=True)
    cli._llama_cpp_tools_section(args, report, None, 2, Sides())
    section = report["llama_cpp_bin"]
    assert section["failed"] == f"ToolFailed: {bin_dir}: llama.cpp's tools printed what we cannot read: KeyError: 'avg_ts'"
    assert section["bin"] == str(bin_dir) and section["cpu"] == "a CPU"
    assert "single_stream_vs_llama_cpp_bin" not in report["ratios"]  # nothing measured, nothing made up
    assert any("llama.cpp's tools failed" in note for note in report["notes"])
    print_llama_cpp_tools(section)
    assert f"llama.cpp's tools in {bin_dir} failed (on a CPU): ToolFailed:" in capsys.readouterr().out
