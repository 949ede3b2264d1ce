"""The OpenAI-compatible server, tried with the real ``openai`` client against a real server process.

One server (``python -m enginelib.serve``) runs for the module on a free loopback
port; the offline ``LLM`` on the same model is the oracle for its greedy texts.
Every wait is bounded; traffic stays on 127.0.0.1.
"""
from __future__ import annotations

import asyncio
import json
import os
import random
import re
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from typing import Any

import openai
import pytest

from enginelib import LLM, SamplingParams
from enginelib.core.engine import Engine, EngineConfig
from enginelib.core.scheduler import SchedulerConfig
from enginelib.serve import ServerProcess
from enginelib.serve.async_engine import AsyncEngine
from enginelib.serve.engine_client import EngineDead, EngineOverloaded

from .test_stop_strings import ending_in_token

MODEL = "smollm2-135m"
HEAD_TIMEOUT = 2.0  # --timeout-head of the module's server
PROMPTS = [f"Here is fact number {i} about the {w}:" for i, w in
           enumerate(["sea", "moon", "forest", "desert", "city", "river", "mountain", "sky"] * 8)]


@pytest.fixture(scope="module")
def server():
    with ServerProcess(["--max-num-seqs", "32", "--timeout-head", str(HEAD_TIMEOUT)], timeout=240) as s:
        yield s


@pytest.fixture(scope="module")
def offline(real):
    return LLM.from_model(*real, max_num_seqs=32)


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url, api_key="none", max_retries=0, timeout=120)


def _get(server: ServerProcess, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(server.url.removesuffix("/v1") + path, timeout=30) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def _post(server: ServerProcess, path: str, body: bytes, headers: dict | None = None) -> tuple[int, dict, Any]:
    request = urllib.request.Request(server.url + path, data=body, method="POST",
                                     headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return r.status, json.loads(r.read()), r.headers  # case-insensitive
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read()), e.headers


def metric(server: ServerProcess, name: str) -> float:
    status, text = _get(server, "/metrics")
    assert status == 200
    found = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    assert found, f"{name} not in /metrics"
    return float(found.group(1))


def wait_idle(server: ServerProcess, timeout: float = 30.0) -> None:
    """Until the engine runs nothing and holds no block (or fail after ``timeout``)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (metric(server, "enginelib_num_requests_running") == 0 and metric(server, "enginelib_num_requests_waiting") == 0
                and metric(server, "enginelib_kv_blocks_used") == 0):
            return
        time.sleep(0.1)
    raise AssertionError(f"the server was not idle within {timeout} s: {_get(server, '/metrics')[1][:2000]}")


# --- the endpoints --------------------------------------------------------------------------

def test_health_and_models(server, client):
    assert _get(server, "/health") == (200, '{"status":"ok"}')
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_completion_equals_offline(client, offline):
    got = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=20, temperature=0)
    want = offline.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=20))[0]
    assert got.choices[0].text == want.outputs[0].text
    assert got.choices[0].finish_reason == want.outputs[0].finish_reason
    assert got.usage.prompt_tokens == len(want.prompt_token_ids)
    assert got.usage.completion_tokens == len(want.outputs[0].token_ids)


def test_chat_completion_and_stream_agree(client, offline):
    messages = [{"role": "user", "content": "Name three colours."}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0)
    want = offline.chat(messages, SamplingParams(temperature=0, max_tokens=24))[0].outputs[0]
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].message.content == want.text

    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == want.text
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert reasons == [want.finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(want.token_ids)
    assert len(chunks) > 3, "the answer came in one piece: it was not streamed"


def test_n_and_logprobs_through_the_openai_client(client, offline):
    """OpenAI's own client reads n choices and both logprobs shapes (the legacy completions one, chat's)."""
    got = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=6, temperature=0.8, seed=4, n=2,
                                    logprobs=2, extra_body={"ignore_eos": True})
    assert [c.index for c in got.choices] == [0, 1] and got.usage.completion_tokens == 12
    for choice in got.choices:
        lp = choice.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
        assert "".join(lp.tokens) == choice.text and all(v <= 0 for v in lp.token_logprobs)
    again = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=6, temperature=0.8, seed=4, n=2,
                                      extra_body={"ignore_eos": True})
    assert [c.text for c in again.choices] == [c.text for c in got.choices]
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                          temperature=0, logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    want = offline.generate(chat_prompt(offline), SamplingParams(temperature=0, max_tokens=4))[0].outputs[0]
    assert "".join(c.token for c in content) == want.text == chat.choices[0].message.content
    assert all(len(c.top_logprobs) == 3 and c.top_logprobs[0].token == c.token for c in content)


def chat_prompt(llm: LLM) -> str:
    return llm.engine.tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])


def test_stop_strings(client, offline):
    prompt = "Count: one, two, three, four, five,"
    free = offline.generate(prompt, SamplingParams(temperature=0, max_tokens=24))[0].outputs[0].text
    stop = free.strip().split()[2]  # a word the free-running text reaches
    want = offline.generate(prompt, SamplingParams(temperature=0, max_tokens=24, stop=[stop]))[0].outputs[0]
    got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0, stop=[stop])
    assert want.finish_reason == "stop" and stop not in want.text
    assert got.choices[0].text == want.text and got.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0, stop=stop,
                                         stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == want.text


def test_stop_string_edges_as_offline(client, offline, real):
    """Completed by the token that reaches max_tokens: "stop" and cut, streamed or not; and kept in the
    text with vLLM's include_stop_str_in_output."""
    tok = real[1]
    prompt = "Count: one, two, three, four, five,"
    ids = offline.generate(prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0].outputs[0].token_ids
    texts = [tok.decode(ids[:i], skip_special_tokens=True) for i in range(len(ids) + 1)]
    stop = ending_in_token(texts, 8)
    for include in (False, True):
        want = texts[8][:texts[8].index(stop) + len(stop) * include]
        extra = {"ignore_eos": True, "include_stop_str_in_output": include}
        got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, stop=[stop],
                                        extra_body=extra)
        assert (got.choices[0].text, got.choices[0].finish_reason) == (want, "stop"), include
        streamed = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0,
                                                  stop=[stop], stream=True, extra_body=extra))
        assert "".join(c.choices[0].text for c in streamed if c.choices) == want
        assert [c.choices[0].finish_reason for c in streamed if c.choices][-1] == "stop"


