"""gpu_check.sh's Python: the machine, the paths it can run, the chapters, the verdict and the Markdown report.

    python .ci/gpu_report.py machine                  # _build/gpu/machine.json; prints the GPU's half dtype
    python .ci/gpu_report.py preflight                # _build/gpu/preflight.json: can the GPU paths run here?
    python .ci/gpu_report.py chapters DTYPE NB...     # each chapter on a copy, its paths recorded (chapters-DTYPE.json)
    python .ci/gpu_report.py report OUT.md            # the verdict and the report: exit 1 unless everything passed
    python .ci/gpu_report.py runtimes                 # on a T4: the chapters' float32 times into book/runtimes.json

The check cannot pass on a silent fallback: each chapter and the benchmark run with ``$ENGINELIB_PATHS_LOG``, so
every path decision of enginelib (:mod:`enginelib.speed.paths`: the quantized kernels ``auto`` chose and the ones it
left out, the compiled decode and its CUDA graphs, the Triton decode attention) lands in a file per run, and
:func:`verdict` fails on any fallback there, on a path a chapter must run (:data:`MUST_RUN`) that never ran, on a
GPU path this machine cannot run at all (:func:`preflight`), on a failed test, chapter, kernel or benchmark, and on
a step that was skipped. tests/test_gpu_check.py runs :func:`verdict` and :func:`report` on a recorded fixture.
"""
from __future__ import annotations

import datetime
import importlib.util
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "_build" / "gpu"
STEPS = ("tests", "chapters", "kernels", "bench")  # what GPU_CHECK_SKIP may name

# The paths a run must show on a GPU, by what enginelib.speed.paths records them as: a chapter whose point is
# that path, gone eager or gathered without a fallback event (a caller that checked availability first and
# quietly took another way), fails here. Update it when a chapter changes what it runs on a GPU.
MUST_RUN = {
    "14_decode_without_overhead": ("compiled decode",),
    "15_speculative_decoding": ("compiled draft",),
    "16_going_further": ("decode attention",),
    "bench": ("decode attention",),  # the quick benchmark runs with --decode-kernel: the Triton kernel on
}


# ---------------------------------------------------------------- the machine and what it can run

def half_dtype(capability: tuple[int, int]) -> str:
    """The 16-bit dtype a GPU computes in natively: bfloat16 from compute capability 8.0, float16 before (a T4)."""
    return "bfloat16" if tuple(capability) >= (8, 0) else "float16"


def _run(command: list[str]) -> str:
    return subprocess.run(command, capture_output=True, text=True, cwd=ROOT).stdout.strip()


def triton_version() -> str:
    """Triton's installed version (from its metadata: it is read even while GPU_CHECK_DISABLE_TRITON hides it)."""
    from importlib import metadata

    try:
        return metadata.version("triton")
    except metadata.PackageNotFoundError:
        return "not installed"


def machine(out: Path = OUT) -> dict:
    """The GPU, its driver, torch, CUDA, Triton and the commit: the report's first line."""
    import torch

    props = torch.cuda.get_device_properties(0)
    capability = torch.cuda.get_device_capability(0)
    dirty = _run(["git", "status", "--porcelain", "--untracked-files=no"])
    driver = _run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]) if shutil.which(
        "nvidia-smi") else ""
    info = {"gpu": torch.cuda.get_device_name(0), "capability": f"{capability[0]}.{capability[1]}",
            "memory_gib": round(props.total_memory / 2**30, 1), "gpus": torch.cuda.device_count(),
            "driver": driver.splitlines()[0] if driver else None, "cuda": torch.version.cuda,
            "torch": torch.__version__, "triton": triton_version(), "python": platform.python_version(),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "commit": _run(["git", "rev-parse", "--short", "HEAD"]) + (" with uncommitted changes" if dirty else ""),
            "half": half_dtype(capability), "triton_disabled": bool(os.environ.get("GPU_CHECK_DISABLE_TRITON"))}
    (out / "machine.json").write_text(json.dumps(info, indent=1))
    return info


def preflight(out: Path = OUT) -> list[dict]:
    """Whether each GPU path can run here at all (None) or why not: the Triton kernels in float32 and the half
    dtype, and torch.compile. A path that cannot run would make every chapter quietly take the slow one."""
    import torch

    from enginelib.speed import triton_kernels
    from enginelib.speed.compiled import compile_unavailable

    half = half_dtype(torch.cuda.get_device_capability(0))
    rows = [{"path": f"Triton kernels ({dtype})",
             "unavailable": triton_kernels.unavailable("cuda", getattr(torch, dtype))} for dtype in ("float32", half)]
    rows.append({"path": "torch.compile on the GPU", "unavailable": compile_unavailable("cuda")})
    (out / "preflight.json").write_text(json.dumps(rows, indent=1))
    return rows


