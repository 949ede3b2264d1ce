"""Code on screen, read by name when the cell runs: a chapter shows the kernel it times, never a pasted copy
that drifts from it, and a renamed function fails the chapter (LookupError) instead of showing nothing. A part of
a long definition is named by the text of its first and last lines, never by line numbers: an edit above it moves
the part with its code, and an edit that removes or repeats that text fails as loudly as a renamed function."""
from __future__ import annotations

import ast
import inspect
import re
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import enginelib

ROOT = Path(enginelib.__file__).resolve().parent.parent  # the repository (site-packages where pip installed it)
LANGUAGES = {".py": "python", ".cpp": "cpp", ".cc": "cpp", ".h": "cpp", ".cu": "cpp"}
Span = tuple[int, int]
Part = tuple[str, "str | None"]  # (text of its first line, text of its last line or None: to the definition's end)
_BODY = re.compile(r"\)\s*(?:const\s*)?(?:noexcept\s*)?\{")  # a parameter list's end, then a body
_SKIP = re.compile(r'//[^\n]*|/\*.*?\*/|"(?:\\.|[^"\\])*"|\'(?:\\.|[^\'\\])*\'', re.S)  # comments, literals


@dataclass(frozen=True)
class Excerpt:
    """Lines of one file, with where they came from. Displays as a highlighted code block (text/markdown:
    Jupyter renders it, and so does the static book, which has no kernel); its repr is plain text."""

    name: str
    path: str                # relative to the repository: enginelib/speed/csrc/q8.cpp
    spans: tuple[Span, ...]  # the file's lines shown, 1-based, inclusive; a "..." line between two spans
    language: str
    code: str

    @property
    def where(self) -> str:
        return f"{self.path}, lines " + ", ".join(f"{a}-{b}" for a, b in self.spans)

    def _repr_markdown_(self) -> str:
        fence = "`" * max(3, 1 + max(map(len, re.findall("`+", self.code)), default=0))
        return f"`{self.name}`, from `{self.where}`:\n\n{fence}{self.language}\n{self.code}\n{fence}\n"

    def __repr__(self) -> str:
        return f"{self.name}, from {self.where}:\n\n{self.code}"


def _cpp_span(text: str, name: str) -> Span | None:
    """C++ function ``name``'s definition, its ``template`` lines included, through its matching brace. A call
    or a declaration also reads ``name(``; only a definition has ``{`` after the parameters."""
    for m in re.finditer(rf"(?<![\w.>:]){re.escape(name)}\s*\(", text):
        depth, i = 0, m.end() - 1
        while i < len(text) and (depth := depth + {"(": 1, ")": -1}.get(text[i], 0)) > 0:
            i += 1
        if not (body := _BODY.match(text, i)):
            continue
        depth, i = 0, body.end() - 1
        while i < len(text):
            if skip := _SKIP.match(text, i):  # a brace in a comment or a string is no brace
                i = skip.end()
                continue
            if (depth := depth + {"{": 1, "}": -1}.get(text[i], 0)) == 0:
                break
            i += 1
        start, lines = text.count("\n", 0, m.start()) + 1, text.splitlines()
        while start > 1 and lines[start - 2].lstrip().startswith("template"):
            start -= 1
        return start, text.count("\n", 0, i) + 1
    return None


def _py_span(text: str, name: str) -> Span | None:
    """The def or class ``name`` (``Class.method`` for a method), decorators included (a Triton kernel too)."""
    node, nodes = None, ast.parse(text).body
    for part in name.split("."):
        kinds = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
        if (node := next((n for n in nodes if isinstance(n, kinds) and n.name == part), None)) is None:
            return None
        nodes = node.body
    return min([node.lineno] + [d.lineno for d in node.decorator_list]), node.end_lineno


