"""The OpenAI fields people use (issue 26): ``logprobs``/``top_logprobs``, ``n``, a list of prompts; and the
waiting-queue limit and a failing proposer.

The ASGI app runs in process over the real model (as in test_serve_door.py); logprobs are checked against
``torch.log_softmax`` of the model's own logits, recomputed here without the engine.
"""
from __future__ import annotations

import asyncio
import json

import pytest
import torch

from enginelib import LLM, SamplingParams
from enginelib.config import EngineConfig, SchedulerConfig, SpeculativeConfig
from enginelib.core.engine import Engine
from enginelib.serve.app import build_app
from enginelib.serve.async_engine import AsyncEngine
from enginelib.serve.engine_client import EngineOverloaded

from .test_serve_door import _idle, call

MODEL = "smollm2-135m"
CHAT = [{"role": "user", "content": "Name a colour."}]
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def served(real):
    engine = AsyncEngine(Engine(*real, EngineConfig(num_blocks=256)), max_waiting=None)
    yield engine, build_app(engine, MODEL)
    engine.shutdown()


def post(app, path: str, **body) -> tuple[int, dict | list[dict]]:
    """POST ``body`` (plus the model); a stream comes back as its list of JSON events, [DONE] left out."""
    answer = call(app, "POST", f"/v1{path}", body=json.dumps({"model": MODEL} | body).encode())
    if not body.get("stream") or answer.status_code != 200:
        return answer.status_code, answer.json()
    events = [line.removeprefix("data: ") for line in answer.text.split("\n\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return answer.status_code, [json.loads(e) for e in events[:-1]]


def greedy_reference(model, prompt_ids: list[int], steps: int) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy tokens and each position's log-probabilities, from whole forward passes with no cache."""
    ids, rows = list(prompt_ids), []
    with torch.inference_mode():
        for _ in range(steps):
            logits = model(torch.tensor([ids], device=model.device))[0, -1].float()
            rows.append(torch.log_softmax(logits, dim=-1).cpu())
            ids.append(int(logits.argmax()))
    return ids[len(prompt_ids):], rows


# --- logprobs ------------------------------------------------------------------------------------

def test_completion_logprobs_are_the_models_log_softmax(served, real):
    model, tokenizer = real
    status, answer = post(served[1], "/completions", prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3,
                          ignore_eos=True)
    assert status == 200, answer
    choice = answer["choices"][0]
    lp = choice["logprobs"]
    ids, rows = greedy_reference(model, tokenizer.encode(PROMPT), 6)
    tol = 1e-4 if model.dtype == torch.float32 else 2e-2
    assert lp["tokens"] == [tokenizer.token(t) for t in ids] and "".join(lp["tokens"]) == choice["text"]
    for i, (token, row) in enumerate(zip(ids, rows)):
        assert lp["token_logprobs"][i] == pytest.approx(row[token].item(), abs=tol)
        top = row.topk(3)
        want = {tokenizer.token(int(t)): v.item() for v, t in zip(top.values, top.indices)}
        assert list(lp["top_logprobs"][i]) == list(want)  # best first, the greedy token among them
        assert list(lp["top_logprobs"][i].values()) == pytest.approx(list(want.values()), abs=tol)
        assert lp["token_logprobs"][i] == max(lp["top_logprobs"][i].values())  # greedy: the best one
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(6)]
    no_logprobs = post(served[1], "/completions", prompt=PROMPT, max_tokens=6, temperature=0, ignore_eos=True)[1]
    assert no_logprobs["choices"][0]["logprobs"] is None and no_logprobs["choices"][0]["text"] == choice["text"]


def test_chat_logprobs_shape_plain_and_streamed(served):
    app = served[1]
    status, answer = post(app, "/chat/completions", messages=CHAT, max_tokens=5, temperature=0, logprobs=True,
                          top_logprobs=2)
    assert status == 200, answer
    content = answer["choices"][0]["logprobs"]["content"]
    assert len(content) == answer["usage"]["completion_tokens"]
    assert "".join(c["token"] for c in content) == answer["choices"][0]["message"]["content"]
    for c in content:
        assert set(c) == {"token", "logprob", "bytes", "top_logprobs"} and c["bytes"] == list(c["token"].encode())
        assert len(c["top_logprobs"]) == 2 and all(set(t) == {"token", "logprob", "bytes"} for t in c["top_logprobs"])
        assert c["top_logprobs"][0]["logprob"] >= c["top_logprobs"][1]["logprob"]
        assert c["top_logprobs"][0]["token"] == c["token"] and c["top_logprobs"][0]["logprob"] == c["logprob"]
    status, events = post(app, "/chat/completions", messages=CHAT, max_tokens=5, temperature=0, logprobs=True,
                          top_logprobs=2, stream=True)
    streamed = [c for e in events for ch in e["choices"] if ch["logprobs"] for c in ch["logprobs"]["content"]]
    assert [c["token"] for c in streamed] == [c["token"] for c in content]
    assert [c["logprob"] for c in streamed] == pytest.approx([c["logprob"] for c in content], abs=1e-4)
    without = post(app, "/chat/completions", messages=CHAT, max_tokens=5, temperature=0, logprobs=False)[1]
    assert without["choices"][0]["logprobs"] is None


def test_logprobs_with_sampling_and_through_llm(real):
    """Sampled tokens get the raw model's logprobs too; offline outputs carry one entry per token."""
    llm = LLM.from_model(*real, num_blocks=64)
    out = llm.generate([PROMPT], SamplingParams(temperature=0.8, seed=3, max_tokens=5, logprobs=1,
                                                ignore_eos=True))[0].outputs[0]
    assert [e.token_id for e in out.logprobs] == out.token_ids and all(len(e.top) == 1 for e in out.logprobs)
    assert all(e.logprob <= e.top[0][1] <= 0 for e in out.logprobs)
    assert llm.generate([PROMPT], SamplingParams(max_tokens=2))[0].outputs[0].logprobs is None


def test_logprobs_values_are_checked():
    for bad in (-1, 21, True, 2.0):
        with pytest.raises(ValueError, match="logprobs must be an integer from 0 to 20"):
            SamplingParams(logprobs=bad)


def test_verified_runs_get_the_same_logprobs(real):
    """With speculation a step emits a verified run: each of its tokens gets the logprobs of its own row,
    the same as one token a step gives (greedy, so the tokens are the same too)."""
    prompt = "one two three four one two three four one two three four one two"
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=2, ignore_eos=True)
    plain = LLM.from_model(*real, num_blocks=64).generate([prompt], params)[0].outputs[0]
    spec_llm = LLM.from_model(*real, num_blocks=64,
                              speculative=SpeculativeConfig(method="ngram", num_speculative_tokens=3))
    spec = spec_llm.generate([prompt], params)[0].outputs[0]
    assert spec_llm.engine.runner.spec_stats.accepted > 0, "no guess was kept: nothing was verified in runs"
    tol = 1e-4 if real[0].dtype == torch.float32 else 2e-2
    assert [e.token_id for e in spec.logprobs] == spec.token_ids == plain.token_ids
    assert [e.logprob for e in spec.logprobs] == pytest.approx([e.logprob for e in plain.logprobs], abs=tol)
    assert [[t for t, _ in e.top] for e in spec.logprobs] == [[t for t, _ in e.top] for e in plain.logprobs]


