"""Re-execute chapter notebooks in place, so their committed outputs are real.

    python .ci/execute_notebooks.py                 # every chapter under book/
    python .ci/execute_notebooks.py book/03_*.ipynb # some of them

Runs each notebook top to bottom in a fresh kernel from the book/ folder,
as nbval and a reader would, and stops at the first error. Widget state is
not stored: the built book has no kernel and loads no widget JavaScript, so
widgets (the chapters' explorers) show their still picture there instead.

Each chapter's time goes into book/runtimes.json (with the CPU, threads and
dtype it ran on), the one source of the runtimes the book states: then
sync_notebooks.py writes each chapter's "It runs" line and the README's table
from it. A copy outside book/ (CI's float16 pass) is timed but not recorded.
"""
from __future__ import annotations

import datetime
import json
import os
import platform
import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parent.parent
RUNTIMES = ROOT / "book" / "runtimes.json"


def execute(path: Path) -> float:
    nb = nbformat.read(path, as_version=4)
    start = time.perf_counter()
    # store_widget_state=False would be the direct way, but nbclient (0.10, 0.11) then fails with a
    # KeyError as soon as an Output widget captures output: keep it on, drop the state afterwards.
    NotebookClient(nb, timeout=1200, kernel_name="python3", record_timing=False,
                   resources={"metadata": {"path": str(path.parent)}}).execute()
    nb.metadata.pop("widgets", None)
    nbformat.write(nb, path)
    return time.perf_counter() - start


def cpu_model() -> str:
    """The CPU's marketing name ("AMD EPYC", "Intel(R) Xeon(R) Platinum 8488C"), as Linux reports it."""
    cpuinfo = Path("/proc/cpuinfo")
    names = [line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines()
             if line.startswith("model name")] if cpuinfo.exists() else []
    return names[0] if names else platform.processor() or platform.machine()


def record(path: Path, seconds: float) -> None:
    """Store one chapter's CPU runtime in book/runtimes.json."""
    runtimes = json.loads(RUNTIMES.read_text()) if RUNTIMES.exists() else {"cpu": {}, "t4": {}}
    runtimes["cpu"][path.stem] = {
        "seconds": round(seconds), "cpu": cpu_model(), "cores": os.cpu_count(),
        "threads": int(os.environ.get("ENGINELIB_THREADS", "0")) or None,
        "dtype": os.environ.get("ENGINELIB_DTYPE", "float32"), "date": datetime.date.today().isoformat()}
    RUNTIMES.write_text(json.dumps(runtimes, indent=1, sort_keys=True) + "\n")


def main(args: list[str]) -> None:
    paths = [Path(a).resolve() for a in args] or sorted((ROOT / "book").glob("[0-9]*.ipynb"))
    recorded = False
    for path in paths:
        print(f"executing {path} ...", flush=True)
        seconds = execute(path)
        print(f"  done in {seconds:.0f} s", flush=True)
        if path.parent == ROOT / "book" and "ENGINELIB_DTYPE" not in os.environ:
            record(path, seconds)
            recorded = True
    if recorded:  # the "It runs" lines and the README's table follow the file
        import sync_notebooks  # a sibling script
        sync_notebooks.main(check=False, paths=[])


if __name__ == "__main__":
    main(sys.argv[1:])
