"""Stop strings at their edges, as vLLM behaves, on the real model (greedy, so the text is known).

Each case takes a stop string from the free-running greedy answer, so where it
must cut is known in advance: completed by the very token that reaches
``max_tokens`` (finish_reason "stop", not "length"), inside the first token, two
stop strings where the one earlier in the text wins whatever their order, and
``include_stop_str_in_output``, and a stop string held back by ``min_tokens`` as EOS is. Through
``LLM.generate`` and ``Engine.stream`` (plain and speculative), the streamed text always equals the final text; the
server's cases are in ``tests/test_serve.py``.
"""
from __future__ import annotations

from dataclasses import replace

import pytest

from enginelib import LLM, SamplingParams
from enginelib.config import EngineConfig, SpeculativeConfig
from enginelib.core.engine import Engine

from .conftest import chat_ids

QUESTION = "List three colors."
N = 10  # max_tokens of the free-running answer


def free_answer(real) -> tuple[list[int], list[str]]:
    """The greedy answer's token ids and, for each prefix of them, its text."""
    model, tok = real
    out = LLM.from_model(model, tok).generate(chat_ids(tok, QUESTION), _params(N))[0].outputs[0]
    ids = out.token_ids
    return ids, [tok.decode(ids[:i], skip_special_tokens=True) for i in range(len(ids) + 1)]


def _params(max_tokens: int, stop: list[str] | None = None, include: bool = False) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, stop=stop or [],
                          include_stop_str_in_output=include)


def ending_in_token(texts: list[str], n: int) -> str:
    """A stop string that token ``n`` (1-based) completes: 2 characters before it and 1 of its own."""
    before, after = texts[n - 1], texts[n]
    stop = after[len(before) - 2:len(before) + 1]
    assert len(stop) == 3 and len(after) > len(before) and after.find(stop) == len(before) - 2, (before, after)
    return stop


CONFIGS = {"plain": {}, "speculative": {"speculative": SpeculativeConfig(num_speculative_tokens=3)}}


def run_both_ways(real, params: SamplingParams, config: dict) -> tuple[str, str, list[int]]:
    """The request through LLM.generate and through Engine.stream: the final text, reason and ids, after
    checking that the streamed deltas add up to the same text and that no block is left held."""
    model, tok = real
    prompt = chat_ids(tok, QUESTION)
    final = LLM.from_model(model, tok, **config).generate(prompt, params)[0]
    engine = Engine(model, tok, EngineConfig(**config))
    engine.add_request(prompt, params)
    deltas = list(engine.stream())
    assert "".join(d.text for d in deltas) == final.outputs[0].text
    assert deltas[-1].finished and deltas[-1].finish_reason == final.outputs[0].finish_reason
    assert sum(len(d.token_ids) for d in deltas) == len(final.outputs[0].token_ids)
    assert all(c == 0 for c in engine.pool.ref_counts), "a finished request still holds a block"
    out = final.outputs[0]
    return out.text, out.finish_reason, out.token_ids


@pytest.fixture(scope="module")
def answer(real):
    return free_answer(real)


@pytest.mark.parametrize("config", CONFIGS)
def test_a_stop_string_completed_by_the_last_allowed_token_stops(real, answer, config):
    ids, texts = answer
    stop = ending_in_token(texts, N)  # completed by token N, which also reaches max_tokens
    text, reason, got_ids = run_both_ways(real, _params(N, [stop]), CONFIGS[config])
    assert (text, reason) == (texts[N][:texts[N].index(stop)], "stop")  # vLLM: "stop", the stop string cut
    assert got_ids == ids[:N]


@pytest.mark.parametrize("config", CONFIGS)
def test_a_stop_string_inside_the_first_token(real, answer, config):
    ids, texts = answer
    first = texts[1]
    stop = first.strip()[-1:]  # the first token's last visible character: the text ends before it
    assert stop and first.index(stop) == len(first.rstrip()) - 1, first
    text, reason, got_ids = run_both_ways(real, _params(N, [stop]), CONFIGS[config])
    assert (text, reason, got_ids) == (first[:first.index(stop)], "stop", ids[:1])


@pytest.mark.parametrize("config", CONFIGS)
def test_of_two_stop_strings_the_earlier_in_the_text_wins(real, answer, config):
    ids, texts = answer
    early, late = ending_in_token(texts, 4), ending_in_token(texts, 7)
    assert texts[N].index(early) < texts[N].index(late)
    for stops in ([early, late], [late, early]):
        text, reason, got_ids = run_both_ways(real, _params(N, stops), CONFIGS[config])
        assert (text, reason, got_ids) == (texts[4][:texts[4].index(early)], "stop", ids[:4]), stops


@pytest.mark.parametrize("config", CONFIGS)
def test_include_stop_str_in_output_keeps_it(real, answer, config):
    ids, texts = answer
    for n in (4, N):  # in the middle, and completed by the last allowed token
        stop = ending_in_token(texts, n)
        text, reason, got_ids = run_both_ways(real, _params(N, [stop], include=True), CONFIGS[config])
        end = texts[n].index(stop) + len(stop)
        assert (text, reason, got_ids) == (texts[n][:end], "stop", ids[:n])


@pytest.mark.parametrize("config", CONFIGS)
def test_min_tokens_holds_a_stop_string_back(real, answer, config):
    """vLLM's rule: only a token past ``min_tokens`` may complete a stop string. With min_tokens 3 the stop
    completed by token 4 ends the text as without it; with min_tokens 4 it is passed over, and the request runs
    on to the string's next occurrence (completed by a later token) or to max_tokens."""
    ids, texts = answer
    stop = ending_in_token(texts, 4)
    first = texts[N].index(stop)
    text, reason, got_ids = run_both_ways(real, replace(_params(N, [stop]), min_tokens=3), CONFIGS[config])
    assert (text, reason, got_ids) == (texts[4][:first], "stop", ids[:4])
    again = texts[N].find(stop, first + 1)
    if again < 0:
        want = (texts[N], "length", ids)
    else:
        k = next(k for k in range(5, N + 1) if len(texts[k]) >= again + len(stop))
        want = (texts[k][:again], "stop", ids[:k])
    assert run_both_ways(real, replace(_params(N, [stop]), min_tokens=4), CONFIGS[config]) == want
    assert len(want[2]) > 4  # the stop string did not end it at token 4


def test_without_a_stop_string_the_last_token_ends_by_length(real, answer):
    ids, texts = answer
    text, reason, got_ids = run_both_ways(real, _params(N, ["no such string in the answer"]), {})
    assert (text, reason, got_ids) == (texts[N], "length", ids)