# --- many clients ----------------------------------------------------------------------------

async def _stream(client: openai.AsyncOpenAI, prompt: str, max_tokens: int, cut_after: int | None) -> str | None:
    """Stream one completion; with ``cut_after``, hang up after that many chunks (None: the text was cut)."""
    text, chunks = [], 0
    async with await client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                               stream=True) as stream:
        async for chunk in stream:
            text.append(chunk.choices[0].text if chunk.choices else "")
            chunks += 1
            if cut_after is not None and chunks >= cut_after:
                return None  # leaving the block closes the connection mid-stream
    return "".join(text)


async def _many(url: str, jobs: list[tuple[str, int, int | None]]) -> list[str | None]:
    async with openai.AsyncOpenAI(base_url=url, api_key="none", max_retries=0, timeout=300) as client:
        return await asyncio.wait_for(asyncio.gather(*(_stream(client, *job) for job in jobs)), 600)


def test_concurrent_streams_equal_offline(server, offline):
    prompts = PROMPTS[:8]
    want = [o.outputs[0].text for o in offline.generate(prompts, SamplingParams(temperature=0, max_tokens=16))]
    steps_before = metric(server, "enginelib_engine_steps_total")
    got = asyncio.run(_many(server.url, [(p, 16, None) for p in prompts]))
    assert got == want
    steps = metric(server, "enginelib_engine_steps_total") - steps_before
    assert steps < 8 * 16, f"{steps} steps for 8 streams of 16 tokens: the streams did not share steps"
    wait_idle(server)


