"""The server's OpenAPI schema, as strict as its checks (chapter 11): FastAPI sees no request body (they are
validated by hand, :mod:`.protocol`), so the bodies, their ranges and the rules between fields, the error object
every 4xx and 5xx carries, and the bearer key are written into the schema here. Schemathesis fuzzes the server
against it."""
from __future__ import annotations

from pydantic import BaseModel

from enginelib.config import MAX_LOGPROBS, SEED_RANGE
from enginelib.serve.guided import tighten_schemas
from enginelib.serve.protocol import (MAX_N, MAX_PROMPTS, MAX_STOP_LENGTH, MAX_STOP_STRINGS, ChatBody,
                                      CompletionBody, TextPart, _Body)


class ErrorBody(BaseModel):
    """OpenAI's error object: the body of every 4xx and 5xx this server sends."""
    class Error(BaseModel):
        message: str
        type: str
        param: str | None
        code: str | None
    error: Error


ERRORS = {400: "a bad field, named in param", 401: "no valid API key (--api-key)", 404: "no such model or route",
          405: "the wrong method", 408: "the body came too slowly", 413: "the body is over --max-body-bytes",
          415: "the body is not sent as application/json", 500: "this request failed in the engine",
          503: "the engine is busy (Retry-After) or stopped"}


_K = {"minimum": 0, "maximum": MAX_LOGPROBS}
RANGES: dict[str, dict] = {  # what SamplingParams and the routes check, said in JSON Schema (the non-null branch)
    "temperature": {"minimum": 0}, "top_p": {"exclusiveMinimum": 0, "maximum": 1}, "top_k": {"minimum": -1},
    "min_p": {"minimum": 0, "maximum": 1}, "min_tokens": {"minimum": 0},
    "presence_penalty": {"minimum": -2, "maximum": 2}, "frequency_penalty": {"minimum": -2, "maximum": 2},
    "repetition_penalty": {"exclusiveMinimum": 0}, "seed": {"minimum": SEED_RANGE[0], "maximum": SEED_RANGE[1] - 1},
    "n": {"minimum": 1, "maximum": MAX_N}, "logprobs": _K, "top_logprobs": _K, "prompt_logprobs": _K,
    "max_tokens": {"minimum": 1}, "max_completion_tokens": {"minimum": 1},
}


def _if(field: str, kind: dict, then: dict) -> dict:
    """JSON Schema's "when ``field`` is given as ``kind``, the body must also be ``then``"."""
    return {"if": {"required": [field], "properties": {field: kind}}, "then": then}


def _strict_body(schema: dict, model: type[_Body], vocab_size: int, model_name: str | None) -> None:
    """Tighten pydantic's schema of a body to what the server checks: ranges, the one model, non-empty
    prompts of in-vocabulary ids, stop strings' limits, text-only content parts, and the rules between fields
    (JSON Schema's if/then). Only what depends on the prompt's tokens (its length against the context,
    min_tokens <= max_tokens, max_tokens agreeing with max_completion_tokens) is left unsaid."""
    props = schema["properties"]
    for name, limits in RANGES.items():
        for branch in props.get(name, {}).get("anyOf", []):
            if branch.get("type") in ("integer", "number"):
                branch.update(limits)
    if model_name is not None:  # any other name is a 404
        props["model"] = {"type": "string", "enum": [model_name], "title": "Model"}
    text = {"type": "string", "minLength": 1}
    stop = {"type": "string", "minLength": 1, "maxLength": MAX_STOP_LENGTH}
    props["stop"]["anyOf"] = [stop, {"type": "array", "maxItems": MAX_STOP_STRINGS, "items": stop}, {"type": "null"}]
    streaming = {"required": ["stream"], "properties": {"stream": {"const": True}}}
    rules = [_if("stream_options", {"type": "object"}, streaming),
             _if("prompt_logprobs", {"type": "integer"}, {"properties": {"stream": {"not": {"const": True}}}})]
    if model is CompletionBody:
        ids = {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0, "maximum": vocab_size - 1}}
        lists = [{"type": "array", "minItems": 1, "maxItems": MAX_PROMPTS, "items": one} for one in (text, ids)]
        props["prompt"] = {"title": "Prompt", "anyOf": [text, ids, *lists]}
        for name in ("max_tokens", "max_completion_tokens"):  # 0: the prompt echoed alone
            next(b for b in props[name]["anyOf"] if b.get("type") == "integer")["minimum"] = 0
            rules.append(_if(name, {"const": 0}, {"required": ["echo"], "properties": {"echo": {"const": True}}}))
    else:
        rules.append(_if("top_logprobs", {"type": "integer"},
                         {"required": ["logprobs"], "properties": {"logprobs": {"const": True}}}))
    schema["allOf"] = rules
    schema["additionalProperties"] = False  # an unknown field is a 400 (null for a REFUSED one is taken)


def openapi_schema(base: dict, keyed: bool, vocab_size: int = 2**31, model_name: str | None = None) -> dict:
    """FastAPI's schema of the routes, with what they really take and answer: the request bodies (validated by
    hand, so FastAPI cannot see them), the error object, the bearer key on /v1 when the server has one (``keyed``:
    a schema that asks for a key the server does not check is wrong too) and /metrics as Prometheus text."""
    template = "#/components/schemas/{model}"
    schemas = base.setdefault("components", {}).setdefault("schemas", {})
    for model in (CompletionBody, ChatBody, ErrorBody):
        schema = model.model_json_schema(ref_template=template)
        schemas.update(schema.pop("$defs", {}))
        if model is not ErrorBody:
            _strict_body(schema, model, vocab_size, model_name)
        schemas[model.__name__] = schema
    tighten_schemas(schemas, [CompletionBody.__name__, ChatBody.__name__])
    schemas["TextPart"] = TextPart.model_json_schema()
    message = schemas["Message"]
    message["additionalProperties"] = False  # a message's tool calls, audio...: refused by name
    message["properties"]["content"]["anyOf"] = [
        {"type": "string"}, {"type": "array", "items": {"$ref": template.format(model="TextPart")}}]
    if keyed:
        base["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    error = {"content": {"application/json": {"schema": {"$ref": template.format(model="ErrorBody")}}}}
    for path, operations in base.get("paths", {}).items():
        for operation in operations.values():
            if keyed and path.startswith("/v1"):
                operation["security"] = [{"bearer": []}]
            body = {"/v1/completions": CompletionBody, "/v1/chat/completions": ChatBody}.get(path)
            if body is not None:
                operation["requestBody"] = {"required": True, "content": {"application/json": {
                    "schema": {"$ref": template.format(model=body.__name__)}}}}
                operation["responses"]["200"] = {"description": "the answer, or with stream: true server-sent events",
                                                 "content": {"application/json": {}, "text/event-stream": {}}}
            if path == "/metrics":
                operation["responses"]["200"] = {"description": "Prometheus metrics",
                                                 "content": {"text/plain": {"schema": {"type": "string"}}}}
            keyed_route = keyed and path.startswith("/v1")
            for status, why in ERRORS.items():
                if status == 401 and not keyed_route:
                    continue  # no key asked for, none refused
                if body is not None or status in (401, 404, 405, 503):
                    operation["responses"].setdefault(str(status), {"description": why, **error})
    return base
