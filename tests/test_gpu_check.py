"""The GPU check (.ci/gpu_check.sh, .ci/gpu_report.py, .ci/gpu_kernels.py) without a GPU: its verdict and report
on a recorded run (one fallback fails it and is named), its kernel micro-benchmark failing rows whose Triton
kernel cannot run or is wrong, its way of hiding Triton, and its exit status 2 on a machine with no GPU."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, ROOT / ".ci" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


report_module = _load("gpu_report")
kernels_module = _load("gpu_kernels")


def event(what: str, ran: str, requested: str | None = None, why: str = "", fallback: bool = False,
          section: str = "") -> dict:
    return {"what": what, "requested": requested or ran, "ran": ran, "why": why, "fallback": fallback,
            "section": section}


CHAPTER_PATHS = {  # what a good run on a T4 records per chapter
    "13_quantization": [event("quant kernel int8 576x576", "triton", "auto"),
                        event("quant kernel int4 576x1536", "triton", "auto")],
    "14_decode_without_overhead": [event("compiled decode", "torch.compile (mode=default), attention in the "
                                         "paged_attend operator", "torch.compile (mode=default)")],
    "15_speculative_decoding": [event("compiled draft", "torch.compile (mode=default), attention in the "
                                      "paged_attend operator", "torch.compile (mode=default)")],
    "16_going_further": [event("decode attention", "triton"),
                         event("CUDA graphs", "inductor's CUDA graphs", "mode=reduce-overhead")],
}
LEFT_OUT = event("quant kernel int4 576x1536", "auto without it", "auto (with triton)",
                 "it failed on int4 [576, 1536]: CompilationError: out of shared memory", fallback=True)


def junit(tests: int, failures: int = 0, skipped: int = 0) -> str:
    cases = [f'<testcase classname="tests.test_paged" name="test_{i}" time="0.1"/>'
             for i in range(tests - failures - skipped)]
    cases += [f'<testcase classname="tests.test_quant" name="test_bad_{i}"><failure message="assert 1 == 2"/>'
              "</testcase>" for i in range(failures)]
    cases += ['<testcase classname="tests.test_compiled" name="test_cpp"><skipped message="needs a C++ CPU"/>'
              "</testcase>" for _ in range(skipped)]
    return (f'<testsuites><testsuite name="pytest" errors="0" failures="{failures}" skipped="{skipped}" '
            f'tests="{tests}" time="61.5">{"".join(cases)}</testsuite></testsuites>')


def recorded_run(out: Path, gpu: str = "Tesla T4", half: str = "float16") -> Path:
    """The files a whole run of gpu_check.sh leaves under _build/gpu/, every step passed, nothing fell back."""
    (out / "paths").mkdir(parents=True)
    (out / "machine.json").write_text(json.dumps({
        "gpu": gpu, "capability": "7.5", "memory_gib": 14.7, "gpus": 1, "driver": "550.54.15", "cuda": "12.4",
        "torch": "2.8.0+cu124", "triton": "3.4.0", "python": "3.12.11", "date": "2026-12-07 10:00 UTC",
        "commit": "abc1234", "half": half, "triton_disabled": False}))
    (out / "preflight.json").write_text(json.dumps([
        {"path": "Triton kernels (float32)", "unavailable": None},
        {"path": f"Triton kernels ({half})", "unavailable": None},
        {"path": "torch.compile on the GPU", "unavailable": None}]))
    for dtype in ("float32", half):
        (out / f"tests-{dtype}.xml").write_text(junit(40, skipped=2))
        (out / f"chapters-{dtype}.json").write_text(json.dumps([
            {"chapter": name, "dtype": dtype, "ok": True, "seconds": 30.0 + i, "paths": paths}
            for i, (name, paths) in enumerate(CHAPTER_PATHS.items())]))
    (out / "kernels.json").write_text(json.dumps([
        {"kernel": "int4 linear", "shape": "M=1, 960x576", "dtype": "float16", "us": {
            "reference": 40.0, "cuBLAS float": 12.0, "triton": 8.0}, "error": 1e-3, "tolerance": 2e-2, "ok": True,
         "why": ""},
        {"kernel": "decode attention", "shape": "32 x 2048 keys", "dtype": "float16",
         "us": {"gather + SDPA": 300.0, "triton": 60.0}, "error": 2e-4, "tolerance": 2e-2, "ok": True, "why": ""}]))
    (out / "bench.exit").write_text("0\n")
    (out / "bench.seconds").write_text("95\n")
    (out / "bench.log").write_text("systems ...\nratios:\n  engine_vs_naive: 9.1\n")
    bench_paths = event("decode attention", "triton", section="systems")
    (out / "paths" / "bench.jsonl").write_text(json.dumps(bench_paths) + "\n")
    return out


def rewrite(path: Path, change) -> None:
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


@pytest.fixture
def run(tmp_path, monkeypatch) -> Path:
    monkeypatch.delenv("GPU_CHECK_SKIP", raising=False)
    return recorded_run(tmp_path / "gpu")


def test_a_clean_run_passes_and_its_report_says_what_ran(run, tmp_path):
    assert report_module.verdict(run) == []
    problems = report_module.report(tmp_path / "gpu_results.md", run)
    text = (tmp_path / "gpu_results.md").read_text()
    assert problems == [] and "Result: **passed**." in text
    assert ("Tesla T4 (compute capability 7.5, 14.7 GiB, driver 550.54.15), torch 2.8.0+cu124 (CUDA 12.4), "
            "Triton 3.4.0, Python 3.12.11, enginelib at abc1234.") in text
    assert "| 13_quantization | 30 | passed | int4: triton; int8: triton | - | no | 0 |" in text
    assert "| 14_decode_without_overhead | 31 | passed | - | decode: (mode=default), attention in the " in text
    assert "| 16_going_further | 33 | passed | decode attention: triton | - | yes | 0 |" in text
    assert "## The chapters on the GPU in float16" in text and "- needs a C++ CPU (float32: 2, float16: 2)" in text
    assert "| int4 linear | float16 | M=1, 960x576 | 8.0 | 40.0 | 12.0 | 1.50x | 1.0e-03 | ok |" in text
    assert "| systems | decode attention: triton | - | no | 0 |" in text and "engine_vs_naive: 9.1" in text


def test_one_fallback_fails_the_check_and_the_report_names_it(run, tmp_path):
    """auto leaving out the Triton int4 kernel in chapter 13's float16 run: everything else passed."""
    rewrite(run / "chapters-float16.json", lambda rows: rows[0]["paths"].append(LEFT_OUT))
    problems = report_module.verdict(run)
    assert problems == ["chapter 13_quantization (float16): fell back: quant kernel int4 576x1536: asked for auto "
                        "(with triton), ran auto without it: it failed on int4 [576, 1536]: CompilationError: out "
                        "of shared memory"]
    report_module.report(tmp_path / "r.md", run)
    text = (tmp_path / "r.md").read_text()
    assert "Result: **FAILED (1 problem)**." in text and f"- {problems[0]}" in text
    assert "| 13_quantization | 30 | passed | int4: triton; int8: triton | - | no | 1 |" in text