def test_64_clients_with_random_disconnects(server, offline):
    rng = random.Random(0)
    jobs = [(p, 24, rng.choice([None, None, 1, 3, 8])) for p in PROMPTS]
    assert sum(cut is not None for _, _, cut in jobs) > 10
    got = asyncio.run(_many(server.url, jobs))
    whole = [i for i, (_, _, cut) in enumerate(jobs) if cut is None]
    want = offline.generate([PROMPTS[i] for i in whole], SamplingParams(temperature=0, max_tokens=24))
    assert [got[i] for i in whole] == [o.outputs[0].text for o in want]
    wait_idle(server)  # every cut request was aborted and every block given back


def test_a_client_that_gives_up_on_a_whole_answer_aborts_it(server):
    impatient = openai.OpenAI(base_url=server.url, api_key="none", max_retries=0, timeout=1.0)
    before = metric(server, "enginelib_generation_tokens_total")
    with pytest.raises(openai.APITimeoutError):  # 4000 tokens take far longer than a second, even on a GPU
        impatient.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=4000, temperature=0,
                                     extra_body={"ignore_eos": True})
    wait_idle(server)
    made = metric(server, "enginelib_generation_tokens_total") - before
    assert made < 4000, "the request ran to the end: the hang-up did not abort it"


# --- bad requests ---------------------------------------------------------------------------

def _chat(**fields) -> bytes:
    return json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4} | fields).encode()


BAD = {  # case: (path, body, status, words in the message, the param OpenAI's error names)
    "unknown model": ("/chat/completions", _chat(model="gpt-17"), 404, "does not exist", "model"),
    "missing messages": ("/chat/completions", json.dumps({"model": MODEL}).encode(), 400, "Field required", "messages"),
    "messages not a list": ("/chat/completions", _chat(messages="Hi"), 400, "list", "messages"),
    "unknown role": ("/chat/completions", _chat(messages=[{"role": "wizard", "content": "Hi"}]), 400, "user",
                     "messages.0.role"),
    "temperature a string": ("/chat/completions", _chat(temperature="hot"), 400, "number", "temperature"),
    "temperature negative": ("/chat/completions", _chat(temperature=-1), 400, ">= 0", "temperature"),
    "top_p out of range": ("/chat/completions", _chat(top_p=1.5), 400, "(0, 1]", "top_p"),
    "max_tokens zero": ("/chat/completions", _chat(max_tokens=0), 400, "at least 1 (0 only with echo", "max_tokens"),
    "max_tokens past the context": ("/completions", json.dumps({"model": MODEL, "prompt": "Hi",
                                                                 "max_tokens": 10**6}).encode(), 400, "context",
                                    "max_tokens"),
    "prompt missing": ("/completions", json.dumps({"model": MODEL}).encode(), 400, "Field required", "prompt"),
    "n above 16": ("/chat/completions", _chat(n=17), 400, "n=17", "n"),
    "not JSON": ("/chat/completions", b"{nope", 400, "JSON", None),
    "JSON not an object": ("/chat/completions", b"[1, 2]", 400, "object", None),
    "body too large": ("/completions", json.dumps({"model": MODEL, "prompt": "x" * (2 << 20)}).encode(), 413,
                       "bytes", None),
    "best_of": ("/completions", json.dumps({"model": MODEL, "prompt": "Hi", "best_of": 3}).encode(), 400,
                "best_of=3 is not supported", "best_of"),
    "logit_bias": ("/chat/completions", _chat(logit_bias={"42": 5}), 400, "logit_bias", "logit_bias"),
    "response_format": ("/chat/completions", _chat(response_format={"type": "json_schema"}), 400,
                        "response_format", "response_format.json_schema"),
    "tools": ("/chat/completions", _chat(tools=[{"type": "function", "function": {"name": "f"}}]), 400, "tools",
              "tools"),
    "a penalty out of range": ("/chat/completions", _chat(presence_penalty=2.5), 400, "presence_penalty must be in",
                               "presence_penalty"),
    "an unknown field": ("/chat/completions", _chat(temprature=0.5), 400, "unknown field 'temprature'", "temprature"),
    "echo on chat": ("/chat/completions", _chat(echo=True), 400, "echo", "echo"),
    "top_logprobs without logprobs": ("/chat/completions", _chat(top_logprobs=2), 400, "logprobs: true",
                                      "top_logprobs"),
    "an empty stop string": ("/chat/completions", _chat(stop=""), 400, "must not be empty", "stop"),
    "too many stop strings": ("/chat/completions", _chat(stop=[f"s{i}" for i in range(17)]), 400, "at most 16",
                              "stop"),
    "a lone surrogate": ("/completions", b'{"model": "%s", "prompt": "\\ud800"}' % MODEL.encode(), 400,
                         "surrogate", None),
    "nested too deeply": ("/completions", b"[" * 100_000 + b"]" * 100_000, 400, "nested", None),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_requests_get_openai_errors(server, case):
    path, body, status, words, param = BAD[case]
    got, answer, _ = _post(server, path, body)
    assert got == status, answer
    error = answer["error"]
    assert error["type"] == "invalid_request_error" and words in error["message"] and error["param"] == param, error


def test_structured_output_through_the_engine_process_with_the_openai_client(client):
    """The spec crosses the pipe to the engine-core process and its grammar compiles there; the SDK's own shapes."""
    schema = {"type": "object", "additionalProperties": False, "required": ["city"],
              "properties": {"city": {"type": "string", "maxLength": 20}}}
    answer = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Name the capital of France, as JSON."}], temperature=0,
        max_tokens=30, response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": schema}})
    assert answer.choices[0].finish_reason == "stop" and set(json.loads(answer.choices[0].message.content)) == {"city"}
    picked = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=5, temperature=0,
                                       extra_body={"guided_choice": ["Paris", "Rome"]})
    assert picked.choices[0].text in ("Paris", "Rome") and picked.choices[0].finish_reason == "stop"