# --- n and lists of prompts ----------------------------------------------------------------------

def texts(answer: dict) -> list[str]:
    return [c["text"] for c in answer["choices"]]


def test_n_choices_are_seeded_and_reproducible(served, real):
    engine, app = served
    sampled = {"temperature": 0.9, "top_k": 50, "seed": 7, "max_tokens": 8, "ignore_eos": True}
    hits = engine.stats.prefix_cache.hit_tokens
    long = PROMPT + " a city that many people visit every year, and its museums are famous" * 2
    status, answer = post(app, "/completions", prompt=long, n=3, **sampled)
    assert status == 200, answer
    assert [c["index"] for c in answer["choices"]] == [0, 1, 2] and len(set(texts(answer))) > 1
    assert engine.stats.prefix_cache.hit_tokens - hits >= 2 * 16, "the children did not share the prompt's blocks"
    assert texts(post(app, "/completions", prompt=long, n=3, **sampled)[1]) == texts(answer)
    for j in range(3):  # choice j is the request with seed + j
        alone = post(app, "/completions", prompt=long, **(sampled | {"seed": 7 + j}))[1]
        assert texts(alone) == [texts(answer)[j]]
    prompt_tokens = len(real[1].encode(long))
    assert answer["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": 24,
                               "total_tokens": prompt_tokens + 24}
    greedy = post(app, "/chat/completions", messages=CHAT, n=2, max_tokens=6, temperature=0)[1]
    assert [c["index"] for c in greedy["choices"]] == [0, 1]
    assert greedy["choices"][0]["message"] == greedy["choices"][1]["message"]


