"""The book's own rules: every chapter is in the table of contents, follows the one
repository URL, hides its setup cell, and carries real (executed, error-free) outputs."""
from __future__ import annotations

import importlib.util
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
    assert sorted(f"book/{p.stem}" for p in CHAPTERS) == sorted(f for f in listed if f != "book/intro")
    for name in listed:
        assert any((ROOT / f"{name}{ext}").exists() for ext in (".ipynb", ".md")), name


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_chapter_follows_the_repository_url_in_config(path):
    sync = load_ci_module("sync_repo_url")
    url, _ = sync.repository()
    nb = nbformat.read(path, as_version=4)
    text = "\n".join(cell.source for cell in nb.cells)
    assert f"enginelib @ git+{url}" in text
    assert sync.colab_url(path) in text
    assert all(sync.synced(cell.source, path) == cell.source for cell in nb.cells), \
        "run python .ci/sync_repo_url.py"


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
