"""Prompt logprobs (issue 40): ``echo`` with ``logprobs`` on /v1/completions and vLLM's ``prompt_logprobs``, what
lm-eval-harness's ``local-completions`` needs for loglikelihood (multiple-choice) tasks.

The reference is a plain forward pass of the model over the same tokens (no cache, no engine), its log_softmax
gathered at each next token. The engine must agree whether the prompt was computed in chunks or not, whether its
blocks sat in the prefix cache or not, and requests that do not ask must run exactly as before.
"""
from __future__ import annotations

from operator import itemgetter

import pytest
import torch

from enginelib import LLM, SamplingParams
from enginelib.config import EngineConfig
from enginelib.core.engine import Engine
from enginelib.serve.app import build_app
from enginelib.serve.async_engine import AsyncEngine

from .test_openai_fields import post

MODEL = "smollm2-135m"
CONTEXT = "Question: What is the capital of France?\nAnswer:"
CHOICES = [" Paris", " London", " a small green frog"]
LONG = ("The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step. "
        "All that glitters is not gold, and the early bird catches the worm, but the second mouse gets the cheese.")


@pytest.fixture(scope="module")
def served(real):
    engine = AsyncEngine(Engine(*real, EngineConfig(num_blocks=256)), max_waiting=None)
    yield engine, build_app(engine, MODEL)
    engine.shutdown()


def tolerance(model) -> float:
    return 1e-4 if model.dtype == torch.float32 else 2e-2


def reference(model, ids: list[int]) -> torch.Tensor:
    """Row i: log-probabilities of token i + 1 given tokens 0..i, from one whole forward pass."""
    with torch.inference_mode():
        return torch.log_softmax(model(torch.tensor([ids], device=model.device))[0].float(), dim=-1).cpu()


def lm_eval_requests(tokenizer) -> tuple[list[list[int]], list[int]]:
    """lm-eval's tokens for each (context, continuation): the whole string encoded, the continuation being what
    follows the context's own tokens (its ``_encode_pair``); and each context's length."""
    context = tokenizer.encode(CONTEXT)
    whole = [tokenizer.encode(CONTEXT + choice) for choice in CHOICES]
    assert all(ids[:len(context)] == context for ids in whole)  # this context's tokens do not merge with a choice's
    return whole, [len(context)] * len(whole)


def lm_eval_parse(answer: dict, ctxlens: list[int]) -> list[tuple[float, bool]]:
    """lm-eval's ``LocalCompletionsAPI.parse_logprobs``: the continuation's summed logprob (the last entry is the
    generated token, dropped) and whether each of its tokens was the likeliest (its logprob the top dict's max)."""
    out = []
    for choice, ctxlen in zip(sorted(answer["choices"], key=itemgetter("index")), ctxlens):
        values = choice["logprobs"]["token_logprobs"][ctxlen:-1]
        tops = choice["logprobs"]["top_logprobs"][ctxlen:-1]
        out.append((sum(values), all(value == max(top.values()) for value, top in zip(values, tops))))
    return out


def expected(model, ids: list[int], ctxlen: int) -> tuple[float, bool]:
    """The continuation's log-likelihood and greediness computed here, without the engine."""
    rows = reference(model, ids)
    loglikelihood = sum(rows[i - 1, ids[i]].item() for i in range(ctxlen, len(ids)))
    return loglikelihood, all(int(rows[i - 1].argmax()) == ids[i] for i in range(ctxlen, len(ids)))


# --- what lm-eval sends ---------------------------------------------------------------------------

def test_lm_eval_loglikelihood_requests_match_the_models_own(served, real):
    """The exact body lm-eval's local-completions sends for loglikelihood (token-id prompts, a batch of them),
    parsed as it parses it: the sums agree with a plain forward pass to 1e-4, and so does is_greedy."""
    model, tokenizer = real
    prompts, ctxlens = lm_eval_requests(tokenizer)
    status, answer = post(served[1], "/completions", prompt=prompts, temperature=0, max_tokens=1, logprobs=1,
                          seed=1234, echo=True)
    assert status == 200, answer
    got = lm_eval_parse(answer, ctxlens)
    for (loglikelihood, greedy), ids, ctxlen in zip(got, prompts, ctxlens):
        want_ll, want_greedy = expected(model, ids, ctxlen)
        assert loglikelihood == pytest.approx(want_ll, abs=tolerance(model)) and greedy == want_greedy
    assert got[0][0] > got[2][0]  # " Paris" is likelier than a frog: the sums mean something
    for choice, ids in zip(answer["choices"], prompts):
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(ids) + 1 == len(lp["text_offset"])
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None  # the first token has none
        assert lp["tokens"][:len(ids)] == [tokenizer.token(t) for t in ids]
        assert choice["text"].startswith(tokenizer.decode(ids)) and len(choice["text"]) > len(tokenizer.decode(ids))
        assert lp["text_offset"] == [sum(map(len, lp["tokens"][:i])) for i in range(len(ids) + 1)]


