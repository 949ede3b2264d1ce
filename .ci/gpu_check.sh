#!/usr/bin/env bash
# The GPU check: what a maintainer with an NVIDIA GPU runs, then commits the report of (issue 27).
#
#     bash .ci/gpu_check.sh                      # writes _build/gpu_report.md
#     bash .ci/gpu_check.sh book/gpu_results.md  # or the report where you say
#
# 1. the unit tests on the GPU (ENGINELIB_TEST_DEVICE=cuda, see tests/conftest.py), in float32, then again with
#    ENGINELIB_DTYPE=float16;
# 2. every chapter (book/[0-9]*.ipynb) run top to bottom on the GPU, in float32 as a Colab reader runs it, by
#    .ci/execute_notebooks.py on copies under _build/gpu/book/ (the committed notebooks and their CPU outputs
#    are never touched): each chapter's wall time, and for a failure its cell and error line;
# 3. the quick benchmark: python -m enginelib.bench --quick --device cuda;
# then a markdown report: the GPU's name, the date, torch's version, the test summary, each chapter's time and
# result, the benchmark's summary. Logs and the executed copies stay in _build/gpu/.
#
# Exit status: 0 when everything passed, 1 when something failed (the report says what), 2 when this machine
# has no CUDA device (nothing is run). Environment:
#   GPU_CHECK_TESTS     what pytest runs (default: tests, without the browser test and the Colab rehearsal,
#                       which do not touch the GPU)
#   GPU_CHECK_CHAPTERS  the chapters to run (default: every book/[0-9]*.ipynb)
#   GPU_CHECK_SKIP      steps to skip, e.g. "tests" or "tests bench"
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
REPORT=${1:-_build/gpu_report.md}
OUT=_build/gpu
export PYTHONUNBUFFERED=1
start=$SECONDS
step() { echo; echo "== $1 ($((SECONDS - start)) s)"; }
skipped() { [[ " ${GPU_CHECK_SKIP:-} " == *" $1 "* ]]; }

step "is there a CUDA device?"
if ! python3 - <<'PY'
import sys
import torch

if not torch.cuda.is_available():
    why = ("this torch has no CUDA support (a CPU-only build)" if torch.version.cuda is None
           else "no CUDA device is visible (no GPU, no driver, or CUDA_VISIBLE_DEVICES hides it)")
    print(f"gpu_check: NO GPU HERE: torch {torch.__version__}: torch.cuda.is_available() is False: {why}.\n"
          "Nothing was run. Run this script on a machine with an NVIDIA GPU and a CUDA build of torch "
          "(Colab's T4 runtime will do).", file=sys.stderr)
    sys.exit(2)
print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__} (CUDA {torch.version.cuda})")
PY
then
  echo "gpu_check: no CUDA device: stopped, report not written" >&2
  exit 2
fi

rm -rf "$OUT" && mkdir -p "$OUT/book" "$(dirname "$REPORT")"
HELPER=$(mktemp -t gpu_check.XXXXXX.py)
trap 'rm -f "$HELPER"' EXIT
cat > "$HELPER" <<'PY'
"""gpu_check.sh's Python: the machine, the chapters, the report (subcommands machine, chapters, report)."""
import datetime
import importlib.util
import json
import platform
import re
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT, OUT = Path.cwd(), Path("_build/gpu")


def machine() -> None:
    import torch

    props = torch.cuda.get_device_properties(0)
    git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                           text=True).stdout.strip()
    driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                            capture_output=True, text=True).stdout.strip() if _which("nvidia-smi") else ""
    info = {"gpu": torch.cuda.get_device_name(0), "capability": ".".join(map(str, torch.cuda.get_device_capability(0))),
            "memory_gib": round(props.total_memory / 2**30, 1), "gpus": torch.cuda.device_count(),
            "driver": driver.splitlines()[0] if driver else None, "cuda": torch.version.cuda,
            "torch": torch.__version__, "python": platform.python_version(),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "commit": git + (" with uncommitted changes" if dirty else "")}
    (OUT / "machine.json").write_text(json.dumps(info, indent=1))


def _which(name: str) -> bool:
    import shutil

    return shutil.which(name) is not None