def _find_parts(body: list[str], parts: Sequence[Part], name: str) -> list[Span]:
    """The lines (1-based, within the definition) of each part: its first line is the one line of ``body`` that
    contains the start text; its last, the first line from there on that contains the end text (None: the last
    line of the definition). A text that is gone, or a start text on two lines, raises: the code changed."""
    spans: list[Span] = []
    for part in parts:
        if len(part) != 2 or not isinstance(part[0], str) or not (part[1] is None or isinstance(part[1], str)):
            raise TypeError(f"show_source: lines= takes (first line's text, last line's text or None) pairs, got "
                            f"{part!r}; line numbers are not taken, as they move silently when the file changes")
        begin, end = part
        hits = [i for i, line in enumerate(body, 1) if begin in line]
        if not hits:
            raise LookupError(f"show_source: no line of {name!r} contains {begin!r} (the code changed?)")
        if len(hits) > 1:
            raise ValueError(f"show_source: {len(hits)} lines of {name!r} contain {begin!r} (its lines {hits}): "
                             "name a text that only the first line of the part has")
        a = hits[0]
        b = len(body) if end is None else next((i for i in range(a, len(body) + 1) if end in body[i - 1]), None)
        if b is None:
            raise LookupError(f"show_source: no line of {name!r} from {begin!r} on contains {end!r} "
                              "(the code changed?)")
        spans.append((a, b))
    if any(b >= c for (_, b), (c, _) in zip(spans, spans[1:])):
        raise ValueError(f"show_source: the parts of {name!r} overlap or are out of order: lines {spans}")
    return spans


def show_source(obj_or_path: object, name: str | None = None, *, lines: Part | Sequence[Part] | None = None,
                language: str | None = None) -> Excerpt:
    """The source of a function, class or method (``show_source(fn)``), or of the definition ``name`` in a
    module or a file of the repository (``show_source("enginelib/speed/csrc/q8.cpp", "int4q8_tile")``).
    ``lines=(first, last)``, or several such pairs, keeps parts of the excerpt: each from the one line that
    contains the text ``first`` through the next line that contains ``last`` (``None``: through the end of the
    definition). A long kernel shows its hot loop, each part cut becomes one ``...`` comment line, and a text that
    is no longer there (or a first text that two lines contain) raises instead of showing other code."""
    if name is None:  # an object; a triton.jit kernel keeps its Python function as .fn
        fn = getattr(obj_or_path, "fn", obj_or_path)
        file, name = Path(inspect.getsourcefile(fn)).resolve(), fn.__qualname__
        code, start = inspect.getsourcelines(fn)
        span: Span | None = (start, start + len(code) - 1)
    else:
        rel = Path(obj_or_path.__file__) if inspect.ismodule(obj_or_path) else Path(str(obj_or_path))
        file = next((p.resolve() for p in (ROOT / rel, ROOT / "enginelib" / rel) if p.is_file()), None)
        if file is None:
            raise FileNotFoundError(f"show_source: no file {rel} in {ROOT} or in its enginelib package")
        span = (_py_span if file.suffix == ".py" else _cpp_span)(file.read_text(), name)
    if span is None:
        raise LookupError(f"show_source: no definition of {name!r} in {file} (renamed or moved?)")
    first, last = span
    size = last - first + 1
    body = textwrap.dedent("".join(file.read_text().splitlines(keepends=True)[first - 1:last])).splitlines()
    if lines is None:
        keep = [(1, size)]
    else:
        parts = [lines] if len(lines) == 2 and not isinstance(lines[0], (tuple, list)) else list(lines)
        keep = _find_parts(body, parts, name)
    language = language or LANGUAGES.get(file.suffix, "text")
    cut = ("#" if language == "python" else "//") + " ..."
    out: list[str] = []
    for k, (a, b) in enumerate(keep):
        if a > (keep[k - 1][1] + 1 if k else 1):
            out.append(re.match(r"\s*", body[a - 1])[0] + cut)
        out += body[a - 1:b]
    if keep[-1][1] < size:  # indented as the first line cut
        out.append(re.match(r"\s*", body[keep[-1][1]])[0] + cut)
    path = file.relative_to(ROOT).as_posix() if file.is_relative_to(ROOT) else str(file)
    return Excerpt(name, path, tuple((first + a - 1, first + b - 1) for a, b in keep), language, "\n".join(out))