def test_server_keeps_serving_after_bad_requests(server, client):
    for path, body, *_ in BAD.values():
        _post(server, path, body)
    assert client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, temperature=0).choices[0].text
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.chat.completions.create(model="gpt-17", messages=[{"role": "user", "content": "Hi"}])
    wait_idle(server)


def _closed_after(sock: socket.socket, limit: float = 30.0) -> tuple[float, bytes]:
    """Seconds until the server closes ``sock``, and what it sent before."""
    start, got = time.monotonic(), b""
    sock.settimeout(limit)
    while chunk := sock.recv(65536):
        got += chunk
    return time.monotonic() - start, got


def test_a_head_that_never_ends_loses_its_connection(server):
    """Slowloris: half a request line, then silence; or a second request trickled down a kept-alive connection.
    Each connection is closed once --timeout-head has passed, while a slow head within the limit is served."""
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        waited, got = _closed_after(sock)
        assert got == b"" and HEAD_TIMEOUT - 0.5 < waited < HEAD_TIMEOUT + 5
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert sock.recv(100).startswith(b"HTTP/1.1 200")
        sock.sendall(b"GET /hea")  # the next request on the kept-alive connection, never finished
        waited, _ = _closed_after(sock)
        assert HEAD_TIMEOUT - 0.5 < waited < HEAD_TIMEOUT + 5
    body = json.dumps({"model": MODEL, "prompt": "Hi", "max_tokens": 2, "temperature": 0}).encode()
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        time.sleep(HEAD_TIMEOUT / 2)
        sock.sendall(b"Content-Type: application/json\r\nConnection: close\r\nContent-Length: %d\r\n\r\n" % len(body))
        time.sleep(HEAD_TIMEOUT)  # the head is in: the body has its own, longer deadline
        sock.sendall(body)
        assert _closed_after(sock)[1].startswith(b"HTTP/1.1 200")


def test_full_queue_gets_503_with_retry_after():
    """With --max-waiting 0, a request is refused only once no seat is free: the one seat is taken first."""
    with ServerProcess(["--max-waiting", "0", "--max-num-seqs", "1", "--num-blocks", "64"], timeout=240) as server:
        client = openai.OpenAI(base_url=server.url, api_key="none", max_retries=0, timeout=120)
        running = client.completions.create(model=MODEL, prompt="Count:", max_tokens=1000, temperature=0,
                                            stream=True, extra_body={"ignore_eos": True})
        next(iter(running))  # admitted: it holds the one seat
        status, answer, headers = _post(server, "/chat/completions", _chat())
        assert status == 503 and headers.get("Retry-After") == "1"
        assert "waiting" in answer["error"]["message"]
        assert _get(server, "/health")[0] == 200
        running.close()
    assert server.process.returncode == 0, server.output()  # stop() sends SIGTERM: a clean shutdown, core and all