# ---------------------------------------------------------------- the chapters

def chapters(dtype: str, sources: list[str], out: Path = OUT) -> int:
    """Run each chapter's copy in ``dtype`` with .ci/execute_notebooks.py's executor, its paths logged to a file
    of its own (the kernel inherits the environment); record time, result, failing cell and paths."""
    from enginelib.speed.paths import read_log

    spec = importlib.util.spec_from_file_location("execute_notebooks", ROOT / ".ci" / "execute_notebooks.py")
    ex = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ex)
    running = {}

    class Recording(ex.NotebookClient):  # the same client and settings; keeps the notebook to find a failed cell
        def __init__(self, nb, *args, **kwargs):
            super().__init__(nb, *args, **kwargs)
            running["nb"] = nb

    ex.NotebookClient = Recording
    books, logs = out / f"book-{dtype}", out / "paths" / dtype
    books.mkdir(parents=True, exist_ok=True)
    logs.mkdir(parents=True, exist_ok=True)
    os.environ["ENGINELIB_DTYPE"] = dtype
    rows = []
    for source in sources:
        copy = books / Path(source).name
        copy.write_bytes(Path(source).read_bytes())
        log = (logs / Path(source).stem).with_suffix(".jsonl")
        log.unlink(missing_ok=True)
        os.environ["ENGINELIB_PATHS_LOG"] = str(log.resolve())
        print(f"executing {source} in {dtype} (a copy: {copy}) ...", flush=True)
        running.clear()
        begin = time.perf_counter()
        row = {"chapter": Path(source).stem, "dtype": dtype}
        try:
            ex.execute(copy)
            row["ok"] = True
        except Exception as error:  # the cell's error, a timeout, a dead kernel: reported, and the next chapter runs
            row |= {"ok": False, **failed_cell(running.get("nb"), error)}
            if running.get("nb") is not None:  # the executed part, with the error, for a look afterwards
                import nbformat

                nbformat.write(running["nb"], copy)
        row["seconds"] = round(time.perf_counter() - begin, 1)
        row["paths"] = [vars(e) for e in read_log(log)]
        fallbacks = sum(e["fallback"] for e in row["paths"])
        print(f"  {'passed' if row['ok'] else 'FAILED'} in {row['seconds']:.0f} s"
              + ("" if row["ok"] else f": cell {row.get('cell')}: {row['error']}")
              + (f"; {fallbacks} FALLBACK(S) from the requested path" if fallbacks else ""), flush=True)
        rows.append(row)
    (out / f"chapters-{dtype}.json").write_text(json.dumps(rows, indent=1))
    return 0 if all(r["ok"] for r in rows) else 1


def failed_cell(nb, error: Exception) -> dict:
    """The failing cell's index (as in the notebook's list of cells, 0-based), its first line, and the error."""
    found = {"cell": None, "error": f"{type(error).__name__}: {_first_line(error)}"}
    for index, cell in enumerate(nb.cells if nb is not None else []):
        for output in cell.get("outputs", []) if cell.cell_type == "code" else []:
            if output.get("output_type") == "error":
                code = [line for line in cell.source.splitlines() if line.strip() and not line.startswith("#")]
                found = {"cell": index, "source": (code or [""])[0],
                         "error": f"{output.get('ename')}: {_first_line(output.get('evalue', ''))}"}
    return found


def _first_line(text) -> str:
    lines = [line for line in re.sub(r"\x1b\[[0-9;]*m", "", str(text)).splitlines() if line.strip()]
    return (lines[0] if lines else "")[:300]


# ---------------------------------------------------------------- reading what ran

def tests_summary(xml: Path) -> dict:
    """pytest's junit XML: counts, the failed tests with their first line, and why tests were skipped."""
    if not xml.exists():
        return {"ran": False}
    suite = ET.parse(xml).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    count = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    failed, skipped = [], {}
    for case in suite.iter("testcase"):
        test = f"{case.get('classname', '')}::{case.get('name')}"  # e.g. tests.test_quant::test_round_trip
        for bad in [*case.findall("failure"), *case.findall("error")]:
            failed.append(f"{test}: {_first_line(bad.get('message', ''))}")
        for skip in case.findall("skipped"):
            why = _first_line(skip.get("message", ""))
            skipped[why] = skipped.get(why, 0) + 1
    return {"ran": True, **count, "passed": count["tests"] - count["failures"] - count["errors"] - count["skipped"],
            "seconds": round(float(suite.get("time", 0))), "failed": failed, "skip_reasons": skipped}