def test_n_streamed_chunks_name_their_choice(served):
    app = served[1]
    body = {"messages": CHAT, "n": 2, "seed": 11, "temperature": 1.0, "max_tokens": 6, "ignore_eos": True}
    whole = post(app, "/chat/completions", **body)[1]
    status, events = post(app, "/chat/completions", stream=True, stream_options={"include_usage": True}, **body)
    assert status == 200
    parts: dict[int, list[str]] = {0: [], 1: []}
    finished = []
    for event in events[:-1]:
        (choice,) = event["choices"]
        parts[choice["index"]].append(choice["delta"].get("content") or "")
        if choice["finish_reason"]:
            finished.append(choice["index"])
    assert sorted(finished) == [0, 1]
    assert ["".join(parts[i]) for i in (0, 1)] == [c["message"]["content"] for c in whole["choices"]]
    assert events[-1]["choices"] == [] and events[-1]["usage"] == whole["usage"]


def test_a_list_of_prompts_gets_a_choice_per_prompt_and_sample(served, real):
    app, tokenizer = served[1], real[1]
    prompts = ["The sea is", "Once upon a time"]
    sampled = {"temperature": 0.8, "seed": 5, "max_tokens": 5, "ignore_eos": True}
    status, answer = post(app, "/completions", prompt=prompts, n=2, **sampled)
    assert status == 200, answer
    assert [c["index"] for c in answer["choices"]] == [0, 1, 2, 3]
    for i, prompt in enumerate(prompts):
        for j in range(2):  # choice i * n + j
            alone = post(app, "/completions", prompt=prompt, **(sampled | {"seed": 5 + j}))[1]
            assert texts(alone) == [texts(answer)[i * 2 + j]]
    prompt_tokens = sum(len(tokenizer.encode(p)) for p in prompts)
    assert answer["usage"]["prompt_tokens"] == prompt_tokens and answer["usage"]["completion_tokens"] == 20
    as_ids = post(app, "/completions", prompt=[tokenizer.encode(p) for p in prompts], n=2, **sampled)[1]
    assert texts(as_ids) == texts(answer)


BAD = {  # case: (path, body, the param the 400 names, words in its message)
    "n too large": ("/chat/completions", {"messages": CHAT, "n": 17}, "n", "n=17"),
    "n zero": ("/completions", {"prompt": "Hi", "n": 0}, "n", "n=0"),
    "top_logprobs without logprobs": ("/chat/completions", {"messages": CHAT, "top_logprobs": 2}, "top_logprobs",
                                      "logprobs: true"),
    "top_logprobs too many": ("/chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": 21},
                              "top_logprobs", "0 to 20"),
    "logprobs too many": ("/completions", {"prompt": "Hi", "logprobs": 21}, "logprobs", "0 to 20"),
    "logprobs a bool in completions": ("/completions", {"prompt": "Hi", "logprobs": True}, "logprobs", "integer"),
    "too many prompts": ("/completions", {"prompt": ["Hi"] * 65}, "prompt", "at most 64"),
    "an empty prompt in a list": ("/completions", {"prompt": ["Hi", ""]}, "prompt", "prompt 1"),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_values_get_a_400_naming_the_field(served, case):
    engine, app = served
    path, body, param, words = BAD[case]
    status, answer = post(app, path, max_tokens=2, **body)
    assert status == 400 and answer["error"]["param"] == param and words in answer["error"]["message"], answer
    assert _idle(engine), engine.stats  # nothing was left queued


