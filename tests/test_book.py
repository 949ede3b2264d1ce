"""The book's own rules: every chapter is in the table of contents, follows the one
repository URL, starts with the shared setup cell, hides its exercise solutions (in the
built book and in Colab), carries real (executed, error-free) outputs, and shows no stale seams
(chapter numbers, part captions and promises of what is "coming" agree with _toc.yml)."""
from __future__ import annotations

import ast
import copy
import importlib.util
import json
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


def exercise_cells(nb) -> list[tuple[int, nbformat.NotebookNode]]:
    """(index, cell) of every code cell in the chapter's '## Exercises' section: from the markdown line that
    starts with '## Exercises' (a cell may hold the summary before it) to the next line that starts with '## '."""
    cells, inside = [], False
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "markdown":
            for line in cell.source.splitlines():
                if line.startswith("## "):
                    inside = line.startswith("## Exercises")
        elif inside and cell.cell_type == "code":
            cells.append((i, cell))
    return cells


def test_the_exercises_section_is_found_where_a_cell_holds_the_summary_too():
    nb = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_markdown_cell("## Summary\n\n- a point\n\n## Exercises\n\n**1.** Do it."),
        nbformat.v4.new_code_cell("# Solution (try it yourself first)\nx = 1"),
        nbformat.v4.new_markdown_cell("Some words.\n\n## References\n\n- a paper"),
        nbformat.v4.new_code_cell("y = 2")])
    assert [i for i, _ in exercise_cells(nb)] == [1]
    assert len(exercise_cells(nbformat.read(ROOT / "book" / "03_kv_cache.ipynb", as_version=4))) == 6


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_exercise_checks_print_checks_not_answers(path):
    """An exercise's cells do not give its answers away: solutions compute, checks say 'check passed: ...' in
    words (or what failed); nothing else is shown (no other printed lines, figures or errors)."""
    found = []
    for i, cell in exercise_cells(nbformat.read(path, as_version=4)):
        for output in cell.outputs:
            if output.output_type == "stream":
                found += [f"cell {i}: printed {line!r}" for line in output.text.splitlines()
                          if not line.startswith("check passed")]
            else:
                kinds = ", ".join(output.get("data", {})) or "no data"
                found.append(f"cell {i}: {output.output_type} output ({kinds})")
    assert not found, (f"{path.name}: exercise cells may only print 'check passed: ...' lines "
                       "(re-execute after fixing the cells):\n" + "\n".join(found))


# Chapters whose exercise check cells still end in bare asserts (an AssertionError with no message, or a
# traceback, instead of a sentence): none since issue 38 converted the last. A chapter put here must still have one.
CHECKS_THAT_STILL_ASSERT: set[str] = set()


def check_cell_problems(source: str) -> list[str]:
    """Why an exercise's check cell is not one that prints 'check passed: ...' or a sentence saying what failed:
    under nbval's lax mode only a checked output can fail the chapter, and an assert fails it without a word."""
    tree = ast.parse(source.replace("await ", ""))  # a top-level await (chapter 11) parses as a plain call
    problems = [f"assert on line {n.lineno}" for n in ast.walk(tree) if isinstance(n, ast.Assert)]
    if source.splitlines()[0] != "# NBVAL_CHECK_OUTPUT":
        problems.append("its first line is not '# NBVAL_CHECK_OUTPUT' (a printed failure would pass nbval)")
    defined = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    last = tree.body[-1]
    call = last.value if isinstance(last, ast.Expr) else None
    if not (isinstance(call, ast.Call) and getattr(call.func, "id", None) == "print" and len(call.args) == 1
            and isinstance(call.args[0], ast.Call) and getattr(call.args[0].func, "id", None) in defined):
        problems.append("it does not end by printing what a check function it defines returns")
    return problems