def test_a_path_a_chapter_must_run_that_never_ran_fails_the_check(run):
    """Chapter 14 gone eager without a fallback event (a caller that checked availability and took another way)."""
    rewrite(run / "chapters-float32.json", lambda rows: rows[1]["paths"].clear())
    assert report_module.verdict(run) == ["chapter 14_decode_without_overhead (float32): compiled decode never ran "
                                          "(this run must show it on a GPU: MUST_RUN in .ci/gpu_report.py)"]


def test_failures_skips_and_missing_steps_each_fail_the_check(run, monkeypatch):
    (run / "tests-float32.xml").write_text(junit(40, failures=1))
    rewrite(run / "kernels.json", lambda rows: rows[1].update(ok=False, why="Triton cannot run here: no Triton"))
    rewrite(run / "chapters-float16.json", lambda rows: rows[2].update(ok=False, cell=40, error="ValueError: boom"))
    rewrite(run / "preflight.json", lambda rows: rows[0].update(unavailable="Triton is not installed"))
    (run / "bench.exit").write_text("2\n")
    (run / "bench.stderr").write_text("usage: ...\nerror: unrecognized arguments: --decode-kernel\n")
    (run / "paths" / "bench.jsonl").unlink()
    problems = report_module.verdict(run)
    assert problems == [
        "preflight: Triton kernels (float32) cannot run here: Triton is not installed",
        "unit tests (float32): 1 failed, 0 errors of 40",
        "unit tests (float32): tests.test_quant::test_bad_0: assert 1 == 2",
        "chapter 15_speculative_decoding (float16): failed at cell 40: ValueError: boom",
        "kernel micro-benchmark: decode attention 32 x 2048 keys float16: Triton cannot run here: no Triton",
        "quick benchmark: exit 2: error: unrecognized arguments: --decode-kernel",
        "quick benchmark: decode attention never ran (this run must show it on a GPU: MUST_RUN in .ci/gpu_report.py)"]
    (run / "chapters-float16.json").unlink()
    monkeypatch.setenv("GPU_CHECK_SKIP", "tests bench")
    assert report_module.verdict(run)[:2] == ["step bench skipped (GPU_CHECK_SKIP)",
                                              "step tests skipped (GPU_CHECK_SKIP)"]
    assert "chapters (float16): did not run" in report_module.verdict(run)


