"""What goes wrong inside a step for one request fails that request alone (issue 26).

A failure is injected for one request of a batch (its sampled row turns NaN, the
sampler raises, its detokenizer raises, its verification raises): that request
ends with ``finish_reason="error"`` and the message, the others produce exactly
the tokens they produce without it, every block comes back, and the engine steps
on. Through :class:`AsyncEngine` the failed request raises :class:`RequestFailed`;
through the server it gets a 500 (a stream: an error event, then ``[DONE]``), and
the next request succeeds. A failure of the whole step (the forward pass) still
raises, as before.
"""
from __future__ import annotations

import asyncio
import json

import pytest
import torch

import enginelib.core.runner as runner_module
from enginelib.config import SamplingParams, SchedulerConfig, SpeculativeConfig
from enginelib.core.engine import Engine, EngineConfig
from enginelib.core.outputs import RequestOutput
from enginelib.serve.app import build_app
from enginelib.serve.async_engine import AsyncEngine
from enginelib.serve.engine_client import RequestFailed
from enginelib.speed import speculative

from .conftest import tiny_tokenizer
from .test_serve_door import KEY, _idle, call, is_openai_error

BAD_SEED = 666  # the request that fails is the one sampled with this seed
PROMPTS = [[3, 4, 5], [7, 8, 9, 10], [11, 12], [20, 21, 22, 23, 24]]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
SAMPLED = SamplingParams(temperature=0.9, top_k=20, seed=1, max_tokens=8, ignore_eos=True)
BAD = SamplingParams(temperature=0.8, seed=BAD_SEED, max_tokens=8, ignore_eos=True)
OTHERS = [(PROMPTS[0], GREEDY), (PROMPTS[1], SAMPLED), (PROMPTS[3], GREEDY)]


def _engine(model, **config) -> Engine:
    config = {"num_blocks": 64, "block_size": 4} | config
    return Engine(model, tiny_tokenizer(model.cfg.vocab_size), EngineConfig(**config))


def _run(engine: Engine, requests, bad: tuple | None = None, patch=None) -> tuple[dict, RequestOutput | None]:
    """Queue ``requests`` (and ``bad`` second, then ``patch(engine, its id)``), step until every one is done
    with no block or generator left; return the finished outputs of ``requests`` by id, and ``bad``'s."""
    ids = [engine.add_request(p, s) for p, s in requests[:1]]
    bad_id = engine.add_request(*bad) if bad else None
    if patch is not None:
        patch(engine, bad_id)
    ids += [engine.add_request(p, s) for p, s in requests[1:]]
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert engine.pool.num_used == 0 and not engine.runner._generators  # no block, no generator left
    return {rid: done[rid] for rid in ids}, (done[bad_id] if bad else None)


def _tokens(outputs: dict) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs.values()]


def _fail_on_call(monkeypatch, nth: int, nan: bool = False) -> None:
    """The runner's sampler fails the ``nth`` time it samples for the BAD_SEED request: its row turns NaN
    (``torch.multinomial`` refuses it) or it raises outright."""
    real, calls = runner_module.sample, []

    def sample(logits, params, generator=None):
        if params.seed == BAD_SEED:
            calls.append(1)
            if len(calls) == nth:
                if not nan:
                    raise RuntimeError("simulated sampler fault")
                logits = torch.full_like(logits, float("nan"))
        return real(logits, params, generator)
    monkeypatch.setattr(runner_module, "sample", sample)


@pytest.mark.parametrize("nan", [True, False])
def test_a_failing_row_fails_its_request_alone(tiny_dt, monkeypatch, nan):
    if nan and tiny_dt.device.type != "cpu":
        pytest.skip("NaN probabilities are a device-side assert on a GPU, not an exception")
    alone, _ = _run(_engine(tiny_dt), OTHERS)
    _fail_on_call(monkeypatch, nth=3, nan=nan)  # mid-decode: it holds blocks and two tokens
    engine = _engine(tiny_dt)
    outputs, bad = _run(engine, OTHERS, (PROMPTS[2], BAD))
    assert _tokens(outputs) == _tokens(alone)  # the others: exactly the tokens they have without it
    assert all(o.outputs[0].finish_reason == "length" and o.outputs[0].error is None for o in outputs.values())
    failed = bad.outputs[0]
    assert failed.finish_reason == "error" and len(failed.token_ids) == 2
    assert failed.error.startswith("RuntimeError: ") and ("nan" if nan else "simulated") in failed.error
    assert engine.request(bad.request_id).finish_reason == "error"
    again, _ = _run(engine, OTHERS)  # the engine steps on
    assert _tokens(again) == _tokens(alone)


