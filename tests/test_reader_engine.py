"""The engine the reader builds (book/myengine/) and the map to vLLM: the cell is the file, the package stands on its
own, and every chapter from 3 on says where its part lives in vLLM, at a pinned commit."""
from __future__ import annotations

import ast
import re

import nbformat
import pytest

from .test_book import CHAPTERS, ROOT

READER = ROOT / "book" / "myengine"
WRITEFILE = re.compile(r"%%writefile myengine/(\S+)\n")
PINNED = {  # repository -> what its links must carry: a full commit SHA, never a branch
    "vllm-project/vllm": re.compile(r"https://github\.com/vllm-project/vllm/(?:blob|tree)/([^/\s)\"']+)/"),
    "GeeeekExplorer/nano-vllm": re.compile(r"https://github\.com/GeeeekExplorer/nano-vllm/(?:blob|tree)/([^/\s)\"']+)/"),
}


def writefile_cells() -> list[tuple[str, str, str]]:
    """(chapter, file name, what the cell writes) for every %%writefile cell of the book."""
    cells = []
    for path in CHAPTERS:
        for cell in nbformat.read(path, as_version=4).cells:
            match = WRITEFILE.match(cell.source) if cell.cell_type == "code" else None
            if match:
                cells.append((path.name, match[1], cell.source[match.end():] + "\n"))  # IPython adds the newline
    return cells


def reader_mismatches(folder=READER) -> list[str]:
    """What differs between the %%writefile cells and the files in ``folder``."""
    cells = writefile_cells()
    names = [name for _, name, _ in cells]
    problems = [f"{name} is written by two cells" for name in set(names) if names.count(name) > 1]
    files = {p.name for p in folder.glob("*.py")}
    problems += [f"{name}: no cell writes it" for name in sorted(files - set(names))]
    problems += [f"{name}: written by a cell, not committed" for name in sorted(set(names) - files)]
    problems += [f"{name} differs from its cell in {chapter}" for chapter, name, text in cells
                 if name in files and (folder / name).read_text() != text]
    return problems


def test_every_reader_file_is_the_cell_that_writes_it():
    assert reader_mismatches() == []


def test_a_file_changed_by_hand_is_caught(tmp_path):
    for path in READER.glob("*.py"):
        (tmp_path / path.name).write_text(path.read_text())
    (tmp_path / "scheduler.py").write_text((READER / "scheduler.py").read_text() + "# a hand edit\n")
    (tmp_path / "extra.py").write_text("")
    assert reader_mismatches(tmp_path) == ["extra.py: no cell writes it", "scheduler.py differs from its cell in "
                                           "06_scheduler.ipynb"]


def test_the_reader_engine_imports_nothing_from_enginelib():
    for path in READER.glob("*.py"):
        tree = ast.parse(path.read_text())
        imported = [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
        imported += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        assert not [m for m in imported if m.split(".")[0] == "enginelib"], f"{path.name} imports from enginelib"


def test_the_reader_engine_reads_in_one_sitting():
    lines = {p.name: len(p.read_text().splitlines()) for p in READER.glob("*.py")}
    assert sum(lines.values()) <= 700, lines  # the goal the book states: at most 700 lines in all


def book_texts():
    for path in CHAPTERS:
        yield path.name, "\n".join(c.source for c in nbformat.read(path, as_version=4).cells)
    for path in (ROOT / "book").glob("*.md"):
        yield path.name, path.read_text()
    yield "README.md", (ROOT / "README.md").read_text()


@pytest.mark.parametrize("repo", sorted(PINNED))
def test_every_source_link_is_pinned_to_a_commit(repo):
    unpinned = [f"{name}: {ref}" for name, text in book_texts() for ref in PINNED[repo].findall(text)
                if not re.fullmatch(r"[0-9a-f]{40}", ref)]
    assert not unpinned, f"links to {repo} that name a branch or a short SHA, not a full commit: {unpinned}"


@pytest.mark.parametrize("path", [p for p in CHAPTERS if int(p.name[:2]) >= 3], ids=lambda p: p.name[:2])
def test_every_chapter_from_3_on_has_an_in_vllm_box(path):
    boxes = [c.source for c in nbformat.read(path, as_version=4).cells
             if c.cell_type == "markdown" and c.source.startswith("```{admonition} In vLLM\n")]
    assert len(boxes) == 1, f"{path.name}: {len(boxes)} 'In vLLM' boxes, want one"
    assert PINNED["vllm-project/vllm"].search(boxes[0]), f"{path.name}: its 'In vLLM' box links no vLLM source file"