def test_check_cell_problems_tells_an_assert_from_a_sentence():
    good = '# NBVAL_CHECK_OUTPUT\ndef check() -> str:\n    return "check passed"\n\n\nprint(check())'
    assert check_cell_problems(good) == []
    assert check_cell_problems(good.replace("# NBVAL_CHECK_OUTPUT\n", "")) != []
    old = 'assert x == 1\nprint("check passed: x is 1")'
    assert check_cell_problems(old)[0] == "assert on line 1" and len(check_cell_problems(old)) == 3


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_exercise_check_cells_say_what_failed(path):
    """Every check cell of an exercise prints 'check passed: ...' or a sentence saying what failed, expected
    against got (chapters on CHECKS_THAT_STILL_ASSERT excepted, and those must still have an assert to convert)."""
    checks = [(i, cell.source) for i, cell in exercise_cells(nbformat.read(path, as_version=4))
              if "check passed" in cell.source and "# Solution" not in cell.source]
    problems = [f"cell {i}: {problem}" for i, source in checks for problem in check_cell_problems(source)]
    if path.stem in CHECKS_THAT_STILL_ASSERT:
        assert problems, f"{path.stem}'s checks all say what failed now: take it off CHECKS_THAT_STILL_ASSERT"
    else:
        assert checks and not problems, f"{path.name}:\n" + "\n".join(problems)


def test_the_readme_points_every_chapter_at_files_that_exist():
    """The chapter table's "finished code" column: the first path is from the repository root, the
    others from enginelib/."""
    rows = [line for line in (ROOT / "README.md").read_text().splitlines() if re.match(r"\| [IVX]+ \| \d+ ", line)]
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


# --- No stale seams: chapter numbers, stale phrases and part captions agree with _toc.yml. ---
# Each check is a function of the repository root that returns what it found, so that it can be
# run against another copy of the book (an older commit) too; the tests assert on ROOT.

def numbered_parts(root: Path = ROOT) -> list[tuple[str, str, list[str]]]:
    """(numeral, name, chapter files) of each numbered part of _toc.yml, in order; chapters are
    numbered on across parts (Jupyter Book's multitoc numbering), so chapter n is the n-th file."""
    parts = []
    for part in yaml.safe_load((root / "_toc.yml").read_text())["parts"]:
        if part.get("numbered"):
            m = re.fullmatch(r"Part ([IVX]+): (\S.*)", part["caption"])
            assert m, f"_toc.yml: a numbered part's caption reads 'Part <numeral>: <name>', not {part['caption']!r}"
            parts.append((m[1], m[2], [c["file"] for c in part["chapters"]]))
    return parts


def numbered_chapters(root: Path = ROOT) -> list[tuple[str, str]]:
    """(file, part numeral) of chapters 1, 2, ... as _toc.yml numbers them."""
    return [(f, numeral) for numeral, _, files in numbered_parts(root) for f in files]


def prose_lines(root: Path = ROOT):
    """(where, line) for every line of the book's pages and README.md; a notebook's lines are its
    cells' sources (markdown and code, not outputs), located as 'path cell i line j'."""
    paths = sorted((root / "book").glob("*.ipynb")) + sorted((root / "book").glob("*.md")) + [root / "README.md"]
    for path in paths:
        rel = path.relative_to(root).as_posix()
        if path.suffix == ".ipynb":
            for i, cell in enumerate(json.loads(path.read_text())["cells"]):
                source = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
                for j, line in enumerate(source.splitlines(), 1):
                    yield f"{rel} cell {i} line {j}", line
        else:
            for j, line in enumerate(path.read_text().splitlines(), 1):
                yield f"{rel}:{j}", line


ROMAN = {"I": 1, "II": 2, "III": 3, "IV": 4, "V": 5, "VI": 6, "VII": 7, "VIII": 8, "IX": 9, "X": 10}
# "chapter 7", "Chapter 11's", "chapters 5 to 7", "chapters 9–15", "chapters 1, 11 and 13"
CHAPTER_REF = re.compile(r"\b(?:[Cc]hapter\s+\d+|[Cc]hapters\s+\d+(?:\s*(?:[–—-]|,(?:\s*(?:and|or))?|and|or|to)\s*\d+)*)")
# "Part III", "Parts I and II"
PART_REF = re.compile(r"\bParts?\s+[IVX]+\b(?:\s*(?:[–—-]|,|and|or|to)\s*[IVX]+\b)*")