def test_a_failing_detokenizer_fails_its_request_alone(tiny_dt):
    alone, _ = _run(_engine(tiny_dt), OTHERS)

    def patch(engine, bad_id):
        detok = engine.output.live[bad_id].detokenizer
        real = detok.step

        def step(ids):
            if len(ids) == 4:
                raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "simulated")
            return real(ids)
        detok.step = step
    engine = _engine(tiny_dt)
    outputs, bad = _run(engine, OTHERS, (PROMPTS[2], GREEDY), patch)
    assert _tokens(outputs) == _tokens(alone)
    failed = bad.outputs[0]
    assert failed.finish_reason == "error" and "UnicodeDecodeError" in failed.error and len(failed.token_ids) == 4
    assert engine.request(bad.request_id).finish_reason == "error" and engine.stats().finished == 4


def test_an_error_in_the_step_that_ends_a_request_still_says_error(tiny_dt):
    """The last token (max_tokens) finished it, then its text failed: the reason is "error", not "length"."""
    def patch(engine, bad_id):
        def flush(ids):
            raise ValueError("simulated flush fault")
        engine.output.live[bad_id].detokenizer.flush = flush
    engine = _engine(tiny_dt)
    _, bad = _run(engine, OTHERS, (PROMPTS[2], GREEDY), patch)
    assert bad.outputs[0].finish_reason == "error" and len(bad.outputs[0].token_ids) == GREEDY.max_tokens
    assert bad.outputs[0].error == "ValueError: simulated flush fault"
    assert engine.request(bad.request_id).finish_reason == "error"


class _Fixed:
    """Guesses the last token again, k times."""

    def propose(self, token_ids, k):
        return [token_ids[-1]] * k


class _Picky(_Fixed):
    """As _Fixed, but fails for PROMPTS[2]'s request."""

    def propose(self, token_ids, k):
        if token_ids[:len(PROMPTS[2])] == PROMPTS[2]:
            raise RuntimeError("simulated proposer fault")
        return super().propose(token_ids, k)


def _spec_engine(tiny_dt, proposer) -> Engine:
    engine = _engine(tiny_dt, speculative=SpeculativeConfig(method="ngram", num_speculative_tokens=2))
    engine.runner.proposer = proposer
    return engine


def test_a_failing_proposer_fails_its_request_alone(tiny_dt):
    """The proposer raises for one request: it ends with finish_reason "error", the others as without it."""
    alone, _ = _run(_spec_engine(tiny_dt, _Picky()), OTHERS)
    engine = _spec_engine(tiny_dt, _Picky())
    outputs, bad = _run(engine, OTHERS, (PROMPTS[2], GREEDY))
    assert _tokens(outputs) == _tokens(alone) and engine.runner.spec_stats.verifications > 0
    assert bad.outputs[0].finish_reason == "error" and "simulated proposer fault" in bad.outputs[0].error
    assert len(bad.outputs[0].token_ids) == 1  # its prefill's token; its first proposal failed


def test_a_failing_verification_fails_its_request_alone(tiny_dt, monkeypatch):
    """With guesses, a sampled request's rejection sampling raises: it fails, greedy and sampled
    verifications of the others go on as without it."""
    alone, _ = _run(_spec_engine(tiny_dt, _Fixed()), OTHERS)
    real = speculative.rejection_sample

    def rejection_sample(logits, drafts, params, generator=None, draft_probs=None):
        if params.seed == BAD_SEED:
            raise RuntimeError("simulated verification fault")
        return real(logits, drafts, params, generator, draft_probs)
    monkeypatch.setattr(speculative, "rejection_sample", rejection_sample)
    engine = _spec_engine(tiny_dt, _Fixed())
    outputs, bad = _run(engine, OTHERS, (PROMPTS[2], BAD))
    assert _tokens(outputs) == _tokens(alone) and engine.runner.spec_stats.verifications > 0
    assert bad.outputs[0].finish_reason == "error" and "simulated verification" in bad.outputs[0].error
    assert len(bad.outputs[0].token_ids) == 1  # its first token came from its prefill; its first verification failed


