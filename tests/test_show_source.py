"""show_source reads code by name: the excerpt is the file's own text at the lines it names, and a name that
is gone fails loudly (a chapter under nbval then fails instead of showing nothing). Parts of a definition are named
by text, so an edit above them moves them with their code, and one that removes their text fails loudly too."""
from __future__ import annotations

import ast

import nbformat
import pytest

from enginelib import parallel
from enginelib.speed import speculative, triton_kernels
from enginelib.viz.source import ROOT, Excerpt, show_source

from .test_book import CHAPTERS


def file_lines(excerpt: Excerpt) -> list[str]:
    """The file's lines at the excerpt's spans, joined as the excerpt joins them (a '...' line between)."""
    lines = (ROOT / excerpt.path).read_text().splitlines()
    return [line for a, b in excerpt.spans for line in lines[a - 1:b]]


def test_a_python_function_is_its_source_at_the_lines_named():
    e = show_source(speculative.accept_greedy)
    assert e.path == "enginelib/speed/speculative.py" and e.language == "python" and len(e.spans) == 1
    assert e.code.splitlines() == file_lines(e)
    assert e.code.startswith("def accept_greedy(") and e.code.rstrip().endswith("return list(drafts[:a]) + [target[a]]")
    a, b = e.spans[0]
    assert f"enginelib/speed/speculative.py, lines {a}-{b}" in repr(e)


def test_a_method_and_a_class_by_object_and_by_dotted_name():
    by_object = show_source(parallel.RowParallel.forward)
    by_name = show_source("enginelib/parallel.py", "RowParallel.forward")
    assert by_object.spans == by_name.spans and by_object.code == by_name.code
    assert by_object.code.startswith("def forward(") and "dist.all_reduce(y)" in by_object.code  # dedented
    whole = show_source(parallel.RowParallel)
    assert whole.code.startswith("class RowParallel(") and by_object.code.splitlines()[0] in whole.code


@pytest.mark.parametrize("path, name", [("enginelib/speed/csrc/q8.cpp", "int4q8_tile"),
                                        ("enginelib/speed/csrc/linear.cpp", "int8_tile"),
                                        ("enginelib/speed/csrc/attention.cpp", "decode_attention"),
                                        ("speed/csrc/common.h", "hsum")])
def test_a_cpp_function_through_its_matching_brace(path, name):
    e = show_source(path, name)
    assert e.language == "cpp" and e.path.startswith("enginelib/speed/csrc/")
    assert e.code.splitlines() == file_lines(e)
    first = e.code.splitlines()[0]
    assert first.startswith("template") or f"{name}(" in first  # the definition, not a call of it
    assert e.code.splitlines()[-1] == "}" and e.code.count("{") == e.code.count("}")


def test_a_triton_kernel_by_file_and_by_object():
    e = show_source("enginelib/speed/triton_kernels.py", "_combine_parts_kernel")
    assert e.code.startswith("@_jit\ndef _combine_parts_kernel(") and e.code.splitlines() == file_lines(e)
    assert show_source(triton_kernels._combine_parts_kernel).spans == e.spans  # triton.jit wraps it, or not


def test_lines_keeps_parts_named_by_their_text_and_marks_the_cuts():
    whole = show_source("enginelib/speed/csrc/q8.cpp", "int4q8_tile")
    body = whole.code.splitlines()
    a = next(i for i, line in enumerate(body) if "for (int64_t g = 0; g < G; ++g) {" in line)
    b = next(i for i, line in enumerate(body) if i > a and "acc[i][j] = fmadd(" in line)
    cut = show_source("enginelib/speed/csrc/q8.cpp", "int4q8_tile",
                      lines=("for (int64_t g = 0; g < G; ++g) {", "acc[i][j] = fmadd("))
    code = cut.code.splitlines()
    assert cut.spans == ((whole.spans[0][0] + a, whole.spans[0][0] + b),)
    assert code[0].strip() == "// ..." and code[-1].strip() == "// ..." and code[1:-1] == file_lines(cut)
    assert code[1] == body[a] and code[-2] == body[b]
    two = show_source(speculative.rejection_sample, lines=[("def rejection_sample(", ") -> torch.Tensor:"),
                                                            ("k = len(drafts)", None)])
    code = two.code.splitlines()
    assert code[0].startswith("def rejection_sample(") and code[2].endswith(") -> torch.Tensor:")
    assert code[3].strip() == "# ..." and code[4].strip() == "k = len(drafts)"  # the docstring cut
    assert code[-1] == show_source(speculative.rejection_sample).code.splitlines()[-1]  # None: to the end
    assert [line for line in code if line.strip() != "# ..."] == file_lines(two)
    assert ", lines " in two.where and two.where.count("-") == 2