@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="finds the engine core through /proc (Linux)")
def test_a_dead_engine_core_stops_the_server():
    """vLLM's rule: once the engine is gone, /health stops answering 200 and the server exits non-zero, so that a
    supervisor restarts it (a live process with a dead engine would answer every request with an error)."""
    server = ServerProcess(["--num-blocks", "16"], timeout=240).start()
    try:
        pid = server.process.pid
        children = open(f"/proc/{pid}/task/{pid}/children").read().split()
        core, = (int(c) for c in children if b"spawn_main" in open(f"/proc/{c}/cmdline", "rb").read())
        os.kill(core, 9)  # the engine core, as the OOM killer would end it
        killed, health = time.monotonic(), []
        while server.process.poll() is None and time.monotonic() < killed + 60:
            try:
                health.append((_get(server, "/health")[0], round(time.monotonic() - killed, 3)))
            except OSError:  # the server has stopped listening
                pass
            time.sleep(0.01)
        assert server.process.poll() == 1, server.output()  # not killed by a signal: systemd restarts only failures
        # 200 until the kernel has torn the core down and closed its pipe (~0.1 s here), then 503 (or no answer: the
        # server has stopped listening) and never 200 again
        last_ok = max((t for status, t in health if status == 200), default=0.0)
        first_bad = next((i for i, (status, _) in enumerate(health) if status != 200), len(health))
        assert last_ok < 2 and all(status == 503 for status, _ in health[first_bad:]), health
        assert "the engine loop stopped" in server.output()
    finally:
        server.stop()


def test_the_server_exits_when_its_parent_dies(tmp_path):
    """ServerProcess passes --parent-pid: a parent killed without stopping it (a notebook kernel) leaves no server."""
    script = tmp_path / "parent.py"
    script.write_text("import os\nfrom enginelib.serve import ServerProcess\n"
                      "s = ServerProcess(['--num-blocks', '16'], timeout=240).start()\n"
                      "print(s.process.pid, flush=True)\nos._exit(0)\n")
    child = int(subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                               check=True).stdout.split()[-1])
    deadline = time.monotonic() + 30
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _alive(child), "the orphaned server is still running"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return not open(f"/proc/{pid}/stat").read().split()[2] == "Z" if os.path.exists(f"/proc/{pid}/stat") else True


# --- AsyncEngine, in this process ---------------------------------------------------------------

async def _collect(engine: AsyncEngine, prompt: str, params: SamplingParams) -> str:
    return "".join([d.text async for d in engine.generate(prompt, params)])


def test_async_engine_streams_equal_offline(real, offline):
    params = SamplingParams(temperature=0, max_tokens=12)
    engine = AsyncEngine(Engine(*real, EngineConfig(num_blocks=256)))
    try:
        async def main():
            return await asyncio.gather(*(_collect(engine, p, params) for p in PROMPTS[:4]))
        got = asyncio.run(main())
    finally:
        engine.shutdown()
    assert got == [o.outputs[0].text for o in offline.generate(PROMPTS[:4], params)]
    assert not engine._thread.is_alive()


