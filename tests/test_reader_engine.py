"""The engine the reader builds (book/myengine/) and the map to vLLM: the cell is the file, the package stands on its
own, and every chapter from 3 on says where its part lives in vLLM, at one pinned commit (or a listed exception)."""
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


# The one vLLM commit the book reads (an upstream squash merge, #43119, of 2026-05-19), and the files whose notes
# describe code that reads otherwise there, each linked at the commit it describes, with what differs at VLLM_COMMIT.
VLLM_COMMIT = "9aaf83ef502fc37bc647f6e474314d48ba36cd1c"
VLLM_EXCEPTIONS = {
    ("vllm/entrypoints/llm.py", "10fdb8f0d75a3ad1122b87020f1359d3fc51f2ca"):
        "ch4: _validate_and_add_requests is _render_and_add_requests there",
    ("vllm/v1/worker/block_table.py", "a4cd9d0d28bdb41db8dfe0acdafac2bf2f608630"):
        "ch5: the slot mapping is a Triton kernel there, no NumPy, no commit_slot_mapping",
    ("vllm/v1/worker/gpu_worker.py", "35d5cda123ec28581759b6d34cde8052314fb1e6"):
        "ch8: annotate_profile counts context and generation requests there, not new and cached",
    ("vllm/v1/core/block_pool.py", "c59cb7941357443da7c5eef75cfa8697d683d228"):
        "ch9: a later commit, whose free_blocks prepends blocks without a hash; VLLM_COMMIT appends every block",
    ("vllm/entrypoints/openai/api_server.py", "048027fbbdb8c252560205a6159ba3288ede291e"):
        "ch11: init_app_state builds no OpenAIServingChat there, and the key guards /v2 and /inference too",
    ("vllm/model_executor/layers/quantization/fp8.py", "0071b24bf8fe8c3d1bc3516d0ff8477f07964aaf"):
        "ch13: quantizing at load is Fp8OnlineLinearMethod there",
    ("vllm/config/speculative.py", "f19b16d95e4395790661f4835e4436bc3dd5d9c7"):
        "ch15: disable_by_batch_size is gone there (#35060), and there are more methods",
    ("vllm/v1/sample/rejection_sampler.py", "0097a7bbf1d91c71f03e35dc6c6fe978b88181f5"):
        "ch15: IS_NGRAM is NO_DRAFT_PROBS there",
    ("vllm/v1/spec_decode/eagle.py", "008603a39fff2a383a293c62eec0c752c42199f2"):
        "ch15: EagleProposer.propose lives in llm_base_proposer.py there",
    ("vllm/v1/attention/backends/triton_attn.py", "001ceb3e98e7a19ebe33f542a368fa73bf6c76ad"):
        "ch16: forward no longer writes the K/V (do_kv_cache_update does)",
    ("vllm/attention/ops/triton_unified_attention.py", "001ceb3e98e7a19ebe33f542a368fa73bf6c76ad"):
        "ch16: the file moved to vllm/v1/attention/ops/",
}
VLLM_FILE = re.compile(r"https://github\.com/vllm-project/vllm/(?:blob|tree)/([0-9a-f]{40})/([^)#\s\"'>]+)")


def vllm_links_off_the_commit(texts) -> tuple[list[str], set]:
    """(the vLLM links on neither VLLM_COMMIT nor a listed exception, the exceptions that some link uses)."""
    stray, used = [], set()
    for name, text in texts:
        for sha, path in VLLM_FILE.findall(text):
            if (path, sha) in VLLM_EXCEPTIONS:
                used.add((path, sha))
            elif sha != VLLM_COMMIT:
                stray.append(f"{name}: {path} at {sha[:10]}")
    return stray, used


def test_every_vllm_link_is_on_the_one_commit_or_a_listed_exception():
    stray, used = vllm_links_off_the_commit(book_texts())
    assert not stray, f"vLLM links on neither {VLLM_COMMIT[:10]} nor VLLM_EXCEPTIONS: {stray}"
    assert used == set(VLLM_EXCEPTIONS), f"exceptions no link uses any more: {set(VLLM_EXCEPTIONS) - used}"
    on_commit = sum(sha == VLLM_COMMIT for _, text in book_texts() for sha, _ in VLLM_FILE.findall(text))
    assert on_commit >= 3 * len(VLLM_EXCEPTIONS)  # the exceptions stay a few


def test_a_link_off_the_commit_is_caught():
    base = "https://github.com/vllm-project/vllm/blob"
    texts = [("a", f"[x]({base}/{VLLM_COMMIT}/vllm/v1/request.py)"),
             ("b", f"[y]({base}/{'0' * 40}/vllm/v1/request.py)"),
             ("c", f"[z]({base}/10fdb8f0d75a3ad1122b87020f1359d3fc51f2ca/vllm/entrypoints/llm.py)"),
             ("d", f"[w]({base}/10fdb8f0d75a3ad1122b87020f1359d3fc51f2ca/vllm/v1/request.py)")]
    stray, used = vllm_links_off_the_commit(texts)
    assert stray == ["b: vllm/v1/request.py at 0000000000", "d: vllm/v1/request.py at 10fdb8f0d7"]
    assert used == {("vllm/entrypoints/llm.py", "10fdb8f0d75a3ad1122b87020f1359d3fc51f2ca")}


@pytest.mark.parametrize("path", [p for p in CHAPTERS if int(p.name[:2]) >= 3], ids=lambda p: p.name[:2])
def test_every_chapter_from_3_on_has_an_in_vllm_box(path):
    boxes = [c.source for c in nbformat.read(path, as_version=4).cells
             if c.cell_type == "markdown" and c.source.startswith("```{admonition} In vLLM\n")]
    assert len(boxes) == 1, f"{path.name}: {len(boxes)} 'In vLLM' boxes, want one"
    assert PINNED["vllm-project/vllm"].search(boxes[0]), f"{path.name}: its 'In vLLM' box links no vLLM source file"
