"""Structured output through the server (issue 40): OpenAI's ``response_format`` and vLLM's ``guided_*`` and
``structured_outputs`` fields are honoured on both endpoints (every answer that ends with "stop" parses), and a spec
that is malformed, does not compile, or comes with another is a 400 naming its field. The ASGI app runs in process
over the real model (as in test_openai_fields.py)."""
from __future__ import annotations

import json
import re

import pytest

from enginelib.config import EngineConfig
from enginelib.core.engine import Engine
from enginelib.serve.app import build_app
from enginelib.serve.async_engine import AsyncEngine
from enginelib.serve.cli import engine_config, parse_args

from .test_openai_fields import CHAT, MODEL, post
from .test_serve_door import _idle, call
from .test_structured import ANSWER, CITIES, DATE, PERSON, person


@pytest.fixture(scope="module")
def served(real):
    engine = AsyncEngine(Engine(*real, EngineConfig(num_blocks=256)), max_waiting=None)
    yield engine, build_app(engine, MODEL)
    engine.shutdown()


def text_of(answer: dict) -> str:
    choice = answer["choices"][0]
    return choice["text"] if "text" in choice else choice["message"]["content"]


ASKED = {  # field: (path, the request's own fields, value, the check its text must pass)
    "response_format json_schema": (
        "/chat/completions", {"messages": [{"role": "user", "content": "Describe a famous scientist as JSON."}]},
        {"response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}}, person),
    "response_format json_object": (
        "/chat/completions", {"messages": [{"role": "user", "content": "What is 2 + 2? Answer as a JSON object."}]},
        {"response_format": {"type": "json_object"}}, lambda t: isinstance(json.loads(t), dict)),
    "guided_json": ("/completions", {"prompt": "A person as JSON:"}, {"guided_json": PERSON}, person),
    "guided_choice": ("/completions", {"prompt": "The capital of France is"}, {"guided_choice": list(CITIES)},
                      lambda t: t in CITIES),
    "guided_regex": ("/chat/completions", {"messages": [{"role": "user", "content": "When did Apollo 11 land?"}]},
                     {"guided_regex": DATE}, lambda t: re.fullmatch(DATE, t) is not None),
    "guided_grammar": ("/completions", {"prompt": "12 times 7:"}, {"guided_grammar": ANSWER},
                       lambda t: re.fullmatch(r"The answer is [0-9]{1,4}\.", t) is not None),
    "structured_outputs": ("/chat/completions", {"messages": CHAT},
                           {"structured_outputs": {"choice": ["red", "green", "blue"]}},
                           lambda t: t in ("red", "green", "blue")),
}


@pytest.mark.parametrize("case", ASKED)
def test_each_structured_field_is_honoured_and_its_output_parses(served, case):
    path, base, field, check = ASKED[case]
    status, answer = post(served[1], path, **base, **field, max_tokens=60, temperature=0)
    assert status == 200, answer
    assert answer["choices"][0]["finish_reason"] == "stop" and check(text_of(answer)), answer
    free = post(served[1], path, **base, max_tokens=8, temperature=0)[1]
    assert text_of(free) != text_of(answer)  # the field changed the answer: it was not ignored


def test_a_streamed_choice_comes_whole_and_n_samples_all_parse(served):
    app = served[1]
    status, events = post(app, "/completions", prompt="My favourite city is", guided_choice=list(CITIES),
                          stream=True, max_tokens=10, temperature=0)
    assert status == 200 and "".join(c["text"] for e in events for c in e["choices"]) in CITIES, events
    status, answer = post(app, "/chat/completions", messages=CHAT, n=3, temperature=1.0, seed=7, max_tokens=40,
                          response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}})
    assert status == 200 and all(person(c["message"]["content"]) for c in answer["choices"]), answer


BAD = {  # case: (the fields, the param the 400 names, words in its message)
    "a regex that does not compile": ({"guided_regex": "(ab"}, "guided_regex", "regex is not usable"),
    "a schema of an unknown type": ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "nonsense"}}}}, "response_format", "json is not usable"),
    "a grammar with an undefined rule": ({"guided_grammar": "start: missing"}, "guided_grammar", "grammar"),
    "guided_json not JSON": ({"guided_json": "{oops"}, "guided_json", "not valid JSON"),
    "two at once": ({"guided_choice": ["a"], "guided_regex": "a"}, "guided_choice", "both constrain"),
    "json_schema without its schema": ({"response_format": {"type": "json_schema"}}, "response_format.json_schema",
                                       "needs a json_schema"),
    "an unknown format": ({"response_format": {"type": "xml"}}, "response_format.type", "json_schema"),
    "an empty choice list": ({"guided_choice": []}, "guided_choice", "at least 1"),
    "two kinds in structured_outputs": ({"structured_outputs": {"regex": "a", "choice": ["a"]}},
                                        "structured_outputs", "regex and choice"),
    "a vLLM option not implemented": ({"structured_outputs": {"choice": ["a"], "disable_fallback": True}},
                                      "structured_outputs.disable_fallback", "Extra inputs"),
}


@pytest.mark.parametrize("case", BAD)
def test_a_bad_structured_field_is_a_400_naming_it(served, case):
    engine, app = served
    fields, param, words = BAD[case]
    status, answer = post(app, "/completions", prompt="Hi", max_tokens=4, **fields)
    assert status == 400 and answer["error"]["param"] == param and words in answer["error"]["message"], answer
    assert _idle(engine), engine.stats


def test_jump_forward_is_a_server_flag():
    assert engine_config(parse_args(["--jump-forward"])).jump_forward and not engine_config(parse_args([])).jump_forward


def test_openapi_declares_the_structured_fields(served):
    schemas = call(served[1], "GET", "/openapi.json").json()["components"]["schemas"]
    for body in ("CompletionBody", "ChatBody"):
        fields = schemas[body]["properties"]
        assert {"response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
                "structured_outputs"} <= set(fields)
    assert schemas["ResponseFormat"]["properties"]["type"]["enum"] == ["text", "json_object", "json_schema"]
    assert schemas["JsonSchemaFormat"]["required"] == ["name", "schema"]
