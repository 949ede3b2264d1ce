"""Bad input is refused with a ValueError that says what was wrong and what to pass instead, and the
engine keeps serving: after every refusal a good request still runs and no block stays in use."""
from __future__ import annotations

import math

import pytest

from enginelib.core.engine import Engine, EngineConfig
from enginelib.core.llm import LLM
from enginelib.model.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=4)

BAD_PARAMS = [
    (dict(temperature=math.nan), "temperature must be a finite number"),
    (dict(temperature=math.inf), "temperature must be a finite number"),
    (dict(top_p=math.nan), "top_p must be a finite number"),
    (dict(top_p=-math.inf), "top_p must be a finite number"),
    (dict(temperature="0.7"), "temperature must be a number"),
    (dict(top_p="high"), "top_p must be a number"),
    (dict(temperature=True), "temperature must be a number"),
    (dict(max_tokens=8.0), "max_tokens"),
    (dict(max_tokens=True), "max_tokens"),
    (dict(top_k=False), "top_k"),
    (dict(stop=[""]), "stop strings must not be empty"),
    (dict(stop=""), "stop strings must not be empty"),
    (dict(stop=["ok", 3]), "stop must be a string or a list of strings"),
    (dict(stop_token_ids=[2.0]), "stop_token_ids"),
    (dict(seed="7"), "seed"),
    (dict(seed=2**64), "seed must fit in 64 bits"),
    (dict(seed=-2**63 - 1), "seed must fit in 64 bits"),
    (dict(ignore_eos="yes"), "ignore_eos"),
]
BAD_PROMPTS = [None, ["hello", "world"], {"prompt": "hi"}, 42, [1, 2.5], [True, 3], b"hi", [[1, 2]]]


@pytest.mark.parametrize("bad, message", BAD_PARAMS)
def test_bad_sampling_params_are_refused_with_a_clear_message(bad, message):
    with pytest.raises(ValueError, match=message) as err:
        SamplingParams(**bad)
    assert "pass" in str(err.value) or "got" in str(err.value)


@pytest.fixture(scope="module")
def engine(real):
    model, tok = real
    return Engine(model, tok, EngineConfig(num_blocks=16, block_size=16))


def _still_serves(engine: Engine) -> None:
    rid = engine.add_request("The sea is", GREEDY)
    while engine.has_unfinished_requests():
        engine.step()
    req = engine.request(rid)
    assert req.is_finished and len(req.output_token_ids) >= 1
    assert engine.pool.num_used == 0


@pytest.mark.parametrize("prompt", BAD_PROMPTS, ids=repr)
def test_a_prompt_that_is_not_text_or_token_ids_is_refused(engine, prompt):
    with pytest.raises(ValueError, match="a prompt must be text"):
        engine.add_request(prompt, GREEDY)
    _still_serves(engine)


def test_params_that_are_not_sampling_params_are_refused(engine):
    with pytest.raises(ValueError, match="params must be a SamplingParams"):
        engine.add_request("hi", {"temperature": 0})
    _still_serves(engine)


def test_token_ids_of_other_int_types_are_accepted(engine):
    import numpy as np
    import torch
    ids = engine.tokenizer.encode("The sea is")
    for prompt in (tuple(ids), np.array(ids), torch.tensor(ids)):
        rid = engine.add_request(prompt, GREEDY)
        assert engine.request(rid).prompt_token_ids == ids
        assert all(type(t) is int for t in engine.request(rid).prompt_token_ids)
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.pool.num_used == 0


@pytest.fixture(scope="module")
def llm(real):
    return LLM.from_model(*real, num_blocks=16, block_size=16)


@pytest.mark.parametrize("prompts", [None, {"prompt": "hi"}, 42, [None], ["ok", {"p": 1}], [["a", "b"]]], ids=repr)
def test_generate_refuses_bad_prompts_and_keeps_serving(llm, prompts):
    with pytest.raises(ValueError, match="prompt"):
        llm.generate(prompts, GREEDY)
    assert not llm.engine.has_unfinished_requests() and llm.engine.pool.num_used == 0
    out, = llm.generate("The sea is", GREEDY)
    assert out.finished and llm.engine.pool.num_used == 0


@pytest.mark.parametrize("messages, message", [
    ([], "non-empty list of messages"),
    (None, "non-empty list of messages"),
    ([[]], "non-empty list of messages"),
    ([{"content": "hi"}], "needs a string 'role'"),
    ([{"role": "user"}], "needs a string 'content'"),
    ([{"role": "user", "content": None}], "needs a string 'content'"),
    ([{"role": "user", "content": "hi"}, "hello"], "message 1 must be a dict"),
], ids=repr)
def test_a_malformed_chat_is_refused_and_the_engine_keeps_serving(llm, messages, message):
    with pytest.raises(ValueError, match=message):
        llm.chat(messages, GREEDY)
    if messages:
        with pytest.raises(ValueError, match=message):
            llm.tokenizer.apply_chat_template(messages[0] if messages == [[]] else messages)
    assert not llm.engine.has_unfinished_requests() and llm.engine.pool.num_used == 0
    out, = llm.chat([{"role": "user", "content": "hi"}], GREEDY)
    assert out.finished and llm.engine.pool.num_used == 0


@pytest.mark.parametrize("bad, message", BAD_PARAMS[:6] + BAD_PARAMS[10:11] + BAD_PARAMS[-3:])
def test_the_engine_serves_on_after_bad_sampling_params(engine, bad, message):
    with pytest.raises(ValueError, match=message):
        engine.add_request("hi", SamplingParams(**bad))
    _still_serves(engine)


@pytest.mark.parametrize("temperature, seen", [(1e-38, 0.0), (1e-6, 0.0), (1e-5, 0.01), (5e-3, 0.01), (0.5, 0.5)])
def test_tiny_temperatures_are_greedy_or_raised_as_vllm_does(engine, temperature, seen):
    """Below 1e-5 a temperature is greedy; below 1e-2 it is raised to 1e-2: dividing logits by 1e-38 would
    overflow to inf and make the probabilities NaN, which stopped the engine's step."""
    params = SamplingParams(temperature=temperature, max_tokens=4, seed=1)
    assert params.temperature == seen
    rid = engine.add_request("The sea is", params)
    while engine.has_unfinished_requests():
        engine.step()
    assert len(engine.request(rid).output_token_ids) == 4
    _still_serves(engine)


@pytest.mark.parametrize("seed", [0, 2**64 - 1, -2**63])
def test_every_64_bit_seed_runs(engine, seed):
    rid = engine.add_request("The sea is", SamplingParams(temperature=0.8, max_tokens=3, seed=seed))
    while engine.has_unfinished_requests():
        engine.step()
    assert len(engine.request(rid).output_token_ids) == 3
