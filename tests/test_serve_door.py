"""The server's door and its robustness, in process: the ASGI app over the real engine, called directly.

The key, the media type and the Host header are checked before a route reads
anything; every error is OpenAI's error object; and thousands of generated
bodies (wrong types, huge and tiny numbers, odd unicode, nesting) never stop the
engine: after each, a normal request succeeds and every block is free.
"""
from __future__ import annotations

import asyncio
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from enginelib.config import EngineConfig
from enginelib.core.engine import Engine
from enginelib.model.transformer import ModelConfig, Transformer
from enginelib.serve.app import BODY_TIMEOUT, build_app
from enginelib.serve.async_engine import AsyncEngine
from enginelib.serve.cli import parse_args

MODEL = "smollm2-135m"
KEY = "sekrit"
GOOD = {"model": MODEL, "prompt": "The sea is", "max_tokens": 2, "temperature": 0}


@pytest.fixture(scope="module")
def served(real):
    engine = AsyncEngine(Engine(*real, EngineConfig(num_blocks=64)), max_waiting=None)
    yield engine, build_app(engine, MODEL, api_key=KEY, loopback_only=True)
    engine.shutdown()


@dataclass
class Answer:
    status_code: int
    headers: dict[str, str]
    content: bytes

    @property
    def text(self) -> str:
        return self.content.decode(errors="replace")

    def json(self):
        return json.loads(self.content)


async def asgi(app, method: str, path: str, body: bytes, headers: dict[str, str]) -> Answer:
    """One HTTP request through an ASGI app, the way a server would pass it in (the whole body at once)."""
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
             "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items() if v],
             "client": ("127.0.0.1", 50000), "server": ("127.0.0.1", 8000)}
    sent = False
    answer = Answer(0, {}, b"")
    finished = asyncio.Event()

    async def receive() -> dict:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await finished.wait()  # the client stays until the answer is complete
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        if message["type"] == "http.response.start":
            answer.status_code = message["status"]
            answer.headers = {k.decode(): v.decode() for k, v in message.get("headers", [])}
        elif message["type"] == "http.response.body":
            answer.content += message.get("body", b"")
            if not message.get("more_body"):
                finished.set()
    await app(scope, receive, send)
    return answer


def call(app, method: str, path: str, *, body: bytes | None = None, headers: dict | None = None) -> Answer:
    """One request through the app, as a client on loopback with the key would send it (unless overridden)."""
    base = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json", "Host": "127.0.0.1:8000"}
    return asyncio.run(asgi(app, method, path, body or b"", base | (headers or {})))


def is_openai_error(response: Answer, status: int, code: str | None = None) -> dict:
    assert response.status_code == status, response.text[:500]
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"], error
    assert code is None or error["code"] == code, error
    return error


def test_the_key_is_required_on_v1_but_not_on_health(served):
    _, app = served
    is_openai_error(call(app, "GET", "/v1/models", headers={"Authorization": ""}), 401, "invalid_api_key")
    is_openai_error(call(app, "GET", "/v1/models", headers={"Authorization": "Bearer wrong"}), 401)
    assert call(app, "GET", "/v1/models").status_code == 200
    assert call(app, "GET", "/health", headers={"Authorization": ""}).status_code == 200


def test_a_body_that_is_not_declared_json_is_refused_before_it_is_read(served):
    """A web page can POST text/plain to loopback without asking first; it cannot send application/json."""
    _, app = served
    body = json.dumps(GOOD).encode()
    for media in ("text/plain", "application/x-www-form-urlencoded", ""):
        is_openai_error(call(app, "POST", "/v1/completions", body=body, headers={"Content-Type": media}), 415,
                        "unsupported_media_type")
    assert call(app, "POST", "/v1/completions", body=body,
                headers={"Content-Type": "application/json; charset=utf-8"}).status_code == 200


def test_a_rebound_host_name_is_refused_on_loopback(served):
    _, app = served
    is_openai_error(call(app, "GET", "/v1/models", headers={"Host": "evil.example"}), 400, "invalid_host")
    for host in ("localhost:8000", "127.0.0.1", "[::1]:8000"):
        assert call(app, "GET", "/v1/models", headers={"Host": host}).status_code == 200, host


def test_every_error_is_an_openai_error_object(served):
    _, app = served
    is_openai_error(call(app, "GET", "/v1/nothing"), 404)
    is_openai_error(call(app, "GET", "/v1/completions"), 405)
    is_openai_error(call(app, "POST", "/v1/completions", body=json.dumps(GOOD | {"model": "gpt-4o"}).encode()),
                    404, "model_not_found")
    is_openai_error(call(app, "POST", "/v1/completions", body=json.dumps(GOOD | {"max_tokens": "x" * 900_000}).encode()),
                    400)


def test_a_refused_value_is_not_echoed_whole(served):
    _, app = served
    response = call(app, "POST", "/v1/completions", body=json.dumps(GOOD | {"model": "m" * 500_000}).encode())
    is_openai_error(response, 404)
    assert len(response.content) < 1000


# --- the fuzz test ---------------------------------------------------------------------------

scalars = (st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=True, allow_infinity=True)
           | st.text(max_size=20))
anything = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                                              max_size=3),
                        max_leaves=6)