def test_echo_with_max_tokens_0_returns_the_prompt_alone(served, real):
    """``max_tokens: 0`` with echo (lm-eval's other form, and vLLM's): the prompt's text and its logprobs only,
    the same numbers as with max_tokens 1; a text prompt (lm-eval's tokenized_requests=False) gives them too."""
    model, tokenizer = real
    ids = lm_eval_requests(tokenizer)[0][0]
    status, answer = post(served[1], "/completions", prompt=CONTEXT + CHOICES[0], temperature=0, max_tokens=0,
                          logprobs=2, echo=True)
    assert status == 200, answer
    choice = answer["choices"][0]
    assert choice["text"] == CONTEXT + CHOICES[0]
    values = choice["logprobs"]["token_logprobs"]
    rows = reference(model, ids)
    assert len(values) == len(ids) and values[0] is None
    assert values[1:] == pytest.approx([rows[i - 1, ids[i]].item() for i in range(1, len(ids))],
                                       abs=tolerance(model))
    assert all(len(top) in (2, 3) for top in choice["logprobs"]["top_logprobs"][1:])  # the top 2 and the token
    assert choice["prompt_logprobs"][0] is None and len(choice["prompt_logprobs"]) == len(ids)
    plain = post(served[1], "/completions", prompt=CONTEXT, max_tokens=0, echo=True)[1]["choices"][0]
    assert plain["text"] == CONTEXT and plain["logprobs"] is None  # echo without logprobs: the text alone


def test_echo_streams_the_prompt_first(served, real):
    """A stream with echo starts each choice with its prompt (and its logprobs), then the completion's chunks,
    the same text and logprobs as the whole answer."""
    app = served[1]
    body = {"prompt": CONTEXT, "temperature": 0, "max_tokens": 3, "logprobs": 1, "echo": True, "ignore_eos": True}
    whole = post(app, "/completions", **body)[1]["choices"][0]
    status, events = post(app, "/completions", stream=True, **body)
    assert status == 200, events
    chunks = [e["choices"][0] for e in events if e["choices"]]
    assert chunks[0]["text"] == CONTEXT and "".join(c["text"] for c in chunks) == whole["text"]
    streamed = [v for c in chunks if c["logprobs"] for v in c["logprobs"]["token_logprobs"]]
    assert streamed[0] is None and streamed[1:] == pytest.approx(whole["logprobs"]["token_logprobs"][1:], abs=1e-6)
    offsets = [v for c in chunks if c["logprobs"] for v in c["logprobs"]["text_offset"]]
    assert offsets == whole["logprobs"]["text_offset"]


def test_vllm_prompt_logprobs_field_on_both_endpoints(served, real):
    """``prompt_logprobs: k`` alone: vLLM's list (None, then {token id: {logprob, rank, decoded_token}}) beside
    an ordinary completion; on chat beside the choices, over the chat template's tokens."""
    model, tokenizer = real
    app = served[1]
    status, answer = post(app, "/completions", prompt=CONTEXT, max_tokens=2, temperature=0, prompt_logprobs=3,
                          ignore_eos=True)
    assert status == 200, answer
    choice = answer["choices"][0]
    ids = tokenizer.encode(CONTEXT)
    rows = reference(model, ids)
    assert choice["text"] and choice["logprobs"] is None and not choice["text"].startswith(CONTEXT)
    entries = choice["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(ids)
    for i, entry in enumerate(entries[1:], 1):
        own = entry[str(ids[i])]
        assert own["logprob"] == pytest.approx(rows[i - 1, ids[i]].item(), abs=tolerance(model))
        assert own["rank"] == int((rows[i - 1] > rows[i - 1, ids[i]]).sum()) + 1
        assert own["decoded_token"] == tokenizer.token(ids[i])
        top = rows[i - 1].topk(3).indices.tolist()
        assert set(entry) == {str(ids[i])} | {str(t) for t in top}
    status, chat = post(app, "/chat/completions", messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
                        prompt_logprobs=0)
    assert status == 200, chat
    template = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}]))
    assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) == len(template)