def chapters(paths: list[str]) -> int:
    """Run each chapter's copy with .ci/execute_notebooks.py's own executor; record time, result, failing cell."""
    spec = importlib.util.spec_from_file_location("execute_notebooks", ROOT / ".ci" / "execute_notebooks.py")
    ex = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ex)
    running = {}

    class Recording(ex.NotebookClient):  # the same client and settings; keeps the notebook to find a failed cell
        def __init__(self, nb, *args, **kwargs):
            super().__init__(nb, *args, **kwargs)
            running["nb"] = nb

    ex.NotebookClient = Recording
    rows = []
    for source in paths:
        copy = OUT / "book" / Path(source).name
        copy.write_bytes(Path(source).read_bytes())
        print(f"executing {source} (a copy: {copy}) ...", flush=True)
        running.clear()
        begin = time.perf_counter()
        row = {"chapter": Path(source).name}
        try:
            ex.execute(copy)
            row["ok"] = True
        except Exception as error:  # the cell's error, a timeout, a dead kernel: reported, and the next chapter runs
            row |= {"ok": False, **failed_cell(running.get("nb"), error)}
            if running.get("nb") is not None:  # the executed part, with the error, for a look afterwards
                import nbformat

                nbformat.write(running["nb"], copy)
        row["seconds"] = round(time.perf_counter() - begin, 1)
        print(f"  {'passed' if row['ok'] else 'FAILED'} in {row['seconds']:.0f} s"
              + ("" if row["ok"] else f": cell {row.get('cell')}: {row['error']}"), flush=True)
        rows.append(row)
    (OUT / "chapters.json").write_text(json.dumps(rows, indent=1))
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


def tests_summary(xml: Path) -> dict:
    if not xml.exists():
        return {"ran": False}
    suite = ET.parse(xml).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    count = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    failed = []
    for case in suite.iter("testcase"):
        for bad in [*case.findall("failure"), *case.findall("error")]:
            test = f"{case.get('classname', '')}::{case.get('name')}"  # e.g. tests.test_quant::test_round_trip
            failed.append(f"{test}: {_first_line(bad.get('message', ''))}")
    return {"ran": True, **count, "passed": count["tests"] - count["failures"] - count["errors"] - count["skipped"],
            "seconds": round(float(suite.get("time", 0))), "failed": failed}