def stale_chapter_references(root: Path = ROOT) -> list[str]:
    """Every 'chapter N' and 'Part N' that names a chapter or part _toc.yml does not number."""
    chapters, parts = len(numbered_chapters(root)), len(numbered_parts(root))
    found = []
    for where, line in prose_lines(root):
        for m in CHAPTER_REF.finditer(line):
            if any(not 1 <= int(n) <= chapters for n in re.findall(r"\d+", m[0])):
                found.append(f"{where}: '{m[0]}', but _toc.yml numbers chapters 1–{chapters}")
        for m in PART_REF.finditer(line):
            if any(not 1 <= ROMAN.get(n, 99) <= parts for n in re.findall(r"\b[IVX]+\b", m[0])):
                found.append(f"{where}: '{m[0]}', but _toc.yml has numbered parts I–{list(ROMAN)[parts - 1]}")
    return found


# A seam left from the building: a promise of what is not there yet, or a note to the authors.
# "coming" counts only next to a chapter or part, so "incoming"/"upcoming requests" and "the
# requests coming in" stay legitimate prose; TODO and friends only in capitals (ch10's `r.todo`).
STALE_PHRASES = {
    "'coming' next to a chapter or part":
        re.compile(r"(?i:\bchapters?\b)[^.;\n]{0,40}(?i:\bcoming\b)|\bParts?\s+[IVX]+\b[^.;\n]{0,40}(?i:\bcoming\b)"
                   r"|(?i:\bcoming\b)[^.;\n]{0,40}(?:(?i:\bchapters?\b)|\bParts?\s+[IVX]+\b)"),
    "'(coming)' or '(soon)'": re.compile(r"(?i)\(\s*(?:coming|soon|coming soon|to come|forthcoming)\s*\)"),
    "a promise of unwritten text": re.compile(
        r"(?i)\bcoming soon\b|\bnot yet written\b|\byet to be written\b|\bunder construction\b|\bwork in progress\b"),
    "a table cell that says 'coming'": re.compile(r"(?i)\|\s*coming\s*\|"),
    "a note to the authors": re.compile(r"\b(?:TODO|TBD|FIXME|XXX)\b"),
    # vLLM's docs moved to MkDocs: pages are directories under /en/latest/ (the old .html pages, the
    # features/spec_decode page and serving/openai_compatible_server moved or are gone)
    "a vLLM docs link in its old layout": re.compile(
        r"docs\.vllm\.ai/en/[^\s)\]>\"']*\.html|docs\.vllm\.ai/en/latest/features/spec_decode\b"
        r"|docs\.vllm\.ai/en/[^/\s]+/serving/openai_compatible_server"),
}


def stale_phrases(root: Path = ROOT) -> list[str]:
    return [f"{where}: {what}: {line.strip()[:120]!r}" for where, line in prose_lines(root)
            for what, pattern in STALE_PHRASES.items() if pattern.search(line)]


def readme_chapter_rows(root: Path = ROOT) -> list[tuple[str, int, str]]:
    """(part, chapter number, notebook cell) of each row of the README's chapter table."""
    rows = []
    for line in (root / "README.md").read_text().splitlines():
        m = re.match(r"\|\s*([IVX]*)\s*\|\s*(\d+) [^|]*\|\s*([^|]*?)\s*\|", line)
        if m:
            rows.append((m[1], int(m[2]), m[3]))
    return rows