def test_async_engine_abort_on_early_exit_and_queue_limit(real):
    engine = AsyncEngine(Engine(*real, EngineConfig(num_blocks=64, scheduler=SchedulerConfig(max_num_seqs=1))), max_waiting=1)
    long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)

    async def main():
        first = await engine.add_request(PROMPTS[0], long)
        await first.__anext__()          # admitted and running
        with pytest.raises(ValueError, match="max_tokens"):
            await engine.add_request(PROMPTS[2], SamplingParams(max_tokens=10**6))
        second = await engine.add_request(PROMPTS[1], long)  # waits for the one seat
        with pytest.raises(EngineOverloaded, match="retry later"):
            await engine.add_request(PROMPTS[2], long)
        first.close()                     # a client gone: aborted, its seat goes to the second
        delta = await asyncio.wait_for(second.__anext__(), 60)
        assert delta.text or delta.token_ids
        second.close()
        assert await engine.abort(second.request_id) is False  # already gone: nothing to do

    try:
        asyncio.run(main())
        deadline = time.monotonic() + 30
        while engine.stats.pool.used and time.monotonic() < deadline:
            time.sleep(0.05)
        assert engine.stats.pool.used == 0 and engine.stats.running == 0
    finally:
        engine.shutdown()


def test_async_engine_error_reaches_callers(real):
    engine = AsyncEngine(Engine(*real, EngineConfig(num_blocks=64)))

    def broken():
        raise RuntimeError("CUDA error: device-side assert (simulated)")
    engine.engine.step_deltas = broken

    async def main():
        with pytest.raises(EngineDead, match="simulated"):
            await _collect(engine, PROMPTS[0], SamplingParams(max_tokens=4))
        with pytest.raises(EngineDead):
            await engine.add_request(PROMPTS[0])

    asyncio.run(main())
    assert not engine.is_running and isinstance(engine.error, RuntimeError)



def test_speed_flags_become_the_engine_config():
    from enginelib.serve import engine_config, parse_args

    config = engine_config(parse_args(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}',
                                       "--compile-batch-sizes", "1,2,4"]))
    assert config.speculative.num_speculative_tokens == 3 and config.compile.batch_sizes == (1, 2, 4)
    assert engine_config(parse_args(["--compile"])).compile.batch_sizes == (1, 2, 4, 8, 16, 32)
    plain = engine_config(parse_args([]))
    assert plain.speculative is None and plain.compile is None
    for flags, message in ((["--speculative-config", '{"method": "draft", "num_speculative_tokens": 0}'],
                            "positive integer"),  # checked before the draft loads
                           (["--speculative-config", '{"num_speculative_tokens": 0}'], "positive integer"),
                           (["--speculative-config", '{"k": 2}'], "with the keys"),
                           (["--speculative-config", '{"model": "smollm2-135m"}'], "needs \"method\": \"draft\""),
                           (["--speculative-config", '{"method": "draft", "model": "nowhere.gguf"}'],
                            "draft model 'nowhere.gguf': no model at"),
                           (["--compile-batch-sizes", "4,2"], "increasing")):
        with pytest.raises(ValueError, match=message):
            engine_config(parse_args(flags))


def test_a_draft_model_is_served_from_the_command_line():
    """vLLM's way: '--speculative-config {"method": "draft", "model": ...}'; by default the served file, as stored
    (its Q4_1 layers: an int4 draft)."""
    from enginelib.serve import engine_config, parse_args
    from enginelib.speed.quant import QuantLinear, quant_info

    config = engine_config(parse_args(["--speculative-config", '{"method": "draft", "num_speculative_tokens": 3}']))
    spec = config.speculative
    assert spec.method == "draft" and spec.num_speculative_tokens == 3
    assert isinstance(spec.draft_model.lm_head, QuantLinear) and quant_info(spec.draft_model).fmt == "int4"


def test_a_served_draft_keeps_greedy_text_exact(offline):
    """Through the server, speculation by the file's int4 layers gives the plain engine's greedy text."""
    with ServerProcess(["--speculative-config", '{"method": "draft", "num_speculative_tokens": 3}'],
                       timeout=240) as server:
        client = openai.OpenAI(base_url=server.url, api_key="none", max_retries=0, timeout=120)
        messages = [{"role": "user", "content": "Name three colors."}]
        got = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0)
        accepted = metric(server, "enginelib_spec_decode_num_accepted_tokens_total")
        assert 0 < accepted <= metric(server, "enginelib_spec_decode_num_draft_tokens_total")
    want = offline.chat(messages, SamplingParams(temperature=0, max_tokens=24))[0].outputs[0]
    assert got.choices[0].message.content == want.text
