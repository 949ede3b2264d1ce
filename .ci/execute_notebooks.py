"""Re-execute chapter notebooks in place, so their committed outputs are real.

    python .ci/execute_notebooks.py                 # every chapter under book/
    python .ci/execute_notebooks.py book/03_*.ipynb # some of them

Runs each notebook top to bottom in a fresh kernel from the book/ folder,
as nbval and a reader would, and stops at the first error. Widget state is
not stored: the built book has no kernel and loads no widget JavaScript, so
widgets (the chapters' explorers) show their still picture there instead.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parent.parent


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


def main(args: list[str]) -> None:
    paths = [Path(a) for a in args] or sorted((ROOT / "book").glob("[0-9]*.ipynb"))
    for path in paths:
        print(f"executing {path} ...", flush=True)
        print(f"  done in {execute(path):.0f} s", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