# --- the waiting queue, and a failing proposer ---------------------------------------------------

def test_a_burst_into_free_seats_is_not_refused(real):
    """max_waiting counts only the requests no free seat takes: a burst of max_num_seqs goes in whole."""
    config = EngineConfig(num_blocks=128, scheduler=SchedulerConfig(max_num_seqs=4))
    engine = AsyncEngine(Engine(*real, config), max_waiting=1)
    long = SamplingParams(temperature=0, max_tokens=300, ignore_eos=True)

    async def main():
        streams = await asyncio.gather(*(engine.add_request(f"Burst {i}:", long) for i in range(5)))  # 4 seats + 1
        with pytest.raises(EngineOverloaded, match="beyond the free seats"):
            await engine.add_request("One too many:", long)
        for stream in streams:
            stream.close()

    try:
        asyncio.run(main())
    finally:
        engine.shutdown()


def test_offline_n_is_n_seeded_requests_in_one_output(real):
    """``SamplingParams(n=3)`` through ``LLM.generate``: one output per prompt, completion j equal to a request of
    its own seeded seed + j; the engine itself refuses n > 1 with where to go instead; no block is left held."""
    llm = LLM.from_model(*real, max_num_seqs=8)
    sampled = SamplingParams(n=3, temperature=0.8, seed=7, max_tokens=6)
    outs = llm.generate([PROMPT, "Once upon a time"], [sampled, SamplingParams(max_tokens=4, temperature=0)])
    assert [len(o.outputs) for o in outs] == [3, 1] and [c.index for c in outs[0].outputs] == [0, 1, 2]
    alone = [llm.generate(PROMPT, SamplingParams(temperature=0.8, seed=7 + j, max_tokens=6))[0].outputs[0]
             for j in range(3)]
    assert [c.token_ids for c in outs[0].outputs] == [c.token_ids for c in alone]
    with pytest.raises(ValueError, match="one sample per request"):
        llm.engine.add_request(PROMPT, SamplingParams(n=2))
    with pytest.raises(ValueError, match="n \\(samples per prompt\\)"):
        SamplingParams(n=0)
    assert llm.engine.pool.stats().used == 0


# --- every field honoured or refused by name (issue 40, item 1) ---------------------------------------

REPEATS = "one two one two one two"  # greedy continues it with repeats, which a penalty must change


def greedy_text(app, path: str = "/completions", **body) -> tuple[str, dict]:
    body = ({"prompt": REPEATS} if path == "/completions" else {"messages": CHAT}) | {"temperature": 0} | body
    status, answer = post(app, path, **body)
    assert status == 200, answer
    choice = answer["choices"][0]
    return choice["text"] if path == "/completions" else choice["message"]["content"], answer


def test_min_p_of_one_samples_only_the_likeliest_token(served):
    """At temperature 1.5 a sample strays from greedy; min_p 1 keeps only the best token, so it is greedy again."""
    app = served[1]
    greedy = greedy_text(app, max_tokens=8, ignore_eos=True)[0]
    hot = dict(temperature=1.5, seed=5, max_tokens=8, ignore_eos=True)
    assert greedy_text(app, **hot)[0] != greedy
    assert greedy_text(app, **hot, min_p=1.0)[0] == greedy


