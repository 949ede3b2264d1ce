"""Code on screen, read by name when the cell runs: a chapter shows the kernel it times, never a pasted copy
that drifts from it, and a renamed function fails the chapter (LookupError) instead of showing nothing."""
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


def show_source(obj_or_path: object, name: str | None = None, *, lines: Span | Sequence[Span] | None = None,
                language: str | None = None) -> Excerpt:
    """The source of a function, class or method (``show_source(fn)``), or of the definition ``name`` in a
    module or a file of the repository (``show_source("enginelib/speed/csrc/q8.cpp", "int4q8_tile")``).
    ``lines=(a, b)``, or several such pairs, keeps those lines of the excerpt (1-based, counted from its own
    first line): a long kernel shows its hot loop, and each part cut becomes one ``...`` comment line."""
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
    keep = [(1, size)] if lines is None else [tuple(lines)] if isinstance(lines[0], int) else list(lines)
    if any(not 1 <= a <= b <= size for a, b in keep) or any(b >= c for (_, b), (c, _) in zip(keep, keep[1:])):
        raise ValueError(f"show_source: lines={lines} are not in order within the {size} lines of {name!r}")
    body = textwrap.dedent("".join(file.read_text().splitlines(keepends=True)[first - 1:last])).splitlines()
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
