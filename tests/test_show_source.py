"""show_source reads code by name: the excerpt is the file's own text at the lines it names, and a name that
is gone fails loudly (a chapter under nbval then fails instead of showing nothing)."""
from __future__ import annotations

import pytest

from enginelib import parallel
from enginelib.speed import speculative, triton_kernels
from enginelib.viz.source import ROOT, Excerpt, show_source


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


def test_lines_keeps_part_of_the_excerpt_and_marks_the_cuts():
    whole = show_source("enginelib/speed/csrc/q8.cpp", "int4q8_tile")
    first = whole.spans[0][0]
    cut = show_source("enginelib/speed/csrc/q8.cpp", "int4q8_tile", lines=(5, 9))
    code = cut.code.splitlines()
    assert cut.spans == ((first + 4, first + 8),)
    assert code[0].strip() == "// ..." and code[-1].strip() == "// ..." and code[1:-1] == file_lines(cut)
    two = show_source(speculative.rejection_sample, lines=[(1, 3), (14, 16)])
    code = two.code.splitlines()
    assert len(code) == 3 + 1 + 3 + 1 and code[3].strip() == "# ..." and code[-1].strip() == "# ..."
    assert [line for line in code if line.strip() != "# ..."] == file_lines(two)
    assert ", lines " in two.where and two.where.count("-") == 2
    with pytest.raises(ValueError):
        show_source(speculative.rejection_sample, lines=(10, 500))


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
