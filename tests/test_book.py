"""The book's own rules: every chapter is in the table of contents, follows the one
repository URL, starts with the shared setup cell, hides its exercise solutions (in the
built book and in Colab), and carries real (executed, error-free) outputs."""
from __future__ import annotations

import copy
import importlib.util
import re
from pathlib import Path

import nbformat
import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
CHAPTERS = sorted((ROOT / "book").glob("*.ipynb"))


def load_ci_module(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / ".ci" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def toc_files() -> list[str]:
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text())
    return [toc["root"]] + [c["file"] for part in toc["parts"] for c in part["chapters"]]


def test_the_table_of_contents_lists_every_chapter_and_only_existing_files():
    listed = toc_files()
    pages = [f for f in listed if (ROOT / f"{f}.md").exists()]  # the intro, the bibliography
    assert sorted(f"book/{p.stem}" for p in CHAPTERS) == sorted(f for f in listed if f not in pages)
    for name in listed:
        assert any((ROOT / f"{name}{ext}").exists() for ext in (".ipynb", ".md")), name


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_chapter_follows_the_repository_url_in_config(path):
    sync = load_ci_module("sync_notebooks")
    url, _ = sync.repository()
    nb = nbformat.read(path, as_version=4)
    text = "\n".join(cell.source for cell in nb.cells)
    assert f"enginelib @ git+{url}" in text
    assert sync.colab_url(path) in text
    assert all(sync.synced(cell.source, path) == cell.source for cell in nb.cells), \
        "run python .ci/sync_notebooks.py"


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_chapter_is_in_sync_setup_cell_and_solution_forms_included(path):
    sync = load_ci_module("sync_notebooks")
    nb = nbformat.read(path, as_version=4)
    assert nb.cells[0].source == sync.setup_source(), "run python .ci/sync_notebooks.py"
    assert not sync.sync(copy.deepcopy(nb), path), "run python .ci/sync_notebooks.py"


def test_every_solution_is_hidden_in_the_book_and_in_colab():
    sync = load_ci_module("sync_notebooks")
    solutions = 0
    for path in CHAPTERS:
        for i, cell in enumerate(nbformat.read(path, as_version=4).cells):
            if cell.cell_type == "code" and "# Solution" in cell.source:
                where = f"{path.name} cell {i}"
                assert sync.is_solution(cell), f"{where}: a solution is tagged hide-input and starts with # Solution"
                assert cell.source.splitlines()[0] == sync.SOLUTION_TITLE, f"{where}: run .ci/sync_notebooks.py"
                assert cell.metadata.get("cellView") == "form", f"{where}: not a Colab form cell"
                solutions += 1
    assert solutions > 0


def test_syncing_is_idempotent_and_makes_solutions_forms():
    sync = load_ci_module("sync_notebooks")
    path = ROOT / "book" / "05_paged_kv_cache.ipynb"
    nb = nbformat.read(path, as_version=4)
    nb.cells[0].source = "import sys\nif \"google.colab\" in sys.modules: pass"
    nb.cells.append(nbformat.v4.new_code_cell("# Solution (try it yourself first)\nx = 1", metadata={"tags": ["hide-input"]}))
    assert sync.sync(nb, path)
    once = nbformat.writes(nb)
    assert not sync.sync(nb, path) and nbformat.writes(nb) == once
    cell = nb.cells[-1]
    assert cell.source.splitlines() == [sync.SOLUTION_TITLE, "# Solution (try it yourself first)", "x = 1"]
    assert cell.metadata["cellView"] == "form" and cell.metadata["tags"] == ["hide-input"]
    assert nb.cells[0].source == sync.setup_source()
    exec(compile(cell.source, "solution", "exec"), {})  # still plain Python


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_chapter_shape(path):
    nb = nbformat.read(path, as_version=4)
    setup = nb.cells[0]
    assert setup.cell_type == "code" and "remove-cell" in setup.metadata.get("tags", [])
    assert '"google.colab" in sys.modules' in setup.source
    titles = [line for c in nb.cells if c.cell_type == "markdown" for line in c.source.splitlines()
              if line.startswith("# ")]
    assert len(titles) == 1, f"one H1 title per chapter, found {titles}"
    assert nb.metadata["kernelspec"]["name"] == "python3"


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_committed_outputs_are_from_a_full_error_free_run(path):
    nb = nbformat.read(path, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(c.execution_count is not None for c in code), "re-execute: python .ci/execute_notebooks.py"
    counts = [c.execution_count for c in code]
    assert counts == sorted(counts), "cells were run out of order"
    errors = [o for c in code for o in c.outputs if o.output_type == "error"]
    assert not errors


def test_the_readme_points_every_chapter_at_files_that_exist():
    """The chapter table's "finished code" column: the first path is from the repository root, the
    others from enginelib/."""
    rows = [line for line in (ROOT / "README.md").read_text().splitlines() if re.match(r"\| (I|II|III) \| \d+ ", line)]
    assert len(rows) >= 13
    for row in rows:
        paths = re.findall(r"`([^`]+)`", row.split(" | ")[-1])
        for path in paths:
            where = ROOT / path if path.startswith("enginelib/") else ROOT / "enginelib" / path
            assert where.exists(), f"README: {path} ({row.split(' | ')[1]}) does not exist"


def test_references_lists_every_work_a_chapter_cites():
    """Every link in a chapter's prose (the Colab badges aside) is in book/references.md too."""
    norm = lambda url: url.split("#")[0].rstrip("/")  # noqa: E731
    listed = {norm(u) for u in re.findall(r"\]\((https?://[^)\s]+)\)", (ROOT / "book" / "references.md").read_text())}
    missing = set()
    for path in sorted((ROOT / "book").glob("*.ipynb")):
        for cell in nbformat.read(path, as_version=4).cells:
            if cell.cell_type == "markdown":
                missing |= {(path.name, norm(u)) for u in re.findall(r"\]\((https?://[^)\s]+)\)", cell.source)
                            if "colab.research.google.com" not in u and norm(u) not in listed}
    assert not missing, f"cited in a chapter but not in book/references.md: {sorted(missing)}"