small_numbers = st.floats(-1e-30, 1e-30) | st.sampled_from([0, 1e-38, 1e-6, 0.5, 1, 2, 1e308, -0.0])
BODY = st.fixed_dictionaries(
    {"model": st.sampled_from([MODEL, MODEL, MODEL, "gpt-4o", ""]) | anything,
     "max_tokens": st.integers(1, 3) | st.integers(-3, 0) | st.sampled_from([2**64, 10**9]) | anything},
    optional={"prompt": st.text(max_size=30) | st.lists(st.integers(-5, 60_000), max_size=6) | anything,
              "messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "x"]),
                                                          "content": st.text(max_size=20) | anything}), max_size=2)
              | anything,
              "temperature": small_numbers | anything, "top_p": small_numbers | anything,
              "top_k": st.integers(-3, 60_000) | anything, "seed": st.integers(-2**65, 2**65) | anything,
              "stop": st.text(max_size=4) | st.lists(st.text(max_size=4), max_size=20) | anything,
              "stop_token_ids": st.lists(st.integers(-2, 60_000), max_size=3) | anything,
              "stream": st.booleans() | anything, "ignore_eos": st.booleans(), "n": st.integers(0, 3),
              "logprobs": st.booleans() | st.integers(0, 3), "best_of": st.integers(0, 3),
              "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}) | anything,
              "include_stop_str_in_output": st.booleans() | anything})

# Well-typed bodies with edge values: most reach the engine, where a value that slips through validation would fail
# (a 500) or stop the step. Temperatures down to the smallest subnormal: logits / 1e-39 overflow to inf.
TINY = st.floats(0, 1e-30) | st.sampled_from([5e-324, 1e-45, 1e-39, 1e-38, 1e-6, 1e-5])
EDGY = st.fixed_dictionaries(
    {"model": st.just(MODEL), "max_tokens": st.integers(1, 3)},
    optional={"prompt": st.text(min_size=1, max_size=30) | st.lists(st.integers(0, 49151), min_size=1, max_size=6),
              "temperature": TINY | st.floats(0, 4), "top_p": st.floats(0, 1) | st.sampled_from([5e-324, 1e-9, 1.0]),
              "top_k": st.integers(-2, 60_000) | st.sampled_from([-1, 0, 1, 49151, 49152]),
              "seed": st.integers(-2**65, 2**65) | st.sampled_from([0, 2**63 - 1, 2**63, 2**64 - 1, 2**64, -1]),
              "n": st.integers(1, 3), "logprobs": st.integers(0, 6), "ignore_eos": st.booleans(),
              "stop": st.lists(st.text(min_size=1, max_size=3), max_size=3), "stream": st.booleans()})


def _idle(engine: AsyncEngine, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s = engine.stats
        if s.running == 0 and s.waiting == 0 and s.pool.used == 0:
            return True
        time.sleep(0.01)
    return False


JUNK = st.sampled_from([None, b"", b"{", b"\xff\xfe", b"[]", b"null"])  # bytes that are not a JSON object
FUZZ_EXAMPLES = int(os.environ.get("ENGINELIB_FUZZ_EXAMPLES", "1000"))


def fuzz(examples: int):
    """Hypothesis draws ``examples`` bodies (and a route, and now and then bytes that are not JSON at all)."""
    def decorate(test):
        return settings(max_examples=examples, deadline=None,
                        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])(
            given(body=BODY | EDGY, chat=st.booleans(), junk=JUNK)(test))
    return decorate


def survives(served, body: dict, chat: bool, junk: bytes | None) -> None:
    """One generated request gets a 200 or an OpenAI 4xx; then the engine is alive and idle, and serves."""
    engine, app = served
    raw = junk if junk is not None else json.dumps(body).encode()
    response = call(app, "POST", "/v1/chat/completions" if chat else "/v1/completions", body=raw)
    assert response.status_code in (200, 400, 404, 413, 422), response.text[:300]
    if response.status_code != 200:
        is_openai_error(response, response.status_code)
    assert engine.is_running, engine.error
    assert _idle(engine), engine.stats
    assert call(app, "POST", "/v1/completions", body=json.dumps(GOOD).encode()).status_code == 200


@pytest.fixture(scope="module")
def toy_served(real):
    """The same app and engine over a toy model (random weights; the real tokenizer, vocabulary and context):
    a request costs milliseconds instead of the real model's ~0.1 s, so thousands of bodies fit in CI."""
    torch.manual_seed(0)
    cfg = ModelConfig.tiny(vocab_size=real[0].cfg.vocab_size, context_length=real[0].cfg.context_length)
    toy = Transformer(cfg).to(real[0].device).eval().requires_grad_(False)
    engine = AsyncEngine(Engine(toy, real[1], EngineConfig(num_blocks=64)), max_waiting=None)
    yield engine, build_app(engine, MODEL, api_key=KEY, loopback_only=True)
    engine.shutdown()


@fuzz(FUZZ_EXAMPLES)
def test_no_generated_body_stops_the_engine(toy_served, body, chat, junk):
    survives(toy_served, body, chat, junk)


@fuzz(FUZZ_EXAMPLES // 10)
def test_no_generated_body_stops_the_engine_of_the_real_model(served, body, chat, junk):
    """The real model's logits (larger than the toy's) meet the tiny temperatures and odd top-p/top-k values."""
    survives(served, body, chat, junk)


def test_the_deadlines_the_chapter_names_are_the_defaults():
    args = parse_args([])
    chapter = (Path(__file__).parents[1] / "book" / "11_serving.ipynb").read_text()
    for flag, value in {"--max-connections": args.max_connections, "--timeout-head": args.timeout_head,
                        "--timeout-keep-alive": args.timeout_keep_alive}.items():
        assert f"`{flag}` ({value:g})" in chapter or f"`{flag}` seconds ({value:g};" in chapter, flag
    assert f"its body {BODY_TIMEOUT:g}," in chapter