def test_a_t4_run_records_its_passed_chapters_float32_times_for_the_book(run, tmp_path):
    runtimes = tmp_path / "runtimes.json"
    runtimes.write_text(json.dumps({"cpu": {"01_model": {"seconds": 33}}, "t4": {}}))
    rewrite(run / "chapters-float32.json", lambda rows: rows[3].update(ok=False, cell=9, error="boom"))
    assert report_module.record_runtimes(run, runtimes) == 3
    times = json.loads(runtimes.read_text())
    assert times["cpu"] == {"01_model": {"seconds": 33}} and set(times["t4"]) == set(list(CHAPTER_PATHS)[:3])
    assert times["t4"]["13_quantization"] == {"seconds": 30, "dtype": "float32", "date": "2026-12-07",
                                                  "gpu": "Tesla T4", "torch": "2.8.0+cu124", "commit": "abc1234"}
    h100 = recorded_run(tmp_path / "h100", gpu="NVIDIA H100 80GB HBM3", half="bfloat16")
    assert report_module.record_runtimes(h100, tmp_path / "none.json") == 0 and not (tmp_path / "none.json").exists()
    assert report_module.half_dtype((7, 5)) == "float16" and report_module.half_dtype((9, 0)) == "bfloat16"


def test_the_kernel_benchmark_fails_a_row_whose_triton_kernel_cannot_run_raises_or_is_off(monkeypatch):
    from enginelib.speed import triton_kernels

    cpu = torch.device("cpu")
    monkeypatch.setattr(triton_kernels, "unavailable", lambda device=None, dtype=None: "hidden for this test")
    rows = (kernels_module.linear_rows(cpu, torch.float32, [(64, 64)], (1,))
            + kernels_module.attention_rows(cpu, torch.float32, [(2, 40)]))
    assert [(r.kernel, r.ok, r.why) for r in rows] == [
        (kernel, False, "Triton cannot run here: hidden for this test")
        for kernel in ("int8 linear", "int4 linear", "decode attention")]
    assert set(rows[0].us) == {"reference", "cuBLAS float"} and set(rows[2].us) == {"gather + SDPA"}  # timed still
    want = torch.ones(4, 8)

    def measured(triton_call) -> kernels_module.Row:
        row = kernels_module.Row("int8 linear", "M=4, 8x8", "float32", tolerance=1e-4)
        return kernels_module._measure(row, cpu, want, triton_call, None, {"reference": lambda: want})

    def raising() -> torch.Tensor:
        raise RuntimeError("out of resources")

    assert measured(lambda: want + 1e-6).ok
    off = measured(lambda: want * 1.01)
    assert not off.ok and off.why == "Triton's result is off: relative error 0.01 > 0.0001"
    assert measured(raising).why == "the Triton kernel raised RuntimeError: out of resources"


