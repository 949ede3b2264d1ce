"""Re-execute chapter notebooks in place, so their committed outputs are real.

    python .ci/execute_notebooks.py                 # every chapter under book/
    python .ci/execute_notebooks.py book/03_*.ipynb # some of them

Runs each notebook top to bottom in a fresh kernel from the book/ folder,
as nbval and a reader would, and stops at the first error.
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
    NotebookClient(nb, timeout=1200, kernel_name="python3", record_timing=False,
                   resources={"metadata": {"path": str(path.parent)}}).execute()
    nbformat.write(nb, path)
    return time.perf_counter() - start


def main(args: list[str]) -> None:
    paths = [Path(a) for a in args] or sorted((ROOT / "book").glob("[0-9]*.ipynb"))
    for path in paths:
        print(f"executing {path} ...", flush=True)
        print(f"  done in {execute(path):.0f} s", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