def paths_summary(events: list[dict]) -> dict[str, str]:
    """What a run's path events say, one cell each: the kernels, the compiled steps, CUDA graphs, fallbacks."""
    kernels: dict[str, set[str]] = {}
    compiled, graphs = [], "no"
    for e in events:
        if e["fallback"]:
            if e["what"] == "CUDA graphs":
                graphs = "**skipped**"
            continue
        if e["what"].startswith("quant kernel "):
            kernels.setdefault(e["what"].split()[2], set()).add(e["ran"])
        elif e["what"] == "decode attention":
            kernels.setdefault("decode attention", set()).add(e["ran"])
        elif e["what"] in ("compiled decode", "compiled draft"):
            compiled.append(f"{e['what'].removeprefix('compiled ')}: {e['ran'].removeprefix('torch.compile ')}")
        elif e["what"] == "CUDA graphs" and graphs == "no":
            graphs = "yes"
    return {"kernels": "; ".join(f"{k}: {', '.join(sorted(v))}" for k, v in sorted(kernels.items())) or "-",
            "compile": "; ".join(dict.fromkeys(compiled)) or "-", "graphs": graphs,
            "fallbacks": str(sum(e["fallback"] for e in events))}


def _fallback_lines(where: str, events: list[dict]) -> list[str]:
    return [f"{where}: fell back: {e['what']}{' (' + e['section'] + ')' if e['section'] else ''}: asked for "
            f"{e['requested']}, ran {e['ran']}: {e['why']}" for e in events if e["fallback"]]


def _missing_lines(where: str, name: str, events: list[dict]) -> list[str]:
    ran = {e["what"] for e in events if not e["fallback"]}
    return [f"{where}: {what} never ran (this run must show it on a GPU: MUST_RUN in .ci/gpu_report.py)"
            for what in MUST_RUN.get(name, ()) if what not in ran]


def _load(path: Path, default):
    return json.loads(path.read_text()) if path.exists() else default


def skipped_steps() -> set[str]:
    """The steps GPU_CHECK_SKIP named (a run with any skipped is not a passed check)."""
    return set(os.environ.get("GPU_CHECK_SKIP", "").split()) & set(STEPS)


def verdict(out: Path = OUT) -> list[str]:
    """Every problem of the run under ``out``, one line each (none: the check passed)."""
    from enginelib.speed.paths import read_log

    info = _load(out / "machine.json", {})
    problems = [f"step {step} skipped (GPU_CHECK_SKIP)" for step in sorted(skipped_steps())]
    problems += [f"preflight: {r['path']} cannot run here: {r['unavailable']}"
                 for r in _load(out / "preflight.json", [{"path": "preflight", "unavailable": "did not run"}])
                 if r["unavailable"]]
    dtypes = ("float32", info.get("half", "float16"))
    if "tests" not in skipped_steps():
        for dtype in dtypes:
            t = tests_summary(out / f"tests-{dtype}.xml")
            if not t["ran"]:
                problems.append(f"unit tests ({dtype}): did not run (no {out.name}/tests-{dtype}.xml)")
            elif t["failures"] or t["errors"] or not t["tests"]:
                problems.append(f"unit tests ({dtype}): {t['failures']} failed, {t['errors']} errors of {t['tests']}")
                problems += [f"unit tests ({dtype}): {f}" for f in t["failed"]]
    if "chapters" not in skipped_steps():
        for dtype in dtypes:
            rows = _load(out / f"chapters-{dtype}.json", None)
            if not rows:
                problems.append(f"chapters ({dtype}): did not run")
                continue
            for r in rows:
                where = f"chapter {r['chapter']} ({dtype})"
                if not r["ok"]:
                    problems.append(f"{where}: failed at cell {r.get('cell')}: {r['error']}")
                problems += _fallback_lines(where, r["paths"]) + _missing_lines(where, r["chapter"], r["paths"])
    if "kernels" not in skipped_steps():
        rows = _load(out / "kernels.json", None)
        if not rows:
            problems.append("kernel micro-benchmark: did not run")
        problems += [f"kernel micro-benchmark: {r['kernel']} {r['shape']} {r['dtype']}: {r['why']}"
                     for r in rows or [] if not r["ok"]]
    if "bench" not in skipped_steps():
        code = (out / "bench.exit").read_text().strip() if (out / "bench.exit").exists() else None
        if code != "0":
            last = [line for line in _load_text(out / "bench.stderr").splitlines() if line.strip()][-1:]
            problems.append(f"quick benchmark: {'did not run' if code is None else f'exit {code}'}"
                            + (f": {last[0][:300]}" if last else ""))
        events = [vars(e) for e in read_log(out / "paths" / "bench.jsonl")]
        problems += _fallback_lines("quick benchmark", events) + _missing_lines("quick benchmark", "bench", events)
    return problems