@pytest.mark.slow
def test_each_chapter_runs_in_a_kernel_of_its_own_and_its_paths_come_back(tmp_path, monkeypatch):
    """The chapters step on two stand-in notebooks: the kernel process records its paths into the chapter's own
    log (one fallback here), and a chapter that raises is reported with its cell and error, the next one run."""
    import nbformat

    for name in ("ENGINELIB_DTYPE", "ENGINELIB_PATHS_LOG"):  # chapters() sets them for its kernels: restored after
        monkeypatch.setenv(name, "")
    records = ("from enginelib.speed import paths\npaths.ran('decode attention', 'triton')\n"
               "paths.fell_back('compiled decode', 'torch.compile (mode=default)', 'eager', 'no Triton')")
    cells = {"12_first": [nbformat.v4.new_code_cell(records)],
             "13_second": [nbformat.v4.new_markdown_cell("# Two"),
                           nbformat.v4.new_code_cell("x = 1\nraise ValueError('boom')")]}
    for name, notebook_cells in cells.items():
        nbformat.write(nbformat.v4.new_notebook(cells=notebook_cells), tmp_path / f"{name}.ipynb")
    out = tmp_path / "gpu"
    assert report_module.chapters("float32", [str(tmp_path / f"{name}.ipynb") for name in cells], out) == 1
    first, second = json.loads((out / "chapters-float32.json").read_text())
    assert first["ok"] and [(e["what"], e["fallback"]) for e in first["paths"]] == [("decode attention", False),
                                                                                 ("compiled decode", True)]
    assert (second["ok"], second["cell"], second["source"], second["error"]) == (False, 1, "x = 1", "ValueError: boom")
    assert second["paths"] == []


INTERPRETED_BENCHMARK = """
import json, sys
sys.path.insert(0, ".")
from tests.test_triton import _fix_interpreter_loop_bounds
_fix_interpreter_loop_bounds()
import torch
from tests.test_gpu_check import kernels_module as k
from enginelib.speed import paths
k.time_us.__defaults__ = (2,)  # the interpreter is slow: two timed calls
cpu = torch.device("cpu")
rows = k.linear_rows(cpu, torch.float32, [(64, 64)], (1,)) + k.attention_rows(cpu, torch.float32, [(2, 40)])
print(json.dumps({"rows": [[r.kernel, r.ok, r.why] for r in rows], "paths": [e.what for e in paths.events()]}))
"""


@pytest.mark.slow
def test_the_kernel_benchmark_runs_the_real_kernels_under_tritons_interpreter():
    """Every Triton row passes against its reference with the shapes and arguments the GPU run uses, and the
    decode attention records that it ran (in a fresh process: the interpreter must be on before Triton loads)."""
    pytest.importorskip("triton", reason="Triton is not installed")
    run = subprocess.run([sys.executable, "-c", INTERPRETED_BENCHMARK], cwd=ROOT, capture_output=True, text=True,
                         timeout=600, env={**os.environ, "TRITON_INTERPRET": "1"}, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["rows"] == [["int8 linear", True, ""], ["int4 linear", True, ""], ["decode attention", True, ""]]
    assert got["paths"] == ["decode attention"]


def test_gpu_check_disable_triton_hides_it_from_enginelib_and_torch_compile():
    """What GPU_CHECK_DISABLE_TRITON=1 puts first on PYTHONPATH: every ``import triton`` fails, so the Triton
    kernels and torch.compile's GPU code generator both say they cannot run (and the check fails on it)."""
    code = ("from enginelib.speed import triton_kernels; from enginelib.speed.compiled import compile_unavailable; "
            "print(triton_kernels.unavailable('cuda')); print(compile_unavailable('cuda'))")
    hidden = os.pathsep.join([str(ROOT / ".ci" / "no_triton"), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": hidden}
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, env=env, timeout=300,
                         check=True)
    kernels, compiling = run.stdout.strip().splitlines()
    assert kernels.startswith("Triton is not installed (Triton is hidden by GPU_CHECK_DISABLE_TRITON=1")
    assert compiling.startswith("torch.compile on a GPU needs Triton")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: the check would run")
def test_without_a_gpu_the_check_exits_2_and_writes_nothing(tmp_path):
    report = tmp_path / "gpu_report.md"
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPU_CHECK_")}
    run = subprocess.run(["bash", str(ROOT / ".ci" / "gpu_check.sh"), str(report)], capture_output=True, text=True,
                         timeout=300, env=env, check=False)
    assert run.returncode == 2, run.stdout + run.stderr
    assert "NO GPU HERE" in run.stderr and "report not written" in run.stderr and not report.exists()
