"""llama.cpp's own benchmark tools as the peer: ``llama-bench`` for single-stream decode, ``llama-batched-bench``
for 32 sequences, on the same GGUF file and thread count, with the flags they were built with; of several
builds (``--llama-cpp-bin`` given more than once), the fastest at each batch size.

llama-cpp-python's build is one build among many: on one Intel Xeon its
``GGML_NATIVE`` build (AMX, VNNI repacked weights) decoded 2.8x faster than an
AVX-512 build without AMX, and a ratio against the slower one flattered us.
``.ci/build_llama_cpp.sh`` builds both tools from the llama.cpp that the pinned
llama-cpp-python vendors; ``python -m enginelib.bench --llama-cpp-bin DIR``
runs them here (:func:`run_tools`) and reports their figures beside ours,
with the build's flags (:func:`build_flags`) and the CPU named. The tools run
as child processes: a crash is reported like the in-process peer's.
"""
from __future__ import annotations

import collections
import json
import os
import re
import signal
import statistics
import subprocess
from collections.abc import Callable
from pathlib import Path

NAME = "llama_cpp_bin"
TOOLS = ("llama-bench", "llama-batched-bench")
BATCH = 32
# The CMake options that say what a ggml CPU build computes with.
_CMAKE_FLAG = re.compile(r"^(GGML_(?:NATIVE|AVX\w*|AMX\w*|FMA|F16C|BMI2|SSE42|CPU_REPACK|OPENMP|LLAMAFILE|"
                         r"CPU_ALL_VARIANTS|BACKEND_DL|CUDA|METAL|BLAS)):\w+=(.*)$")


def tools_missing(bin_dir: Path) -> str | None:
    """Why ``bin_dir`` cannot serve as ``--llama-cpp-bin`` (None when both tools are there and executable)."""
    missing = [t for t in TOOLS if not os.access(Path(bin_dir) / t, os.X_OK) or not (Path(bin_dir) / t).is_file()]
    if missing:
        return (f"{bin_dir} has no {' or '.join(missing)} it can run: build them with `bash .ci/build_llama_cpp.sh` "
                f"and pass the directory it prints")
    return None


def parse_llama_bench(text: str) -> list[dict]:
    """``llama-bench -o json``'s records (one per test: flash attention off and on here)."""
    records = json.loads(text)
    if not isinstance(records, list) or not records:
        raise ValueError(f"llama-bench printed no test records: {text[:200]!r}")
    return records


def parse_batched_bench(text: str) -> list[dict]:
    """``llama-batched-bench --output-format jsonl``'s records, one per (prompt, generated, batch) point.

    The tool logs other lines to the same stream (its settings, a blank line):
    only lines that are JSON objects count.
    """
    records = [json.loads(line) for line in text.splitlines() if line.startswith("{")]
    if not records:
        raise ValueError(f"llama-batched-bench printed no JSON lines: {text[:200]!r}")
    return records


# What the compiler defines for the ggml CPU backend's flags, named as ggml's own system_info names them: ggml
# picks its kernels with these very macros (#if defined(__AVX512VNNI__) ...), so they are what the build computes with.
DEFINES = {"__AVX__": "AVX", "__AVX2__": "AVX2", "__FMA__": "FMA", "__F16C__": "F16C", "__AVXVNNI__": "AVX_VNNI",
           "__AVX512F__": "AVX512", "__AVX512VBMI__": "AVX512_VBMI", "__AVX512VNNI__": "AVX512_VNNI",
           "__AVX512BF16__": "AVX512_BF16", "__AVX512FP16__": "AVX512_FP16", "__AMX_TILE__": "AMX_TILE",
           "__AMX_INT8__": "AMX_INT8", "__AMX_BF16__": "AMX_BF16", "__ARM_NEON": "NEON",
           "__ARM_FEATURE_DOTPROD": "DOTPROD", "__ARM_FEATURE_MATMUL_INT8": "MATMUL_INT8", "__ARM_FEATURE_SVE": "SVE"}
_ISA_FLAG = re.compile(r"^-(?:march|mcpu|mtune)=\S+$|^-m(?:avx|fma|f16c|amx|sse|bmi|f16|no-)\S*$")


def build_dir(bin_dir: Path) -> Path | None:
    """The CMake build tree ``bin_dir`` came from: where ``CMakeCache.txt`` is, ``bin_dir`` or one or two up."""
    for d in (Path(bin_dir), Path(bin_dir).parent, Path(bin_dir).parent.parent):
        if (d / "CMakeCache.txt").is_file():
            return d
    return None