def part_caption_mismatches(root: Path = ROOT) -> list[str]:
    """The intro and the README name the parts as _toc.yml's captions do, and the README puts each
    chapter in its _toc.yml part with its _toc.yml notebook."""
    parts = numbered_parts(root)
    names = {numeral: name for numeral, name, _ in parts}
    chapters = numbered_chapters(root)
    found = []
    for page in ("book/intro.md", "README.md"):
        text = (root / page).read_text()
        flat = " ".join(text.split())  # a caption may wrap across lines
        found += [f"{page}: does not name 'Part {numeral}: {name}' (_toc.yml's caption)"
                  for numeral, name, _ in parts if f"Part {numeral}: {name}" not in flat]
        # every 'Part N: name' (and, in the intro's table, '| N: name |') is a caption of _toc.yml
        named = [(m.start(), m[1], m[2]) for m in re.finditer(r"\bPart ([IVX]+):\s+([^|*()]+)", text)]
        if page == "book/intro.md":
            named += [(m.start(), m[1], m[2]) for m in re.finditer(r"(?m)^\|\s*([IVX]+):\s+([^|]+)", text)]
        for at, numeral, after in named:
            after = " ".join(after.split())
            caption = names.get(numeral)
            if caption is None or not re.match(re.escape(caption) + r"(?!\w)", after):
                found.append(f"{page}:{text.count(chr(10), 0, at) + 1}: 'Part {numeral}: {after[:40]}', but _toc.yml "
                             + (f"captions it 'Part {numeral}: {caption}'" if caption else "has no such part"))
    rows = readme_chapter_rows(root)
    missing = sorted(set(range(1, len(chapters) + 1)) - {n for _, n, _ in rows})
    found += [f"README.md: the chapter table has no row for chapter {n} ({chapters[n - 1][0]})" for n in missing]
    for part, n, notebook in rows:
        if n > len(chapters):
            found.append(f"README.md: chapter {n} ({notebook!r}, part {part}) is not in _toc.yml")
            continue
        file, numeral = chapters[n - 1]
        if part != numeral:
            found.append(f"README.md: chapter {n} is in part {part!r}, _toc.yml puts {file} in Part {numeral}")
        if notebook != f"`{file}.ipynb`":
            found.append(f"README.md: chapter {n}'s notebook is {notebook!r}, _toc.yml's is `{file}.ipynb`")
    return found


def test_numbered_chapters_are_the_numbered_files_in_order():
    """Chapter n of the built book is book/NN_*.ipynb, so 'chapter n' in the prose means that file."""
    assert [numeral for numeral, _, _ in numbered_parts()] == list(ROMAN)[:len(numbered_parts())]
    for n, (file, _) in enumerate(numbered_chapters(), 1):
        assert re.fullmatch(rf"book/{n:02d}_\w+", file), f"_toc.yml: chapter {n} is {file}"


def test_every_chapter_reference_names_a_chapter_in_the_toc():
    found = stale_chapter_references()
    assert not found, "references to chapters or parts _toc.yml does not have:\n" + "\n".join(found)


def test_no_stale_phrases():
    found = stale_phrases()
    assert not found, "stale seams (say what the book is, not what it will be):\n" + "\n".join(found)


def test_part_captions_agree_in_the_toc_the_intro_and_the_readme():
    found = part_caption_mismatches()
    assert not found, "part captions or the README's chapter table disagree with _toc.yml:\n" + "\n".join(found)


def test_the_setup_cells_help_link_names_a_readme_section():
    sync = load_ci_module("sync_notebooks")
    anchors = re.findall(r"#([\w-]+)\"\)", sync.SETUP)
    headings = [re.sub(r"[^\w -]", "", h).strip().lower().replace(" ", "-")
                for h in re.findall(r"^#+ (.+)$", (ROOT / "README.md").read_text(), re.M)]
    assert anchors and all(a in headings for a in anchors), (anchors, headings)


def test_runtimes_come_from_one_file():
    """Each chapter's "It runs" line and the README's table are written from book/runtimes.json."""
    sync = load_ci_module("sync_notebooks")
    assert not sync.sync_readme(check=True), "run python .ci/sync_notebooks.py"
    for path in CHAPTERS:
        box = nbformat.read(path, as_version=4).cells[1].source
        assert sync.runs_line(path.stem) in box, f"{path.name}: run python .ci/sync_notebooks.py"
        assert len(re.findall(r"\*\*It\s+runs\*\*", box)) == 1