BAD = {  # case: (path, body, the param the 400 names)
    "max_tokens 0 without echo": ("/completions", {"prompt": "Hi", "max_tokens": 0}, "max_tokens"),
    "prompt_logprobs streamed": ("/completions", {"prompt": "Hi", "prompt_logprobs": 1, "stream": True},
                                 "prompt_logprobs"),
    "prompt_logprobs past 20": ("/completions", {"prompt": "Hi", "prompt_logprobs": 21}, "prompt_logprobs"),
    "prompt_logprobs negative": ("/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                                                       "prompt_logprobs": -1}, "prompt_logprobs"),
    "echo on chat": ("/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "echo": True}, "echo"),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_prompt_logprob_requests_are_400s(served, case):
    path, body, param = BAD[case]
    status, answer = post(served[1], path, **({"max_tokens": 2} | body))
    assert status == 400 and answer["error"]["param"] == param, answer


# --- the engine: chunks, the prefix cache, and everyone else --------------------------------------

def prompt_values(out) -> list[float]:
    return [entry.logprob for entry in out.prompt_logprobs[1:]]


def test_chunked_prefill_and_a_cached_prefix_give_the_same_prompt_logprobs(real):
    """A prompt computed in 16-token chunks after the same prompt filled the prefix cache: the request wanting
    prompt logprobs takes no cache hit (a cached token has no logits), a plain one does, and the values equal
    those of one unchunked prefill with no cache, and the forward pass's."""
    model, tokenizer = real
    ids = tokenizer.encode(LONG)
    assert len(ids) > 40
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1)
    whole = LLM.from_model(*real, num_blocks=64, enable_prefix_caching=False).generate([ids], params)[0]
    llm = LLM.from_model(*real, num_blocks=64, max_num_batched_tokens=16, max_num_seqs=4)
    warm = llm.generate([ids], SamplingParams(temperature=0, max_tokens=2))[0]
    chunked = llm.generate([ids], params)[0]
    again = llm.generate([ids], SamplingParams(temperature=0, max_tokens=2))[0]
    assert warm.prompt_logprobs is None and warm.metrics.num_cached_tokens == 0
    assert chunked.metrics.num_cached_tokens == 0 and again.metrics.num_cached_tokens > 0
    assert len(chunked.prompt_logprobs) == len(ids) and chunked.prompt_logprobs[0] is None
    assert prompt_values(chunked) == pytest.approx(prompt_values(whole), abs=1e-5)
    rows = reference(model, ids)
    assert prompt_values(chunked) == pytest.approx([rows[i - 1, ids[i]].item() for i in range(1, len(ids))],
                                                   abs=tolerance(model))
    assert [e.token_id for e in chunked.prompt_logprobs[1:]] == ids[1:]
    assert chunked.outputs[0].token_ids == warm.outputs[0].token_ids == whole.outputs[0].token_ids


class _RowSpy:
    """The model, counting the rows of logits each step asks for: what the engine computes, seen from outside."""

    def __init__(self, model) -> None:
        self.model, self.rows = model, []

    def __call__(self, *args, logits_indices=None, **kwargs):
        self.rows.append(len(logits_indices))
        return self.model(*args, logits_indices=logits_indices, **kwargs)

    def __getattr__(self, name):
        return getattr(self.model, name)


def test_others_are_unchanged_beside_a_request_with_prompt_logprobs(real):
    """Greedy requests batched with one asking for prompt logprobs get the tokens they get without it; and a
    batch where nobody asks computes one row of logits per sampling request, as before."""
    _, tokenizer = real
    prompts = [LONG, CONTEXT, "Once upon a time"]
    plain = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    runs = {}
    for name, middle in (("alone", plain), ("mixed", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                                                                      prompt_logprobs=2))):
        llm = LLM.from_model(*real, num_blocks=64, max_num_batched_tokens=32)
        spy = llm.engine.runner.model = _RowSpy(llm.engine.runner.model)
        runs[name] = llm.generate(prompts, [plain, middle, plain]), spy.rows
    (alone, alone_rows), (mixed, mixed_rows) = runs["alone"], runs["mixed"]
    assert max(alone_rows) <= len(prompts) < max(mixed_rows)  # one row per sampling request; the spy sees more
    assert [out.outputs[0].token_ids for out in mixed] == [out.outputs[0].token_ids for out in alone]
    assert mixed[0].prompt_logprobs is None and len(mixed[1].prompt_logprobs) == len(tokenizer.encode(CONTEXT))


def test_prompt_logprobs_survive_a_preemption(real):
    """A pool too small for both requests preempts one; its prompt logprobs are computed once each, in order,
    whatever was recomputed."""
    model, tokenizer = real
    ids = tokenizer.encode(LONG)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, prompt_logprobs=0)
    llm = LLM.from_model(*real, num_blocks=2 * (len(ids) + 40) // 16, block_size=16, max_num_batched_tokens=24,
                         max_num_seqs=2)
    outs = llm.generate([ids, ids], params)
    assert llm.engine.stats().preemptions > 0
    rows = reference(model, ids)
    for out in outs:
        assert prompt_values(out) == pytest.approx([rows[i - 1, ids[i]].item() for i in range(1, len(ids))],
                                                   abs=tolerance(model))


def test_prompt_logprobs_values_are_checked():
    for bad in (-1, 21, True, 1.5):
        with pytest.raises(ValueError, match="prompt_logprobs must be an integer from 0 to 20"):
            SamplingParams(prompt_logprobs=bad)
