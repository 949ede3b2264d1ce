#!/usr/bin/env bash
# The GPU check: what a maintainer with an NVIDIA GPU runs, then commits the report of (issues 27 and 41).
#
#     bash .ci/gpu_check.sh                      # writes _build/gpu_report.md
#     bash .ci/gpu_check.sh book/gpu_results.md  # the committed report (on a T4 also the chapters' T4 times)
#     GPU_CHECK_DISABLE_TRITON=1 bash .ci/gpu_check.sh   # Triton hidden: see the check fail on the fallbacks
#
# It cannot pass on a silent fallback. Each chapter and the benchmark run with $ENGINELIB_PATHS_LOG set, so every
# path decision enginelib makes (enginelib/speed/paths.py: the kernel `auto` chose and the ones it left out, the
# compiled decode, its CUDA graphs, the Triton decode attention) is written down, and the report fails on any
# fallback from the requested path and on a path a chapter must run that never ran (.ci/gpu_report.py). Steps:
# 0. what this GPU can run: the Triton kernels in float32 and its half dtype, torch.compile (a "no" fails);
# 1. the unit tests on the GPU (ENGINELIB_TEST_DEVICE=cuda: the models, `tiny` included, on the GPU), in float32,
#    then in the GPU's half dtype (float16 on a T4, compute capability 7.5; bfloat16 from 8.0, e.g. an H100);
# 2. every chapter (book/[0-9]*.ipynb) top to bottom on copies under _build/gpu/book-DTYPE/ (the committed
#    notebooks are never touched), in float32 as a Colab reader runs it, then in the half dtype: each chapter's
#    time, result, failing cell, and the kernels, compile mode and CUDA graphs it ran;
# 3. the kernel micro-benchmark (.ci/gpu_kernels.py): Triton's int8/int4 linears and paged decode attention
#    against the reference and cuBLAS / gather + SDPA, each result checked;
# 4. the quick benchmark with the Triton decode kernel on: python -m enginelib.bench --quick --device cuda
#    --decode-kernel, its paths recorded per section;
# then the Markdown report (GPU, driver, torch, CUDA, Triton, commit; the verdict first, with every problem).
# Logs, path records and executed copies stay in _build/gpu/.
#
# Exit status: 0 when everything passed, 1 when anything failed, fell back or was skipped (the report says what),
# 2 when this machine has no CUDA device (nothing is run). Environment:
#   GPU_CHECK_TESTS           what pytest runs (default: tests, without the browser test and the Colab rehearsal,
#                             which do not touch the GPU)
#   GPU_CHECK_CHAPTERS        the chapters to run (default: every book/[0-9]*.ipynb)
#   GPU_CHECK_SKIP            steps to skip, e.g. "tests" or "tests bench" (the verdict then fails: incomplete)
#   GPU_CHECK_DISABLE_TRITON  1: make Triton unimportable (.ci/no_triton/ first on PYTHONPATH), forcing fallbacks
#   GPU_CHECK_STRICT          1: ENGINELIB_STRICT_PATHS=1 for the chapters and the benchmark, so a fallback from a
#                             path asked for by name raises where it happens (its traceback in the chapter)
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
REPORT=${1:-_build/gpu_report.md}
OUT=_build/gpu
export PYTHONUNBUFFERED=1 GPU_CHECK_SKIP="${GPU_CHECK_SKIP:-}"
start=$SECONDS
step() { echo; echo "== $1 ($((SECONDS - start)) s)"; }
skipped() { [[ " $GPU_CHECK_SKIP " == *" $1 "* ]]; }

if [ "${GPU_CHECK_DISABLE_TRITON:-}" = 1 ]; then
  export PYTHONPATH="$ROOT/.ci/no_triton${PYTHONPATH:+:$PYTHONPATH}"
  echo "gpu_check: GPU_CHECK_DISABLE_TRITON=1: Triton is hidden (.ci/no_triton/), so this run must FAIL"
fi

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

rm -rf "$OUT" && mkdir -p "$OUT/paths" "$(dirname "$REPORT")"
half=$(python3 .ci/gpu_report.py machine) || exit 1
dtypes=(float32 "$half")
strict=()
[ "${GPU_CHECK_STRICT:-}" = 1 ] && strict=(ENGINELIB_STRICT_PATHS=1)

step "what this GPU can run (float32 and $half)"
python3 .ci/gpu_report.py preflight

# Unit tests on the GPU. The browser test and the Colab rehearsal run no GPU code; CI covers them.
read -r -a tests <<< "${GPU_CHECK_TESTS:-tests --ignore=tests/test_site.py --deselect=tests/test_colab.py::test_colab_rehearsal}"
for dtype in "${dtypes[@]}"; do
  if skipped tests; then break; fi
  step "unit tests on the GPU, $dtype: ENGINELIB_TEST_DEVICE=cuda ENGINELIB_DTYPE=$dtype pytest ${tests[*]}"
  ENGINELIB_TEST_DEVICE=cuda ENGINELIB_DTYPE=$dtype python3 -m pytest -q -rfEs "${tests[@]}" \
    --junitxml="$OUT/tests-$dtype.xml" 2>&1 | tee "$OUT/tests-$dtype.log" | tail -n 40
done

if ! skipped chapters; then
  # shellcheck disable=SC2206  # a list of paths, split on spaces
  chapters=(${GPU_CHECK_CHAPTERS:-book/[0-9]*.ipynb})
  for dtype in "${dtypes[@]}"; do
    step "every chapter on the GPU (${#chapters[@]}) in $dtype, on copies in $OUT/book-$dtype"
    env -u ENGINELIB_TEST_DEVICE "${strict[@]}" python3 .ci/gpu_report.py chapters "$dtype" "${chapters[@]}" 2>&1 \
      | tee "$OUT/chapters-$dtype.log" | grep -v "Kernel is running over TCP"
  done
fi

if ! skipped kernels; then
  step "the kernel micro-benchmark: python .ci/gpu_kernels.py (float32 and $half)"
  python3 .ci/gpu_kernels.py "$OUT/kernels.json" --dtypes "float32,$half" 2>&1 | tee "$OUT/kernels.log"
fi

if ! skipped bench; then
  step "the quick benchmark: python -m enginelib.bench --quick --device cuda --decode-kernel"
  bench_start=$SECONDS
  env "${strict[@]}" ENGINELIB_PATHS_LOG="$ROOT/$OUT/paths/bench.jsonl" \
    python3 -m enginelib.bench --quick --device cuda --decode-kernel --json "$OUT/bench.json" \
    > "$OUT/bench.log" 2> "$OUT/bench.stderr"
  echo $? > "$OUT/bench.exit"
  echo $((SECONDS - bench_start)) > "$OUT/bench.seconds"
  tail -n 12 "$OUT/bench.log"
fi

step "the report and its verdict"
python3 .ci/gpu_report.py report "$REPORT"
code=$?
if [ "$REPORT" = book/gpu_results.md ] && ! skipped chapters; then
  python3 .ci/gpu_report.py runtimes
fi
echo "gpu_check: $([ $code -eq 0 ] && echo "everything passed" || echo "FAILED") in $((SECONDS - start)) s;" \
  "report: $REPORT (logs, path records and executed copies: $OUT)"
exit $code