def test_lines_refuses_numbers_and_parts_out_of_order():
    with pytest.raises(TypeError, match="line numbers"):
        show_source(speculative.rejection_sample, lines=(1, 3))
    with pytest.raises(TypeError, match="line numbers"):
        show_source(speculative.rejection_sample, lines=[(1, 3), (14, 16)])
    with pytest.raises(ValueError, match="out of order"):
        show_source(speculative.rejection_sample, lines=[("k = len(drafts)", None), ("def rejection_sample(", None)])


KERNEL = """\
// a made-up kernel file, for the tests below
float dot(const float* a, const float* b, int n) {
  float s = 0.f;
  for (int i = 0; i < n; ++i) {  // the hot loop
    s += a[i] * b[i];
  }
  return s;
}
"""
HOT_LOOP = ("// the hot loop", "}")


def test_an_edit_above_a_part_moves_it_with_its_code(tmp_path):
    path = tmp_path / "kernel.cpp"
    path.write_text(KERNEL)
    before = show_source(path, "dot", lines=HOT_LOOP)
    assert before.code.splitlines()[1:3] == ["  for (int i = 0; i < n; ++i) {  // the hot loop",
                                             "    s += a[i] * b[i];"]
    path.write_text(KERNEL.replace("float dot(", "// three lines\n// above it\n// were added\nfloat dot(")
                    .replace("  float s = 0.f;\n", "  float s = 0.f;\n  // and two in it,\n  // before the loop\n"))
    after = show_source(path, "dot", lines=HOT_LOOP)
    assert after.code == before.code and after.spans == ((before.spans[0][0] + 5, before.spans[0][1] + 5),)
    assert after.code.splitlines()[1:-1] == file_lines(after)


def test_a_part_whose_text_changed_or_repeats_fails(tmp_path):
    """What numbers got wrong in silence: the loop's line rewritten, or a second line with the same text."""
    path = tmp_path / "kernel.cpp"
    path.write_text(KERNEL.replace("  // the hot loop", ""))
    with pytest.raises(LookupError, match="the hot loop"):
        show_source(path, "dot", lines=HOT_LOOP)
    again = "  for (int i = 0; i < n; ++i) {}  // the hot loop, again\n  return s;"
    path.write_text(KERNEL.replace("  return s;", again))
    with pytest.raises(ValueError, match="2 lines of 'dot' contain"):
        show_source(path, "dot", lines=HOT_LOOP)
    path.write_text(KERNEL)
    with pytest.raises(LookupError, match="from '// the hot loop' on contains 'no such end'"):
        show_source(path, "dot", lines=("// the hot loop", "no such end"))


def book_calls() -> list[tuple[str, str]]:
    """(chapter, source) of every show_source(...) call in the chapters' code cells."""
    calls = []
    for path in CHAPTERS:
        for cell in nbformat.read(path, as_version=4).cells:
            if cell.cell_type == "code" and "show_source(" in cell.source:
                calls += [(path.stem, ast.get_source_segment(cell.source, node))
                          for node in ast.walk(ast.parse(cell.source))
                          if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "show_source"]
    return calls


def test_every_show_source_call_of_the_book_finds_its_code():
    """The chapters' calls against the files as they are now: a part whose text is gone fails here, before nbval."""
    names = {"show_source": show_source, "rejection_sample": speculative.rejection_sample, "parallel": parallel}
    calls = book_calls()
    assert len(calls) >= 10 and any("lines=" in source for _, source in calls)
    for chapter, source in calls:
        excerpt = eval(source, names)  # noqa: S307 (the book's own cells)
        shown = [line for line in excerpt.code.splitlines() if line.strip() not in ("// ...", "# ...")]
        assert shown == file_lines(excerpt), f"{chapter}: {source}"


def test_a_missing_name_raises():
    with pytest.raises(LookupError, match="int4q8_tyle"):
        show_source("enginelib/speed/csrc/q8.cpp", "int4q8_tyle")
    with pytest.raises(LookupError):
        show_source("enginelib/speed/speculative.py", "NgramProposer.no_such_method")
    with pytest.raises(FileNotFoundError):
        show_source("enginelib/speed/csrc/q9.cpp", "int4q8_tile")


def test_it_displays_as_a_fenced_code_block_with_its_language():
    e = show_source("enginelib/speed/csrc/q8.cpp", "nibbles")
    text = e._repr_markdown_()
    assert f"`{e.where}`" in text and "```cpp\n" + e.code + "\n```" in text
