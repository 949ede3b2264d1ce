"""Keep what every chapter shares in one place: this script writes it into each notebook.

    python .ci/sync_notebooks.py          # rewrite the notebooks in place
    python .ci/sync_notebooks.py --check  # exit 1 if any notebook disagrees

It sets, idempotently:
- the repository URL from _config.yml, in the Colab badge and the setup cell;
- the setup cell itself (first cell, tagged ``remove-cell``): in Colab it pip-installs
  enginelib alone (its dependencies are loose floors, so Colab's torch stays) and, if pip
  fails, raises an error that shows pip's output and says what to do;
- every exercise solution (a ``hide-input`` code cell starting ``# Solution``) as a Colab
  form cell, so Colab shows its title and hides the code until the reader double-clicks.
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

import nbformat
import yaml

ROOT = Path(__file__).resolve().parent.parent
GITHUB = re.compile(r"https://github\.com/([^/\s\"')]+)/([^/\s\"')]+?)(?:\.git)?/?$")
SOLUTION_TITLE = '#@title Solution (double-click to show the code) { display-mode: "form" }'
SETUP_TAG = "remove-cell"
SETUP = '''\
# Setup: in Colab, install enginelib from the book's repository (elsewhere `pip install -r requirements.txt` did it).
import importlib, subprocess, sys
if "google.colab" in sys.modules:
    SPEC = "enginelib @ git+{url}"
    pip = subprocess.run([sys.executable, "-m", "pip", "install", "-q", SPEC], capture_output=True, text=True)
    if pip.returncode:
        raise RuntimeError(
            f"Could not install enginelib: pip exited with {{pip.returncode}}. What pip said:\\n{{pip.stdout}}{{pip.stderr}}\\n"
            "What to do: check that this runtime is connected and has internet, then Runtime > Restart session "
            f"and run this cell again. Or install it by hand in a new cell:  !pip install \\"{{SPEC}}\\"\\n"
            "More help: {url}#run-a-chapter-in-colab")
    importlib.invalidate_caches()  # a package installed just now imports in this same session: no restart'''


def repository() -> tuple[str, str]:
    """(url, branch) from _config.yml."""
    repo = yaml.safe_load((ROOT / "_config.yml").read_text())["repository"]
    return repo["url"].rstrip("/"), repo.get("branch", "main")


def colab_url(path: Path) -> str:
    url, branch = repository()
    owner, name = GITHUB.match(url).groups()
    return f"https://colab.research.google.com/github/{owner}/{name}/blob/{branch}/{path.relative_to(ROOT).as_posix()}"


def setup_source(url: str | None = None) -> str:
    """The setup cell every chapter starts with, installing from ``url`` (default: _config.yml's)."""
    return SETUP.format(url=url or repository()[0])


def synced(text: str, path: Path) -> str:
    """``text`` with every badge link and install URL pointing at the configured repository."""
    url, _ = repository()
    text = re.sub(r"https://colab\.research\.google\.com/github/[^\s)\"']+", colab_url(path), text)
    return re.sub(r"enginelib @ git\+[^\s\"']+", f"enginelib @ git+{url}", text)


def is_solution(cell) -> bool:
    """An exercise's solution: a ``hide-input`` code cell whose code starts with ``# Solution``."""
    if cell.cell_type != "code" or "hide-input" not in cell.metadata.get("tags", []):
        return False
    lines = cell.source.splitlines()
    if lines and lines[0].startswith("#@title"):
        lines = lines[1:]
    return bool(lines) and lines[0].startswith("# Solution")


def as_form(cell) -> None:
    """Make a solution a Colab form cell (title shown, code hidden) and collapse it in Jupyter too."""
    lines = cell.source.splitlines()
    if lines[0].startswith("#@title"):
        lines = lines[1:]
    cell.source = "\n".join([SOLUTION_TITLE, *lines])
    cell.metadata["cellView"] = "form"
    cell.metadata.setdefault("jupyter", {})["source_hidden"] = True


def sync(nb, path: Path) -> bool:
    """Bring one notebook in line; True if anything changed. A copy outside book/ (a test's
    temp dir) syncs as the chapter of the same name."""
    path = ROOT / "book" / path.name
    before = nbformat.writes(nb)
    setup = nb.cells[0]
    if setup.cell_type != "code" or SETUP_TAG not in setup.metadata.get("tags", []):
        raise ValueError(f"{path.name}: the first cell must be the setup cell, a code cell tagged {SETUP_TAG!r}")
    setup.source = setup_source()
    for cell in nb.cells:
        cell.source = synced(cell.source, path)
        if is_solution(cell):
            as_form(cell)
    return nbformat.writes(nb) != before


def main(check: bool, paths: list[Path]) -> int:
    stale = []
    for path in paths or sorted((ROOT / "book").glob("*.ipynb")):
        nb = nbformat.read(path, as_version=4)
        if sync(nb, path):
            stale.append(path.name)
            if not check:
                nbformat.write(nb, path)
    print(("out of date: " if check else "rewrote: ") + (", ".join(stale) or "none"))
    return 1 if check and stale else 0


if __name__ == "__main__":
    args = sys.argv[1:]
    sys.exit(main("--check" in args, [Path(a) for a in args if a != "--check"]))