def report(path: str, status: str) -> None:
    info = json.loads((OUT / "machine.json").read_text())
    lines = [f"# GPU check: {info['gpu']}", "",
             f"Run by `bash .ci/gpu_check.sh` on {info['date']}: {info['gpu']} (compute capability "
             f"{info['capability']}, {info['memory_gib']} GiB{', driver ' + info['driver'] if info['driver'] else ''}),"
             f" torch {info['torch']} (CUDA {info['cuda']}), Python {info['python']}, enginelib at {info['commit']}.",
             f"Result: **{status}**.", "", "## Unit tests on the GPU (`ENGINELIB_TEST_DEVICE=cuda`)", "",
             "| dtype | passed | failed | errors | skipped | seconds |", "|---|---|---|---|---|---|"]
    failures = []
    for dtype in ("float32", "float16"):
        t = tests_summary(OUT / f"tests-{dtype}.xml")
        if not t["ran"]:
            lines.append(f"| {dtype} | not run | | | | |")
            continue
        lines.append(f"| {dtype} | {t['passed']} | {t['failures']} | {t['errors']} | {t['skipped']} | {t['seconds']} |")
        failures += [f"- {dtype}: `{f.split(': ', 1)[0]}`: {f.split(': ', 1)[-1]}" for f in t["failed"]]
    lines += ["", *(["Failed:", "", *failures, ""] if failures else [])]
    lines += ["## The chapters, executed on the GPU (float32)", "",
              "| chapter | seconds | result | failing cell | error |", "|---|---|---|---|---|"]
    rows = json.loads((OUT / "chapters.json").read_text()) if (OUT / "chapters.json").exists() else []
    for r in rows:
        source = r.get("source", "")[:60].replace("|", "\\|")
        cell = "" if r["ok"] else (f"{r['cell']} (`{source}`)" if r.get("cell") is not None else "?")
        error = "" if r["ok"] else r["error"].replace("|", "\\|")
        lines.append(f"| {r['chapter']} | {r['seconds']:.0f} | {'passed' if r['ok'] else '**failed**'} | {cell} | {error} |")
    if rows:
        total = sum(r["seconds"] for r in rows)
        lines.append(f"| **all {len(rows)}** | **{total:.0f}** ({total / 60:.1f} min) | "
                     f"{sum(r['ok'] for r in rows)} passed | | |")
    else:
        lines.append("| not run | | | | |")
    lines += ["", "Cells are numbered as in the notebook's list of cells, from 0, markdown included.", "",
              "## The quick benchmark: `python -m enginelib.bench --quick --device cuda`", ""]
    log = OUT / "bench.log"
    if log.exists():
        text = log.read_text()
        summary = text[text.rfind("\nratios:") + 1:] if "\nratios:" in text else text[-3000:]
        seconds = (OUT / "bench.seconds").read_text().strip() if (OUT / "bench.seconds").exists() else "?"
        status_line = (OUT / "bench.status").read_text().strip() if (OUT / "bench.status").exists() else "?"
        lines += [f"{status_line}, {seconds} s. Its summary (the full JSON: `{OUT}/bench.json`):", "", "```",
                  summary.rstrip(), "```"]
    else:
        lines.append("not run")
    Path(path).write_text("\n".join(lines) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    command, args = sys.argv[1], sys.argv[2:]
    if command == "machine":
        machine()
    elif command == "chapters":
        sys.exit(chapters(args))
    elif command == "report":
        report(*args)
PY

python3 "$HELPER" machine || exit 1
failed=0

# Unit tests on the GPU. The browser test and the Colab rehearsal run no GPU code; CI covers them.
read -r -a tests <<< "${GPU_CHECK_TESTS:-tests --ignore=tests/test_site.py --deselect=tests/test_colab.py::test_colab_rehearsal}"
for dtype in float32 float16; do
  if skipped tests; then break; fi
  step "unit tests on the GPU, $dtype: ENGINELIB_TEST_DEVICE=cuda ENGINELIB_DTYPE=$dtype pytest ${tests[*]}"
  ENGINELIB_TEST_DEVICE=cuda ENGINELIB_DTYPE=$dtype python3 -m pytest -q -rfE "${tests[@]}" \
    --junitxml="$OUT/tests-$dtype.xml" 2>&1 | tee "$OUT/tests-$dtype.log" | tail -n 40
  [ "${PIPESTATUS[0]}" -eq 0 ] || failed=1
done

if ! skipped chapters; then
  # shellcheck disable=SC2206  # a list of paths, split on spaces
  chapters=(${GPU_CHECK_CHAPTERS:-book/[0-9]*.ipynb})
  step "every chapter on the GPU (${#chapters[@]}), in float32, on copies in $OUT/book"
  env -u ENGINELIB_DTYPE -u ENGINELIB_TEST_DEVICE python3 "$HELPER" chapters "${chapters[@]}" 2>&1 \
    | tee "$OUT/chapters.log" | grep -v "Kernel is running over TCP"
  [ "${PIPESTATUS[0]}" -eq 0 ] || failed=1
fi

if ! skipped bench; then
  step "the quick benchmark: python -m enginelib.bench --quick --device cuda"
  bench_start=$SECONDS
  python3 -m enginelib.bench --quick --device cuda --json "$OUT/bench.json" > "$OUT/bench.log" 2> "$OUT/bench.stderr"
  code=$?
  echo $((SECONDS - bench_start)) > "$OUT/bench.seconds"
  if [ $code -eq 0 ]; then echo "passed" > "$OUT/bench.status"; else
    last=$(grep -v '^[[:space:]]*$' "$OUT/bench.stderr" | tail -n 1 | tr -d '`|')
    echo "**failed** (exit $code${last:+: \`$last\`}; its log: $OUT/bench.stderr)" > "$OUT/bench.status"
    failed=1
  fi
  tail -n 12 "$OUT/bench.log"
fi

status=$([ $failed -eq 0 ] && echo "everything passed" || echo "some checks failed (see below)")
step "the report"
python3 "$HELPER" report "$REPORT" "$status" || failed=1
echo "gpu_check: $status in $((SECONDS - start)) s; report: $REPORT (logs and executed copies: $OUT)"
exit $failed