def test_min_tokens_holds_eos_back(served):
    app = served[1]
    short = greedy_text(app, "/chat/completions", max_tokens=60)[1]
    assert short["choices"][0]["finish_reason"] == "stop" and short["usage"]["completion_tokens"] < 30, short
    forced = greedy_text(app, "/chat/completions", max_tokens=60, min_tokens=30)[1]
    assert forced["usage"]["completion_tokens"] >= 30, forced
    text = short["choices"][0]["message"]["content"]
    assert forced["choices"][0]["message"]["content"].startswith(text)  # the same until the EOS it held back


def test_stop_token_ids_also_wait_for_min_tokens(served, real):
    app, tokenizer = served[1], real[1]
    ids = tokenizer.encode(greedy_text(app, prompt=PROMPT, max_tokens=6, ignore_eos=True)[0])
    k = next(k for k in range(1, len(ids)) if ids[k] not in ids[:k])  # a token greedy emits first at position k
    stopped = greedy_text(app, prompt=PROMPT, max_tokens=6, ignore_eos=True, stop_token_ids=[ids[k]])[1]
    assert stopped["usage"]["completion_tokens"] == k + 1 and stopped["choices"][0]["finish_reason"] == "stop"
    held = greedy_text(app, prompt=PROMPT, max_tokens=6, ignore_eos=True, stop_token_ids=[ids[k]], min_tokens=k + 2)
    assert held[1]["usage"]["completion_tokens"] >= k + 2, held[1]


@pytest.mark.parametrize("penalty", [{"repetition_penalty": 100.0}, {"presence_penalty": 2.0},
                                     {"frequency_penalty": 2.0}])
def test_each_penalty_changes_greedy_output_and_its_default_does_not(served, penalty):
    app = served[1]
    plain = greedy_text(app, max_tokens=12, ignore_eos=True)[0]
    assert greedy_text(app, max_tokens=12, ignore_eos=True, **penalty)[0] != plain
    off = {name: 1.0 if name == "repetition_penalty" else 0.0 for name in penalty}
    assert greedy_text(app, max_tokens=12, ignore_eos=True, **off)[0] == plain


@pytest.mark.parametrize("path", ["/completions", "/chat/completions"])
def test_max_completion_tokens_caps_the_length_on_both_endpoints(served, path):
    app = served[1]
    answer = greedy_text(app, path, max_completion_tokens=3, ignore_eos=True)[1]
    assert answer["usage"]["completion_tokens"] == 3 and answer["choices"][0]["finish_reason"] == "length"
    assert greedy_text(app, path, max_completion_tokens=3, max_tokens=3, ignore_eos=True)[1]["usage"][
        "completion_tokens"] == 3
    status, error = post(app, path, **({"prompt": "Hi"} if path == "/completions" else {"messages": CHAT}),
                         max_completion_tokens=3, max_tokens=4)
    assert status == 400 and error["error"]["param"] == "max_completion_tokens", error


def test_skip_special_tokens_false_keeps_eos_in_the_text(served):
    app = served[1]
    kept = greedy_text(app, "/chat/completions", max_tokens=60, skip_special_tokens=False)[0]
    dropped = greedy_text(app, "/chat/completions", max_tokens=60, skip_special_tokens=True)[0]
    assert kept == dropped + "<|im_end|>"


def test_continuous_usage_stats_puts_the_usage_so_far_on_every_chunk(served):
    app = served[1]
    status, events = post(app, "/completions", prompt=PROMPT, max_tokens=3, temperature=0, ignore_eos=True,
                          stream=True, stream_options={"continuous_usage_stats": True})
    assert status == 200 and all("usage" in e for e in events), events
    counts = [e["usage"]["completion_tokens"] for e in events]
    assert counts == sorted(counts) and counts[-1] == 3 and {e["usage"]["prompt_tokens"] for e in events} == {5}
    plain = post(app, "/completions", prompt=PROMPT, max_tokens=3, temperature=0, stream=True)[1]
    assert all("usage" not in e for e in plain)


