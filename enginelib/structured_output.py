"""What a request's output must match (structured output, chapter 12), as plain data: no grammar library and no
torch, so :class:`~enginelib.config.SamplingParams` can hold it and a malformed spec fails where it is written.
Whether it compiles against a tokenizer is :mod:`enginelib.model.grammar`'s question, asked when the engine takes
the request; :mod:`enginelib.model.structured` holds each request's matcher and its token mask per step."""
from __future__ import annotations

import json as _json
from dataclasses import dataclass
from typing import Any

KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredOutput:
    """Exactly one of (vLLM's ``StructuredOutputsParams``, field for field):

    - ``json``: a JSON Schema, as a dict or its JSON text; the output is one JSON value it validates;
    - ``json_object``: True for any JSON object (OpenAI's ``response_format: {"type": "json_object"}``);
    - ``regex``: a regular expression (Rust ``regex`` syntax) the whole output matches;
    - ``choice``: the output is one of these strings;
    - ``grammar``: a context-free grammar, in Lark syntax (llguidance's dialect) or llama.cpp's GBNF.
    """
    json: dict[str, Any] | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        given = [kind for kind in KINDS if getattr(self, kind) not in (None, False)]
        if len(given) != 1:
            which = f"{' and '.join(given)} are set" if given else "none is set"
            raise ValueError(f"structured output takes exactly one of {', '.join(KINDS)}; {which}: pass e.g. "
                             "StructuredOutput(json={'type': 'object'}) or StructuredOutput(choice=['yes', 'no'])")
        if not isinstance(self.json_object, bool):
            raise ValueError(f"structured output: json_object must be True or False, got {self.json_object!r}")
        if self.json is not None:
            object.__setattr__(self, "json", _schema(self.json))
        for kind in ("regex", "grammar"):
            value = getattr(self, kind)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured output: {kind} must be a non-empty string, got {value!r}")
        if self.choice is not None:
            choice = self.choice
            if isinstance(choice, str) or not isinstance(choice, (list, tuple)) or not choice:
                raise ValueError(f"structured output: choice must be a non-empty list of strings, got {choice!r}: "
                                 "pass e.g. choice=['yes', 'no']")
            if not all(isinstance(c, str) and c for c in choice):
                raise ValueError(f"structured output: every choice must be a non-empty string, got {list(choice)!r}")
            object.__setattr__(self, "choice", tuple(choice))

    @property
    def kind(self) -> str:
        """Which of :data:`KINDS` this spec sets."""
        return next(kind for kind in KINDS if getattr(self, kind) not in (None, False))

    @property
    def key(self) -> str:
        """The spec as canonical text (a schema's keys sorted): two requests asking the same share a compiled
        grammar."""
        value = getattr(self, self.kind)
        return _json.dumps([self.kind, list(value) if isinstance(value, tuple) else value], sort_keys=True)

    def __hash__(self) -> int:  # a schema is a dict: hash the canonical text instead
        return hash(self.key)


def _schema(schema: object) -> dict[str, Any]:
    """A JSON Schema as a dict: given as one, or as its JSON text. Only its shape is checked here; whether the
    grammar library can compile it is checked when the engine takes the request."""
    if isinstance(schema, str):
        try:
            schema = _json.loads(schema)
        except ValueError as error:
            raise ValueError(f"structured output: json is not valid JSON text ({error}): pass a JSON Schema, "
                             "e.g. {'type': 'object'}") from None
    if not isinstance(schema, dict):
        raise ValueError(f"structured output: json must be a JSON Schema object (a dict, or its JSON text), got "
                         f"{type(schema).__name__}: pass e.g. {{'type': 'object'}}")
    try:
        _json.dumps(schema, allow_nan=False)
    except (TypeError, ValueError) as error:
        raise ValueError(f"structured output: the JSON Schema is not plain JSON data ({error})") from None
    return schema