def _load_text(path: Path) -> str:
    return path.read_text() if path.exists() else ""


# ---------------------------------------------------------------- the report

def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def report(path: Path, out: Path = OUT) -> list[str]:
    """Write the Markdown report of the run under ``out`` to ``path``; return the verdict's problems."""
    from enginelib.speed.paths import read_log

    info = _load(out / "machine.json", {})
    problems = verdict(out)
    status = "passed" if not problems else f"FAILED ({len(problems)} problem{'s' * (len(problems) != 1)})"
    lines = [f"# GPU check: {info.get('gpu', 'unknown GPU')}", "",
             f"Run by `bash .ci/gpu_check.sh` on {info.get('date')}: {info.get('gpu')} (compute capability "
             f"{info.get('capability')}, {info.get('memory_gib')} GiB, driver {info.get('driver') or 'unknown'}), "
             f"torch {info.get('torch')} (CUDA {info.get('cuda')}), Triton {info.get('triton')}, Python "
             f"{info.get('python')}, enginelib at {info.get('commit')}."
             + (" Triton was hidden on purpose (`GPU_CHECK_DISABLE_TRITON=1`): this run shows the check failing "
                "on the fallbacks." if info.get("triton_disabled") else ""), "", f"Result: **{status}**.", ""]
    if problems:
        lines += ["What failed (a fallback is a path enginelib was asked to run and did not: "
                  "`enginelib/speed/paths.py`):", "", *[f"- {_cell(p)}" for p in problems], ""]
    lines += ["## What this GPU can run", "", "| path | here |", "|---|---|"]
    for r in _load(out / "preflight.json", []):
        lines.append(f"| {r['path']} | {'yes' if not r['unavailable'] else '**no**: ' + _cell(r['unavailable'])} |")
    dtypes = ("float32", info.get("half", "float16"))
    lines += ["", "## Unit tests on the GPU (`ENGINELIB_TEST_DEVICE=cuda`, the `tiny` model on the GPU too)", "",
              "| dtype | passed | failed | errors | skipped | seconds |", "|---|---|---|---|---|---|"]
    skips: dict[str, dict[str, int]] = {}  # why -> dtype -> tests
    for dtype in dtypes:
        t = tests_summary(out / f"tests-{dtype}.xml")
        if not t["ran"]:
            lines.append(f"| {dtype} | not run | | | | |")
            continue
        lines.append(f"| {dtype} | {t['passed']} | {t['failures']} | {t['errors']} | {t['skipped']} | {t['seconds']} |")
        for why, n in t["skip_reasons"].items():
            skips.setdefault(why, {})[dtype] = n
    if skips:
        lines += ["", "Skipped, and why:", "", *[f"- {_cell(why)} ({', '.join(f'{d}: {n}' for d, n in by.items())})"
                                                for why, by in sorted(skips.items())]]
    for dtype in dtypes:
        rows = _load(out / f"chapters-{dtype}.json", [])
        lines += ["", f"## The chapters on the GPU in {dtype}", "",
                  "| chapter | seconds | result | kernels | compiled | CUDA graphs | fallbacks |",
                  "|---|---|---|---|---|---|---|"]
        for r in rows:
            s = paths_summary(r["paths"])
            result = "passed" if r["ok"] else f"**failed** at cell {r.get('cell')}: {_cell(r['error'])}"
            lines.append(f"| {r['chapter']} | {r['seconds']:.0f} | {result} | {_cell(s['kernels'])} | "
                         f"{_cell(s['compile'])} | {s['graphs']} | {s['fallbacks']} |")
        if rows:
            total = sum(r["seconds"] for r in rows)
            lines.append(f"| **all {len(rows)}** | **{total:.0f}** ({total / 60:.1f} min) | "
                         f"{sum(r['ok'] for r in rows)} passed | | | | |")
        else:
            lines.append("| not run | | | | | | |")
    lines += ["", "Cells are numbered as in the notebook's list of cells, from 0, markdown included. Kernels: the "
              "quantized formats' kernels (`auto`'s choice or the one asked for) and the decode attention.", "",
              "## Kernel micro-benchmark (`.ci/gpu_kernels.py`), microseconds per call", "",
              "| kernel | dtype | shape | Triton | reference | cuBLAS / gather + SDPA | speed-up | error | result |",
              "|---|---|---|---|---|---|---|---|---|"]
    for r in _load(out / "kernels.json", []):
        us = r["us"]
        base = us.get("cuBLAS float", us.get("gather + SDPA"))
        speedup = f"{base / us['triton']:.2f}x" if "triton" in us and base else "-"
        lines.append(f"| {r['kernel']} | {r['dtype']} | {r['shape']} | {_us(us.get('triton'))} | "
                     f"{_us(us.get('reference'))} | {_us(base)} | {speedup} | "
                     f"{'-' if r['error'] is None else format(r['error'], '.1e')} | "
                     f"{'ok' if r['ok'] else '**failed**: ' + _cell(r['why'])} |")
    lines += ["", "Speed-up: cuBLAS on the float weight (linears) or the engine's gather + SDPA (attention) over "
              "Triton's time; above 1, Triton is faster.", "",
              "## The quick benchmark: `python -m enginelib.bench --quick --device cuda --decode-kernel`", ""]
    code = _load_text(out / "bench.exit").strip()
    if code:
        events = [vars(e) for e in read_log(out / "paths" / "bench.jsonl")]
        where = out.relative_to(ROOT) if out.is_relative_to(ROOT) else out
        lines += [f"{'passed' if code == '0' else f'**failed** (exit {code})'} in "
                  f"{_load_text(out / 'bench.seconds').strip() or '?'} s (log: `{where}/bench.stderr`, "
                  f"figures: `{where}/bench.json`). Paths by section:", "",
                  "| section | kernels | compiled | CUDA graphs | fallbacks |", "|---|---|---|---|---|"]
        for name in dict.fromkeys(e["section"] for e in events):
            s = paths_summary([e for e in events if e["section"] == name])
            lines.append(f"| {_cell(name or '(whole run)')} | {_cell(s['kernels'])} | {_cell(s['compile'])} | "
                         f"{s['graphs']} | {s['fallbacks']} |")
        if not events:
            lines.append("| (none recorded) | | | | |")
        text = _load_text(out / "bench.log")
        summary = text[text.rfind("\nratios") + 1:] if "\nratios" in text else text[-3000:]  # "ratios (on CPU): ..."
        lines += ["", "Its summary:", "", "```", summary.rstrip(), "```"]
    else:
        lines.append("not run")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return problems


