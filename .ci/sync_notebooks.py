"""Keep what every chapter shares in one place: this script writes it into each notebook.

    python .ci/sync_notebooks.py          # rewrite the notebooks in place
    python .ci/sync_notebooks.py --check  # exit 1 if any notebook disagrees

It sets, idempotently:
- the repository URL from _config.yml, in the Colab badge and the setup cell;
- the setup cell itself (first cell, tagged ``remove-cell``): in Colab it pip-installs
  enginelib alone (its dependencies are loose floors, so Colab's torch stays) and, if pip
  fails, raises an error that shows pip's output and says what to do;
- every exercise solution (a ``hide-input`` code cell starting ``# Solution``) as a Colab
  form cell, so Colab shows its title and hides the code until the reader double-clicks;
- the opening box's "**It runs** ..." line, and the README's table of runtimes, from
  book/runtimes.json (written by execute_notebooks.py when it re-executes a chapter; its "t4"
  part by a GPU report): one source for every runtime the book states.
"""
from __future__ import annotations

import json
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
    importlib.invalidate_caches()  # a package installed just now imports in this same session: no restart
    # The engine you build from chapter 5 on (book/myengine/), every file of it: a chapter opened alone needs earlier ones'.
    import os, urllib.request
    os.makedirs("myengine", exist_ok=True)
    for name in {reader_files}:
        if not os.path.exists(f"myengine/{{name}}"):  # your own edits stay
            urllib.request.urlretrieve(f"{raw}/book/myengine/{{name}}", f"myengine/{{name}}")'''
RUNTIMES = ROOT / "book" / "runtimes.json"
RUNS_LINE = re.compile(r"[ \n]*\*\*It\s+runs\*\*.*?(?=\n```)", re.S)
README_TABLE = re.compile(r"(<!-- runtimes:[^\n]*-->\n).*?(?=<!-- /runtimes -->)", re.S)


def repository() -> tuple[str, str]:
    """(url, branch) from _config.yml."""
    repo = yaml.safe_load((ROOT / "_config.yml").read_text())["repository"]
    return repo["url"].rstrip("/"), repo.get("branch", "main")


def colab_url(path: Path) -> str:
    url, branch = repository()
    owner, name = GITHUB.match(url).groups()
    return f"https://colab.research.google.com/github/{owner}/{name}/blob/{branch}/{path.relative_to(ROOT).as_posix()}"


def setup_source(url: str | None = None) -> str:
    """The setup cell every chapter starts with, installing from ``url`` (default: _config.yml's); the reader's
    engine files come from the same repository's raw files (GitHub's, or ``file://`` beside a local one)."""
    url = url or repository()[0]
    match = GITHUB.match(url)
    raw = (f"https://raw.githubusercontent.com/{match[1]}/{match[2]}/{repository()[1]}" if match else
           url.removeprefix("git+"))
    return SETUP.format(url=url, raw=raw, reader_files=reader_files())


def reader_files() -> list[str]:
    """The files of the reader's package, book/myengine/, that the chapters' %%writefile cells write."""
    return sorted(p.name for p in (ROOT / "book" / "myengine").glob("*.py"))


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


def runtimes() -> dict:
    return json.loads(RUNTIMES.read_text()) if RUNTIMES.exists() else {"cpu": {}, "t4": {}}


def runs_line(chapter: str) -> str:
    """The opening box's last line: the chapter's measured runtimes, or plainly that one is not measured."""
    times = runtimes()
    cpu, t4 = times["cpu"].get(chapter), times["t4"].get(chapter)
    where = (f"in {cpu['seconds']} s on a {cpu['cores']}-core CPU ({cpu['cpu']}, {cpu['dtype']}, "
             f"re-executed {cpu['date']})") if cpu else "on a 2-core CPU in a time not measured yet"
    gpu = (f"on Colab's T4 in {t4['seconds']} s ({t4['dtype']}, GPU report of {t4['date']})" if t4 else
           "on Colab's T4 its time is not measured yet: no GPU report has run it")
    return f"**It runs** {where}; {gpu}."


def readme_table() -> str:
    """The README's runtime table, a row per chapter, from book/runtimes.json."""
    times, rows, total = runtimes(), [], 0
    for path in sorted((ROOT / "book").glob("[0-9]*.ipynb")):
        title = nbformat.read(path, as_version=4).cells[1].source.splitlines()[0].lstrip("# ")
        cpu, t4 = times["cpu"].get(path.stem), times["t4"].get(path.stem)
        total += cpu["seconds"] if cpu else 0
        rows.append(f"| {int(path.stem[:2])} {title} | {cpu['seconds'] if cpu else 'not measured'} | "
                    f"{cpu['cpu'] + ', ' + str(cpu['cores']) + ' cores' if cpu else ''} | {cpu['date'] if cpu else ''} | "
                    f"{t4['seconds'] if t4 else 'not measured'} |")
    return "\n".join(["| chapter | CPU seconds | CPU | re-executed | T4 seconds |", "|---|---|---|---|---|", *rows,
                      f"| all {len(rows)} chapters | {total} ({total / 60:.1f} minutes) | | | |"]) + "\n"


def sync_readme(check: bool) -> bool:
    """Bring the README's runtime table in line; True if it was stale."""
    readme = ROOT / "README.md"
    text = readme.read_text()
    new = README_TABLE.sub(lambda m: m[1] + readme_table(), text)
    if new != text and not check:
        readme.write_text(new)
    return new != text


def sync(nb, path: Path) -> bool:
    """Bring one notebook in line; True if anything changed. A copy outside book/ (a test's
    temp dir) syncs as the chapter of the same name."""
    path = ROOT / "book" / path.name
    before = nbformat.writes(nb)
    setup = nb.cells[0]
    if setup.cell_type != "code" or SETUP_TAG not in setup.metadata.get("tags", []):
        raise ValueError(f"{path.name}: the first cell must be the setup cell, a code cell tagged {SETUP_TAG!r}")
    setup.source = setup_source()
    nb.cells[1].source = RUNS_LINE.sub(lambda m: "\n" + runs_line(path.stem), nb.cells[1].source, count=1)
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
    if sync_readme(check):
        stale.append("README.md (runtimes)")
    print(("out of date: " if check else "rewrote: ") + (", ".join(stale) or "none"))
    return 1 if check and stale else 0


if __name__ == "__main__":
    args = sys.argv[1:]
    sys.exit(main("--check" in args, [Path(a) for a in args if a != "--check"]))