def test_a_failure_of_the_whole_step_still_raises(tiny_dt):
    engine = _engine(tiny_dt)
    engine.add_request(PROMPTS[0], GREEDY)

    def forward(*args, **kwargs):
        raise RuntimeError("simulated forward fault")
    engine.model.forward = forward  # the batch's forward pass: every request's, not one request's
    with pytest.raises(RuntimeError, match="simulated forward"):
        engine.step()


# --- through AsyncEngine and the server ----------------------------------------------------------

def _served(tiny_dt):
    return AsyncEngine(_engine(tiny_dt, scheduler=SchedulerConfig(max_num_seqs=8)), max_waiting=None)


def test_async_engine_raises_for_the_failed_request_and_serves_on(tiny_dt, monkeypatch):
    alone, _ = _run(_engine(tiny_dt), OTHERS)
    _fail_on_call(monkeypatch, nth=2)
    engine = _served(tiny_dt)

    async def tokens(prompt, params):
        return [t for d in [d async for d in engine.generate(prompt, params)] for t in d.token_ids]

    async def main():
        jobs = [tokens(p, s) for p, s in OTHERS] + [tokens(PROMPTS[2], BAD)]
        *others, bad = await asyncio.gather(*jobs, return_exceptions=True)
        assert others == _tokens(alone)
        assert isinstance(bad, RequestFailed) and "simulated sampler fault" in str(bad)
        assert bad.delta.finish_reason == "error" and bad.delta.num_output_tokens == 1
        return await tokens(*OTHERS[0])
    try:
        assert asyncio.run(main()) == _tokens(alone)[0]  # the next request succeeds
        assert engine.is_running and _idle(engine), engine.stats  # every block back
    finally:
        engine.shutdown()


def test_the_server_answers_500_and_a_stream_ends_with_an_error_then_done(tiny_dt, monkeypatch):
    _fail_on_call(monkeypatch, nth=2)
    engine = _served(tiny_dt)
    app = build_app(engine, "tiny", api_key=KEY, loopback_only=True)
    body = {"model": "tiny", "prompt": "t3 t4 t5", "max_tokens": 6, "temperature": 0.8, "seed": BAD_SEED,
            "ignore_eos": True}
    good = body | {"seed": 1}
    try:
        error = is_openai_error(call(app, "POST", "/v1/completions", body=json.dumps(body).encode()), 500)
        assert error["type"] == "server_error" and "simulated sampler fault" in error["message"]
        assert call(app, "POST", "/v1/completions", body=json.dumps(good).encode()).status_code == 200
        monkeypatch.undo()
        _fail_on_call(monkeypatch, nth=3)
        stream = call(app, "POST", "/v1/completions", body=json.dumps(body | {"stream": True}).encode())
        assert stream.status_code == 200
        events = [line.removeprefix("data: ") for line in stream.text.split("\n\n") if line]
        assert events[-1] == "[DONE]" and len(events) == 4  # two tokens' chunks, the error, [DONE]
        error = json.loads(events[-2])["error"]
        assert error["type"] == "server_error" and "simulated sampler fault" in error["message"]
        answer = call(app, "POST", "/v1/completions", body=json.dumps(good | {"stream": True}).encode())
        assert answer.text.endswith("data: [DONE]\n\n") and '"finish_reason":"length"' in answer.text
        assert call(app, "GET", "/health").status_code == 200
        assert b'enginelib_request_success_total{finished_reason="error"} 2.0' in call(app, "GET", "/metrics").content
        assert engine.is_running and _idle(engine), engine.stats
    finally:
        engine.shutdown()