def test_openai_shapes_that_were_refused_are_taken(served):
    """Content as a list of text parts (as SDKs send it), ``stream: null``, ``n: 2.0`` and nulls for defaults."""
    app = served[1]
    text = greedy_text(app, "/chat/completions", max_tokens=5)[0]
    parts = [{"type": "text", "text": CHAT[0]["content"]}]
    assert greedy_text(app, "/chat/completions", messages=[{"role": "user", "content": parts}], max_tokens=5,
                       stream=None, top_p=None, seed=None, stop=None, n=None, user="someone")[0] == text
    two = greedy_text(app, "/chat/completions", max_tokens=5, n=2.0)[1]
    assert [c["message"]["content"] for c in two["choices"]] == [text, text]
    for half in ({"n": 2.5}, {"max_tokens": 5.5}):
        status, error = post(app, "/completions", prompt="Hi", **half)
        assert status == 400 and error["error"]["param"] == next(iter(half)), error


REFUSED_FIELDS = {  # field: (path, value); each a 400 whose param and message name it
    "guided_decoding_backend": ("/completions", "xgrammar"),  # guided_* and response_format: test_serve_structured
    "structural_tag": ("/chat/completions", {"type": "structural_tag"}), "use_beam_search": ("/completions", True),
    "length_penalty": ("/completions", 2.0), "truncate_prompt_tokens": ("/completions", 5),
    "modalities": ("/chat/completions", ["text", "audio"]), "audio": ("/chat/completions", {"voice": "alloy"}),
    "prediction": ("/chat/completions", {"type": "content", "content": "x"}),
    "reasoning_effort": ("/chat/completions", "low"), "top_logprobs": ("/completions", 2),
    "best_of": ("/completions", 2), "logit_bias": ("/chat/completions", {"42": 5}),
    "echo": ("/chat/completions", True),
    "a_field_nobody_defined": ("/completions", 1),
}


@pytest.mark.parametrize("name", REFUSED_FIELDS)
def test_each_unimplemented_field_is_refused_by_name(served, name):
    engine, app = served
    path, value = REFUSED_FIELDS[name]
    base = {"prompt": "Hi"} if path == "/completions" else {"messages": CHAT}
    status, answer = post(app, path, max_tokens=2, **base, **{name: value})
    assert status == 400 and answer["error"]["param"] == name and name in answer["error"]["message"], answer
    if name != "a_field_nobody_defined":  # its "not used" value (null) is taken
        assert post(app, path, max_tokens=2, **base, **{name: None})[0] == 200
    assert _idle(engine), engine.stats


