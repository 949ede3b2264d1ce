"""Schemathesis against the server's own /openapi.json (issue 40): every check, seeded, a bounded number of examples
per operation, positive and negative bodies, over the ASGI app on the real model. No 5xx, and the schema is as strict
as the validation: what it calls valid is served (not a 400), what it calls invalid is refused.

JSON Schema cannot say what depends on the prompt's tokens: prompt + max_tokens within the context, min_tokens <=
max_tokens, and max_tokens agreeing with max_completion_tokens; nor whether a regex, a grammar or a JSON Schema
compiles (structured output). One rule it can state, at most one field constraining the output, schemathesis cannot
model beside the others: the schema says it in words. A hook keeps the positive bodies inside those (a spec that
does not compile is replaced by one that does, of the same field; only the first constraining field is kept) and
short: max_tokens 4 at most, two prompts, two choices, so the run stays well under a minute on 2 cores; negative
bodies are sent as generated.
"""
from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, given, seed, settings
from schemathesis.generation.modes import GenerationMode

from enginelib.config import EngineConfig
from enginelib.core.engine import Engine
from enginelib.model.grammar import GrammarCompiler, compiler_for
from enginelib.serve.app import build_app
from enginelib.serve.async_engine import AsyncEngine
from enginelib.serve.guided import FIELDS
from enginelib.structured_output import StructuredOutput

MODEL = "smollm2-135m"
MAX_TOKENS, MAX_PROMPT, EXAMPLES = 4, 48, 12
COMPILER: list[GrammarCompiler] = []  # the real tokenizer's, set by the fixture: the hook asks it what compiles
# a spec of each kind that compiles, put in place of a generated one that does not
USABLE = {"json": {"type": "object"}, "regex": "[a-z]{1,8}", "grammar": 'start: "yes" | "no"'}


@pytest.fixture(scope="module")
def schema(real):
    COMPILER[:] = [compiler_for(real[1], real[0].cfg.vocab_size)]
    engine = AsyncEngine(Engine(*real, EngineConfig(num_blocks=256)), max_waiting=None)
    loaded = schemathesis.openapi.from_asgi("/openapi.json", build_app(engine, MODEL))
    loaded.hook(bounded)
    yield loaded
    engine.shutdown()


def _short(prompt: object) -> object:
    """A prompt (or a list of them) cut to a few tokens' worth: within the context whatever max_tokens is."""
    if isinstance(prompt, str):
        return prompt[:MAX_PROMPT]
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        return [_short(p) for p in prompt[:2]]
    return prompt[:MAX_PROMPT] if isinstance(prompt, list) else prompt


def _number(value: object) -> bool:
    """An integer field's value as the schema allows it: an int or a whole-number float (not a bool)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def bounded(context, case):  # noqa: ARG001 - schemathesis' hook signature
    """map_case: a positive body kept inside the rules between fields JSON Schema cannot state, and short."""
    body = case.body
    if case.meta is None or not case.meta.generation.mode.is_positive or not isinstance(body, dict):
        return case
    asked = [body[k] for k in ("max_tokens", "max_completion_tokens") if _number(body.get(k))]
    limit = min(asked + [MAX_TOKENS])  # 0 stays 0 (an echo)
    body["max_tokens"] = limit
    body.pop("max_completion_tokens", None)
    if _number(body.get("min_tokens")):  # 5.0 is the integer 5 to the schema and the server: clamp it too
        body["min_tokens"] = min(body["min_tokens"], limit)
    if _number(body.get("n")):
        body["n"] = min(body["n"], 2)
    if "prompt" in body:
        body["prompt"] = _short(body["prompt"])
    for message in body.get("messages", []) if isinstance(body.get("messages"), list) else []:
        if isinstance(message, dict) and isinstance(message.get("content"), str):
            message["content"] = message["content"][:MAX_PROMPT]
    _one_compilable_spec(body)
    return case


def _usable(kind: str, value: object) -> bool:
    try:
        COMPILER[0].matcher(StructuredOutput(**{kind: value}))
    except ValueError:
        return False
    return True


def _one_compilable_spec(body: dict) -> None:
    """The first field constraining the output, the others dropped; in it, a generated regex, grammar or JSON
    Schema that the library cannot compile, replaced by one that it can (client errors the schema does not model;
    their 400s are tested in test_serve_structured.py)."""
    asking = [name for name in FIELDS if body.get(name) is not None and not (
        name == "response_format" and isinstance(body[name], dict) and body[name].get("type") == "text")]
    for name in asking[1:]:
        del body[name]
    places = [(body, f"guided_{kind}", kind) for kind in USABLE]
    if isinstance(fmt := body.get("response_format"), dict) and isinstance(fmt.get("json_schema"), dict):
        places.append((fmt["json_schema"], "schema", "json"))
    if isinstance(outputs := body.get("structured_outputs"), dict):
        places += [(outputs, kind, kind) for kind in USABLE]
    for holder, key, kind in places:
        if holder.get(key) is not None and not _usable(kind, holder[key]):
            holder[key] = USABLE[kind]


bounded.__name__ = "map_case"


def test_schemathesis_finds_nothing(schema):
    """Each operation, positive and negative, with all of schemathesis' checks: a failure raises."""
    ran = 0
    for result in schema.get_all_operations():
        operation = result.ok()
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            if mode is GenerationMode.NEGATIVE and operation.method.upper() != "POST":
                continue  # a GET without parameters has nothing to get wrong
            @seed(40)
            @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
                      suppress_health_check=list(HealthCheck))
            @given(case=operation.as_strategy(generation_mode=mode))
            def check(case) -> None:
                case.call_and_validate()
            check()
            ran += 1
    assert ran == 7  # the three GET routes, and both bodies' routes in both modes