def _us(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def record_runtimes(out: Path = OUT, runtimes: Path = ROOT / "book" / "runtimes.json") -> int:
    """On a T4 (the reader's Colab GPU), each passed chapter's float32 time into ``runtimes``' "t4" part, which
    .ci/sync_notebooks.py writes into the chapters' boxes and the README; returns the chapters recorded."""
    info = _load(out / "machine.json", {})
    if "T4" not in info.get("gpu", ""):
        return 0
    times = _load(runtimes, {"cpu": {}, "t4": {}})
    recorded = 0
    for r in _load(out / "chapters-float32.json", []):
        if r["ok"]:
            times.setdefault("t4", {})[r["chapter"]] = {
                "seconds": round(r["seconds"]), "dtype": "float32", "date": info["date"][:10], "gpu": info["gpu"],
                "torch": info["torch"], "commit": info["commit"]}
            recorded += 1
    runtimes.write_text(json.dumps(times, indent=1, sort_keys=True) + "\n")
    return recorded


def main(argv: list[str]) -> int:
    command, args = argv[0], argv[1:]
    if command == "machine":
        print(machine()["half"])
        return 0
    if command == "preflight":
        rows = preflight()
        for r in rows:
            print(f"  {r['path']}: {'yes' if not r['unavailable'] else 'NO: ' + r['unavailable']}")
        return 1 if any(r["unavailable"] for r in rows) else 0
    if command == "chapters":
        return chapters(args[0], args[1:])
    if command == "report":
        problems = report(Path(args[0]))
        print(f"wrote {args[0]}: " + ("everything passed" if not problems else f"{len(problems)} problem(s):"))
        for p in problems:
            print(f"  - {p}")
        return 1 if problems else 0
    if command == "runtimes":
        n = record_runtimes()
        print(f"book/runtimes.json: the T4 times of {n} chapters" + (
            "; run python .ci/sync_notebooks.py to put them in the chapters' boxes and the README" if n else
            " (only a T4's are recorded: the book's reader runs Colab's)"))
        return 0
    raise SystemExit(f"unknown command {command!r}: machine, preflight, chapters, report or runtimes")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