TYPED = {  # case: (path, body, the param the 400 names)
    "include_usage not a bool": ("/completions", {"stream": True, "stream_options": {"include_usage": "no"}},
                                 "stream_options.include_usage"),
    "an unknown stream option": ("/completions", {"stream": True, "stream_options": {"everything": True}},
                                 "stream_options.everything"),
    "stream_options without stream": ("/completions", {"stream_options": {"include_usage": True}}, "stream_options"),
    "an image part": ("/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}, "messages.0.content.0.type"),
    "an audio part": ("/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}]}]}, "messages.0.content.0.type"),
    "a message's tool calls": ("/chat/completions", {"messages": [CHAT[0] | {"tool_calls": []}]},
                               "messages.0.tool_calls"),
    "a penalty out of range": ("/completions", {"presence_penalty": 3}, "presence_penalty"),
    "min_tokens past max_tokens": ("/completions", {"min_tokens": 5}, "min_tokens"),
}


@pytest.mark.parametrize("case", TYPED)
def test_bad_shapes_inside_fields_are_refused_by_name(served, case):
    path, body, param = TYPED[case]
    base = {"prompt": "Hi"} if path == "/completions" else {"messages": CHAT}
    status, answer = post(served[1], path, max_tokens=2, **(base | body))
    assert status == 400 and answer["error"]["param"] == param, answer


def test_a_number_too_long_to_read_is_a_400_and_post_health_a_405(served):
    app = served[1]
    body = b'{"model": "%s", "prompt": "Hi", "max_tokens": %s}' % (MODEL.encode(), b"9" * 5000)
    answer = call(app, "POST", "/v1/completions", body=body)
    assert answer.status_code == 400 and "number" in answer.json()["error"]["message"], answer.text
    assert call(app, "POST", "/health", body=b"x", headers={"Content-Type": "text/plain"}).status_code == 405
    assert call(app, "POST", "/v1/completions", body=b"x", headers={"Content-Type": "text/plain"}).status_code == 415


def test_greedy_output_with_default_params_is_unchanged_offline(real):
    """The penalty machinery stays out of a default request's way: its tokens are the reference's, byte for byte."""
    model, tokenizer = real
    ids = tokenizer.encode(REPEATS)
    out = LLM.from_model(*real, num_blocks=64).generate([ids], SamplingParams(temperature=0, max_tokens=10,
                                                                               ignore_eos=True))[0].outputs[0]
    assert out.token_ids == greedy_reference(model, ids, 10)[0]
    penalised = LLM.from_model(*real, num_blocks=64).generate(
        [ids], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, repetition_penalty=100.0))[0].outputs[0]
    assert penalised.token_ids != out.token_ids  # the offline LLM honours it too


PENALISED = [dict(repetition_penalty=1.3), dict(presence_penalty=1.5, frequency_penalty=0.5),
             dict(repetition_penalty=1.1, frequency_penalty=1.0, min_tokens=6)]


@pytest.mark.parametrize("knobs", PENALISED)
def test_part_one_generators_honour_the_penalties_as_the_engine_does(real, knobs):
    """Part I's generators and the engine share apply_history: a penalised greedy request gets the same tokens
    from generate_naive, generate_cached, generate_static (beside a plain row) and the engine; and they differ
    from the unpenalised ones, so the penalty did something."""
    from enginelib.baselines.generate import generate_cached, generate_naive, generate_static
    model, tokenizer = real
    ids, eos = tokenizer.encode(REPEATS), tokenizer.eos_token_id
    params = SamplingParams(temperature=0, max_tokens=10, **knobs)
    engine = LLM.from_model(*real, num_blocks=64).generate([ids], params)[0].outputs[0].token_ids
    assert generate_naive(model, ids, params, eos).token_ids == engine
    assert generate_cached(model, ids, params, eos).token_ids == engine
    other = tokenizer.encode("Red, green, blue, red, green,")
    static = generate_static(model, [ids, other], params, eos).generations
    assert static[0].token_ids[:len(engine)] == engine
    plain = generate_cached(model, ids, SamplingParams(temperature=0, max_tokens=10), eos).token_ids
    assert plain != engine


def test_openapi_describes_the_real_bodies_errors_key_and_metrics(served):
    keyed = call(build_app(served[0], MODEL, api_key="k"), "GET", "/openapi.json").json()
    assert keyed["components"]["securitySchemes"]["bearer"] == {"type": "http", "scheme": "bearer"}
    assert keyed["paths"]["/v1/completions"]["post"]["security"] == [{"bearer": []}]
    assert "401" in keyed["paths"]["/v1/models"]["get"]["responses"]
    schema = call(served[1], "GET", "/openapi.json").json()  # no --api-key: no key asked for (schemathesis' ST401)
    components = schema["components"]
    assert "securitySchemes" not in components and "security" not in schema["paths"]["/v1/models"]["get"]
    for path, body in (("/v1/completions", "CompletionBody"), ("/v1/chat/completions", "ChatBody")):
        post_op = schema["paths"][path]["post"]
        assert post_op["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith(body)
        assert {"400", "413", "415", "503"} <= set(post_op["responses"]) and "401" not in post_op["responses"]
        assert post_op["responses"]["400"]["content"]["application/json"]["schema"]["$ref"].endswith("ErrorBody")
    fields = components["schemas"]["CompletionBody"]["properties"]
    assert {"min_p", "min_tokens", "repetition_penalty", "max_completion_tokens", "stop_token_ids"} <= set(fields)
    assert components["schemas"]["CompletionBody"]["additionalProperties"] is False
    assert set(schema["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == {"text/plain"}
    assert "security" not in schema["paths"]["/health"]["get"]
