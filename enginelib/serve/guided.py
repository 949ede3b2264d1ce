"""Structured output as clients ask for it (chapter 12): OpenAI's ``response_format`` (``json_object``,
``json_schema``), vLLM's older ``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar`` and its
newer ``structured_outputs`` object, each turned into the engine's one :class:`StructuredOutput`.

At most one of them per request: two at once is a 400 naming the second. A spec that is malformed (a choice that is
not a list of strings) is refused here; one that does not compile (a regex with an unclosed group, a schema the
library cannot follow) is refused by the engine when it takes the request, and the route names the field then too.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from enginelib.structured_output import KINDS, StructuredOutput

NonEmpty = Annotated[str, Field(min_length=1)]


class JsonSchemaFormat(BaseModel):
    """OpenAI's ``response_format.json_schema``: a named schema (``strict`` is taken either way: the output always
    follows the schema exactly)."""
    model_config = ConfigDict(strict=True, extra="forbid")
    name: str = Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_-]+$")
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's ``response_format``: ``text`` (no constraint), ``json_object`` (any JSON object) or
    ``json_schema`` (with its ``json_schema``)."""
    model_config = ConfigDict(strict=True, extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsBody(BaseModel):
    """vLLM's ``structured_outputs``: exactly one of its fields, as :class:`StructuredOutput` takes them."""
    model_config = ConfigDict(strict=True, extra="forbid")
    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    json_object: bool | None = None
    regex: NonEmpty | None = None
    choice: list[NonEmpty] | None = Field(default=None, min_length=1)
    grammar: NonEmpty | None = None


class GuidedFields(BaseModel):
    """The fields of a request body that constrain its output (both endpoints take them)."""
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None  # a JSON Schema, or its text
    guided_regex: NonEmpty | None = None
    guided_choice: list[NonEmpty] | None = Field(default=None, min_length=1)
    guided_grammar: NonEmpty | None = None  # Lark, or llama.cpp's GBNF
    structured_outputs: StructuredOutputsBody | None = None


FIELDS = tuple(GuidedFields.model_fields)


class FieldError(ValueError):
    """A bad structured-output field: the route answers 400 naming ``param``."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def _asks(body: GuidedFields, name: str) -> bool:
    value = getattr(body, name)
    return value is not None and not (name == "response_format" and value.type == "text")


def guided_field(body: GuidedFields) -> str | None:
    """The one field that constrains the body's output (None: none does); two is a :class:`FieldError`."""
    form = body.response_format
    if form is not None and (form.type == "json_schema") != (form.json_schema is not None):
        raise FieldError(f"response_format: type {form.type!r} " + ("needs a json_schema: {'name': ..., 'schema': "
                         "{...}}" if form.json_schema is None else "takes no json_schema (type 'json_schema' does)"),
                         "response_format.json_schema")
    given = [name for name in FIELDS if _asks(body, name)]
    if len(given) > 1:
        raise FieldError(f"{given[0]} and {given[1]} both constrain the output: send one of them", given[1])
    return given[0] if given else None


def structured_output(body: GuidedFields) -> StructuredOutput | None:
    """The body's structured-output field as the engine's spec (None: unconstrained)."""
    name = guided_field(body)
    if name is None:
        return None
    value = getattr(body, name)
    try:
        if name == "response_format":
            return _response_format(value)
        if name == "structured_outputs":
            return StructuredOutput(**value.model_dump(by_alias=True, exclude_none=True))
        return StructuredOutput(**{name.removeprefix("guided_"): value})
    except ValueError as error:
        raise FieldError(f"{name}: {error}", name) from None


def _response_format(value: ResponseFormat) -> StructuredOutput:
    """json_object or json_schema (text asks nothing; :func:`guided_field` checked json_schema goes with its type)."""
    if value.type == "json_object":
        return StructuredOutput(json_object=True)
    return StructuredOutput(json=value.json_schema.schema_)


NOT_NULL = {"type": ["string", "number", "boolean", "array", "object"]}  # said without `not`: fuzzers model it


def _given(name: str, value: dict = NOT_NULL) -> dict:
    return {"required": [name], "properties": {name: value}}


def _alone(names: list[str], unset: dict[str, dict]) -> list[dict]:
    """JSON Schema's "at most one of ``names`` is set", as one ``anyOf`` branch per name (the others unset): a
    fuzzer can draw from that, where a ``not`` or an ``if`` per pair of names makes too many cases to model."""
    return [{"properties": {other: unset[other] for other in names if other != name}} for name in names]


def tighten_schemas(schemas: dict, body_names: list[str]) -> None:
    """Say in /openapi.json's JSON Schema what the checks above enforce: ``json_schema`` with type ``json_schema``
    only, and exactly one of ``structured_outputs``' fields; one constraining field at most in words (schemathesis
    cannot model it beside the bodies' other rules; its test keeps one)."""
    null = {"type": "null"}
    for name in body_names:  # said in words: with the rules already there, schemathesis cannot model another
        schemas[name]["description"] = (schemas[name].get("description", "") + " At most one of " + ", ".join(FIELDS)
                                        + " may constrain the output (response_format of type text does not).")
    schemas["ResponseFormat"]["allOf"] = [
        {"if": {"properties": {"type": {"const": "json_schema"}}}, "then": _given("json_schema", {"type": "object"}),
         "else": {"properties": {"json_schema": null}}}]
    off = {kind: {"enum": [None, False]} if kind == "json_object" else null for kind in KINDS}
    schemas["StructuredOutputsBody"]["anyOf"] = [  # exactly one: it is given, the others are not ("json": json_)
        {"allOf": [_given(kind, {"const": True} if kind == "json_object" else NOT_NULL), alone]}
        for kind, alone in zip(KINDS, _alone(list(KINDS), off))]