def cmake_cache(build: Path | None) -> dict[str, str]:
    """The ggml options (and the C++ compiler) of the build: ``{"GGML_NATIVE": "ON", ...}``."""
    if build is None:
        return {}
    flags = {}
    for line in (build / "CMakeCache.txt").read_text(errors="replace").splitlines():
        m = _CMAKE_FLAG.match(line)
        if m:
            flags[m.group(1)] = m.group(2)
        elif line.startswith("CMAKE_CXX_COMPILER:"):
            flags["CMAKE_CXX_COMPILER"] = line.partition("=")[2]
    return flags


def isa_flags(build: Path | None) -> list[str]:
    """The instruction-set flags ggml's CPU backend was compiled with (``-march=native``, ``-mavx512f``, ...),
    from its ``flags.make``; empty where the tree has none (another generator, or a multi-variant build)."""
    flags_make = build / "ggml" / "src" / "CMakeFiles" / "ggml-cpu.dir" / "flags.make" if build else None
    if flags_make is None or not flags_make.is_file():
        return []
    for line in flags_make.read_text(errors="replace").splitlines():
        if line.startswith("CXX_FLAGS"):
            return [f for f in line.partition("=")[2].split() if _ISA_FLAG.match(f)]
    return []


def parse_defines(text: str) -> dict[str, str]:
    """``cc -dM -E``'s ``#define`` lines for :data:`DEFINES`, as ``{"AVX512_VNNI": "1", ...}``."""
    defined = {parts[1] for parts in map(str.split, text.splitlines()) if len(parts) >= 2 and parts[0] == "#define"}
    return {name: "1" for macro, name in DEFINES.items() if macro in defined}  # in DEFINES' order, narrow to wide


def compiled_features(compiler: str | None, flags: list[str]) -> dict[str, str]:
    """What ``flags`` turn on, asked of the build's own compiler (``-dM -E``): for ``-march=native``, this
    machine's instruction sets, right where the tools were built here (as .ci/build_llama_cpp.sh does)."""
    if not compiler or not flags:
        return {}
    try:
        out = subprocess.run([compiler, *flags, "-dM", "-E", "-x", "c++", "-"], input="", capture_output=True,
                             text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as err:  # the compiler is gone: the report says features unknown
        return {"unknown": f"{compiler}: {err}"}
    return parse_defines(out.stdout) if out.returncode == 0 else {"unknown": out.stderr.strip()[-200:]}


def build_flags(cmake: dict[str, str], isa: list[str], compiled: dict[str, str]) -> str:
    """One line for the report: the CMake options turned on, the ISA flags, and what they compiled in.

    ``GGML_NATIVE=ON`` leaves the per-ISA CMake options OFF (``-march=native``
    picks them), so what the compiler turns on for the flags is what says
    AVX-512 or AMX.
    """
    on = [f"{k}={v}" for k, v in cmake.items()
          if k.startswith("GGML_") and (k == "GGML_NATIVE" or v.upper() in ("ON", "1", "TRUE"))]
    parts = [" ".join(on) if on else "CMake options unknown (no CMakeCache.txt beside the tools)"]
    if isa:
        features = [k for k, v in compiled.items() if v == "1"]
        parts.append(f"{' '.join(isa)}: {' '.join(features) if features else 'features unknown'}")
    return "; ".join(parts)


class ToolFailed(RuntimeError):
    """A tool died on a signal, exited with an error or printed nothing we can read: the report says which."""


def _run(cmd: list[str], timeout: float) -> subprocess.CompletedProcess:
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if out.returncode:
        how = f"exited with code {out.returncode}"
        if out.returncode < 0:
            how = f"crashed: signal {-out.returncode}"
            try:
                how += f" ({signal.Signals(-out.returncode).name})"
            except ValueError:
                how += " (no name on this OS)"
        tail = "\n".join((out.stderr or out.stdout).strip().splitlines()[-5:])
        raise ToolFailed(f"{Path(cmd[0]).name} {how}: {tail}")
    return out


def run_tools(bin_dir: Path, gguf: Path, threads: int, quick: bool, timeout: float = 600) -> dict:
    """llama-bench (``-n 64 -p 0``, flash attention off and on) and llama-batched-bench (batch 1 and 32),
    on ``gguf`` with ``threads`` threads: single-stream and batch-32 decode tok/s, the best of each.

    Batch 32: 32 sequences, each its own 64-token prompt (prefilled, not
    counted), then 32 tokens each (8 quick); ``speed_tg`` is their tokens over
    the generation time, what our batch-32 decode figure counts.
    """
    bin_dir, gguf = Path(bin_dir), Path(gguf)
    reps, tg32 = ("2", 8) if quick else ("5", 32)
    bench = _run([str(bin_dir / "llama-bench"), "-m", str(gguf), "-t", str(threads), "-p", "0", "-n", "64",
                  "-fa", "0,1", "-r", reps, "-o", "json"], timeout)
    try:
        single = parse_llama_bench(bench.stdout)
    except ValueError as err:  # json's errors are ValueErrors too
        raise ToolFailed(f"llama-bench printed no JSON we can read: {err}") from err
    pp, points, batched_failed = 64, [], None
    try:  # one build's llama-batched-bench crashing (the AMX build on one Xeon) still leaves its single stream
        batched = _run([str(bin_dir / "llama-batched-bench"), "-m", str(gguf), "-t", str(threads), "-tb",
                        str(threads), "-c", str(BATCH * (pp + tg32) + 256), "-b", "2048", "-ub", "512", "-npp",
                        str(pp), "-ntg", str(tg32), "-npl", f"1,{BATCH}", "--output-format", "jsonl"], timeout)
        points = parse_batched_bench(batched.stdout)
    except (ToolFailed, subprocess.TimeoutExpired, ValueError) as err:
        batched_failed = str(err)
    build = build_dir(bin_dir)
    cmake, isa = cmake_cache(build), isa_flags(build)
    try:
        figures = tool_figures(single, points, cmake, isa, compiled_features(cmake.get("CMAKE_CXX_COMPILER"), isa))
    except (ValueError, KeyError) as err:  # a record without the fields this llama.cpp version prints
        raise ToolFailed(f"llama.cpp's tools printed what we cannot read: {type(err).__name__}: {err}") from err
    return figures | {"bin": str(bin_dir), "batched_failed": batched_failed, "batched_build": figures["build"],
                      "batched_bin": str(bin_dir) if figures["decode_b32_tok_per_s"] else None}


def run_builds(bin_dirs: list[Path], gguf: Path, threads: int, quick: bool, timeout: float = 600) -> dict:
    """:func:`run_tools` on each build: llama.cpp at its best is the fastest build at each batch size (a build
    whose tools crash or print nothing readable is listed with the reason, as long as one build gives figures).

    The single stream's figures come from the build fastest at it; batch 32's
    (``decode_b32_tok_per_s``, ``batched_test``, ``batched_build``) from the
    build fastest at 32 sequences, which may be another; ``builds`` lists each.
    """
    runs, failed = [], []
    for bin_dir in bin_dirs:
        try:
            runs.append(run_tools(bin_dir, gguf, threads, quick, timeout))
        except (ToolFailed, subprocess.TimeoutExpired) as err:
            failed.append({"bin": str(bin_dir), "failed": str(err)})
    if not runs:
        raise ToolFailed("; ".join(f"{f['bin']}: {f['failed']}" for f in failed))
    best = max(runs, key=lambda r: r["single_stream_tok_per_s"])
    batched = max(runs, key=lambda r: r["decode_b32_tok_per_s"] or 0)
    builds = [{k: r[k] for k in ("bin", "build", "single_stream_tok_per_s", "decode_b32_tok_per_s",
                                 "batched_failed")} for r in runs] + failed
    return best | {k: batched[k] for k in ("decode_b32_tok_per_s", "batched_b1_tok_per_s", "batched_test",
                                           "batched_build", "batched_bin")} | {"builds": builds}


def tg_tok_per_s(record: dict) -> float:
    """A llama-bench test's tok/s: the median of its repetitions (``samples_ts``), as our side takes the median
    step: on a shared machine one repetition slowed by another process (measured here: 6 tok/s among 140s)
    moves llama-bench's own mean (``avg_ts``) far more than the median."""
    samples = record.get("samples_ts") or [record["avg_ts"]]
    return statistics.median(samples)


def tool_figures(single: list[dict], points: list[dict], cmake: dict[str, str], isa: list[str],
                 compiled: dict[str, str]) -> dict:
    """The figures the report compares: single-stream tok/s (llama-bench's best test at n_gen > 0, by
    :func:`tg_tok_per_s`, and each flash-attention setting's), batch-32 decode tok/s (``speed_tg`` at
    pl=32) and batch 1's from the same tool, and the build."""
    tg = [r for r in single if r.get("n_gen", 0) > 0 and r.get("n_prompt", 0) == 0]
    if not tg:
        raise ValueError("llama-bench printed no generation-only test (-p 0 -n N)")
    best = max(tg, key=tg_tok_per_s)
    b32 = [p for p in points if p["pl"] == BATCH]
    b1 = [p for p in points if p["pl"] == 1]
    return {"single_stream_tok_per_s": tg_tok_per_s(best), "single_stream_mean": best["avg_ts"],
            "single_stream_stddev": best.get("stddev_ts"), "single_stream_samples": best.get("samples_ts"),
            "single_stream_by_flash_attn": {str(r.get("flash_attn")): tg_tok_per_s(r) for r in tg},
            "single_stream_test": f"llama-bench tg{best['n_gen']}",
            "decode_b32_tok_per_s": max(p["speed_tg"] for p in b32) if b32 else None,
            "batched_b1_tok_per_s": max(p["speed_tg"] for p in b1) if b1 else None,
            "batched_test": (f"llama-batched-bench pp{b32[0]['pp']} tg{b32[0]['tg']} B{BATCH}" if b32 else None),
            "threads": best.get("n_threads"), "build_commit": best.get("build_commit"),
            "cpu_info": best.get("cpu_info"),
            "backends": best.get("backends"), "model_type": best.get("model_type"),
            "cmake": cmake, "isa_flags": isa, "compiled": compiled, "build": build_flags(cmake, isa, compiled)}


FAST_TOKENS = 64  # tokens a run of our fastest single stream decodes against the tools: llama-bench's tg64


def tools_effect(measure: Callable[[], dict], engine_step: Callable[[int, int], float], quick: bool,
                 rounds: int = 2, fast_step: Callable[[int, int], float] | None = None,
                 fast_b32_step: Callable[[int, int], float] | None = None) -> dict:
    """Our single-stream and batch-32 decode against llama.cpp's tools, alternated ``rounds`` times, best of each.

    ``measure()`` runs the tools once (:func:`run_tools`); ``engine_step``,
    ``fast_step`` and ``fast_b32_step`` are the engine's median decode step
    at (batch, new tokens), as in :func:`llama_cpp.llama_cpp_effect`, whose
    figure names this returns, so the report compares them the same way.
    """
    new1, new32 = (16, 8) if quick else (64, 32)
    figures: dict[str, list[float]] = collections.defaultdict(list)
    tools = None
    for _ in range(rounds):
        figures["engine_b1"].append(1 / engine_step(1, new1))
        figures["engine_b32"].append(BATCH / engine_step(BATCH, new32))
        if fast_step is not None:  # as llama-bench runs: a warm-up run, then 64 tokens, the better of two runs
            # (its flash attention off and on), each run's median step. The warm-up brings the weights back into
            # the caches the float32 runs above filled (on the Xeon, whose L3 holds them, it took many steps)
            fast_step(1, FAST_TOKENS)
            figures["fast_b1"].append(max(1 / fast_step(1, FAST_TOKENS) for _ in range(2)))
        if fast_b32_step is not None:
            figures["fast_b32"].append(BATCH / fast_b32_step(BATCH, new32))
        run = measure()
        figures["tool_b1"].append(run["single_stream_tok_per_s"])
        if run["decode_b32_tok_per_s"] is not None:
            figures["tool_b32"].append(run["decode_b32_tok_per_s"])
        if tools is None or run["single_stream_tok_per_s"] > tools["single_stream_tok_per_s"]:
            tools = run
    best = {k: max(v) for k, v in figures.items()}
    b1, b32 = best["tool_b1"], best.get("tool_b32")

    def ratio(key: str, theirs: float | None) -> float | None:
        return best[key] / theirs if key in best and theirs else None

    return tools | {
        "single_stream_tok_per_s": b1, "decode_b32_tok_per_s": b32, "rounds": rounds,
        "single_stream_runs": figures["tool_b1"], "decode_b32_runs": figures.get("tool_b32", []),
        "engine_single_stream_tok_per_s": best["engine_b1"], "single_stream_ratio": ratio("engine_b1", b1),
        "engine_decode_b32_tok_per_s": best["engine_b32"], "decode_b32_ratio": ratio("engine_b32", b32),
        "fast_single_stream_tok_per_s": best.get("fast_b1"), "fast_single_stream_ratio": ratio("fast_b1", b1),
        "fast_decode_b32_tok_per_s": best.get("fast_b32"), "fast_decode_b32_ratio": ratio("fast_b32", b32),
        "decode_tokens": new1, "decode_tokens_b32": new32, "fast_decode_tokens": FAST_TOKENS}
