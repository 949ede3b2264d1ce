"""The engine on the real model: whatever batching, paging or preemption did, every request's
greedy output equals the single-request reference from Part I, token for token in float32
(in float16, identical or diverging only at a near-tie: ``agree`` is check_greedy)."""
from __future__ import annotations

import pytest

from enginelib.baselines import generate_cached
from enginelib.core.engine import Engine, EngineConfig
from enginelib.core.llm import LLM
from enginelib.model.sampling import SamplingParams

from .conftest import chat_ids

QUESTIONS = [
    "What is the capital of France?", "hi", "Write a haiku about the sea.", "List three colors.",
    "Explain gravity to a child in two sentences.", "Tell me a story about a dragon.",
    "What is 12 times 7? Answer with the number only.",
    "Summarize the plot of Romeo and Juliet in a paragraph, mentioning the families, the secret "
    "marriage, the banishment and the tragic ending.",
]
GREEDY = SamplingParams(temperature=0, max_tokens=40)


@pytest.fixture(scope="module")
def reference(real):
    model, tok = real
    return [generate_cached(model, chat_ids(tok, q), GREEDY, tok.eos_token_id).token_ids for q in QUESTIONS]


@pytest.fixture(scope="module")
def prompts(real):
    return [chat_ids(real[1], q) for q in QUESTIONS]


def test_llm_generate_equals_the_single_request_reference(real, reference, prompts, agree):
    model, tok = real
    outs = LLM.from_model(model, tok).generate([chat_ids(tok, q) for q in QUESTIONS], GREEDY)
    print(agree(model, prompts, [o.outputs[0].token_ids for o in outs], reference))
    assert [o.request_id for o in outs] == sorted((o.request_id for o in outs), key=int)  # input order
    assert all(o.finished and o.outputs[0].finish_reason in ("stop", "length") for o in outs)
    assert "Paris" in outs[0].outputs[0].text and "<|im_end|>" not in outs[0].outputs[0].text


def test_requests_arriving_mid_decode_get_the_reference_output(real, reference, prompts, agree):
    model, tok = real
    engine = Engine(model, tok, EngineConfig(record=True))
    ids = {engine.add_request(chat_ids(tok, q), GREEDY): i for i, q in enumerate(QUESTIONS[:3])}
    done, step = {}, 0
    while engine.has_unfinished_requests() or step < 6:
        if step == 5:  # the rest join while the first three are decoding
            ids |= {engine.add_request(chat_ids(tok, q), GREEDY): i for i, q in enumerate(QUESTIONS[3:], 3)}
        for out in engine.step():
            if out.finished:
                done[ids[out.request_id]] = out.outputs[0].token_ids
        step += 1
    agree(model, prompts, [done[i] for i in range(len(QUESTIONS))], reference)
    mixed = [r for r in engine.history if r.prefill and len(r.scheduled) > len(r.prefill)]
    assert mixed, "a step should have mixed prefills with decodes"
    assert engine.pool.num_used == 0


def test_a_pool_too_small_for_everyone_preempts_and_still_matches(real, reference, prompts, agree):
    model, tok = real
    llm = LLM.from_model(model, tok, num_blocks=14, block_size=8, max_num_seqs=8)
    outs = llm.generate([chat_ids(tok, q) for q in QUESTIONS], GREEDY)
    agree(model, prompts, [o.outputs[0].token_ids for o in outs], reference)
    stats = llm.engine.stats()
    assert stats.preemptions > 0, "the pool was meant to force preemption"
    assert sum(o.metrics.num_preemptions for o in outs) == stats.preemptions
    assert stats.pool.used == 0 and stats.pool.high_water == 14


def test_stop_strings_cut_the_text_and_end_the_request(real):
    model, tok = real
    llm = LLM.from_model(model, tok)
    full, = llm.generate(chat_ids(tok, "List three colors."), GREEDY)
    text = full.outputs[0].text
    stop = text[5:8]
    cut, = llm.generate(chat_ids(tok, "List three colors."), SamplingParams(temperature=0, max_tokens=40, stop=[stop]))
    assert cut.outputs[0].finish_reason == "stop"
    assert cut.outputs[0].text == text[:text.index(stop)]


def test_streaming_deltas_add_up_to_the_final_text(real):
    model, tok = real
    engine = Engine(model, tok)
    a = engine.add_request(chat_ids(tok, "Write a haiku about the sea."), GREEDY)
    b = engine.add_request(chat_ids(tok, "hi"), GREEDY)
    pieces, finals = {a: "", b: ""}, {}
    for delta in engine.stream():
        pieces[delta.request_id] += delta.text
        if delta.finished:
            finals[delta.request_id] = delta.finish_reason
    assert set(finals) == {a, b}
    for rid in (a, b):
        req = engine.request(rid)
        assert pieces[rid] == tok.decode(req.output_token_ids, skip_special_tokens=True)


def test_abort_mid_flight_frees_blocks_and_spares_the_others(real, reference, prompts, agree):
    model, tok = real
    engine = Engine(model, tok)
    keep = engine.add_request(chat_ids(tok, QUESTIONS[2]), GREEDY)
    drop = engine.add_request(chat_ids(tok, QUESTIONS[5]), GREEDY)
    sent = ""  # what the aborted request's deltas carried
    for _ in range(3):
        sent += "".join(d.text for d in engine.step_deltas() if d.request_id == drop)
    out = engine.abort(drop)
    assert out.finished and out.outputs[0].finish_reason == "abort"
    assert len(out.outputs[0].token_ids) == 3
    last, = [d for d in engine.step_deltas() if d.request_id == drop]  # the next step tells streams too
    assert last.finished and last.finish_reason == "abort" and sent + last.text == out.outputs[0].text
    while engine.has_unfinished_requests():
        engine.step()
    agree(model, prompts[2:3], [engine.request(keep).output_token_ids], reference[2:3])
    assert engine.pool.num_used == 0
    with pytest.raises(ValueError, match="no unfinished request"):
        engine.abort(drop)
    with pytest.raises(ValueError, match="no unfinished request"):
        engine.abort("never-existed")


def test_bad_requests_are_refused_and_the_engine_keeps_serving(real, reference, prompts, agree):
    model, tok = real
    engine = Engine(model, tok, EngineConfig(num_blocks=20, block_size=16))
    good = engine.add_request(chat_ids(tok, QUESTIONS[0]), GREEDY)
    with pytest.raises(ValueError, match="context"):
        engine.add_request([5] * model.cfg.context_length, GREEDY)
    with pytest.raises(ValueError, match="whole pool has 20"):
        engine.add_request([5] * 400, GREEDY)
    with pytest.raises(ValueError, match="empty"):
        engine.add_request([], GREEDY)
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request([5, 6], GREEDY, request_id=good)
    for bad in (dict(max_tokens=0), dict(temperature=-1), dict(top_p=0), dict(top_k=-5)):
        with pytest.raises(ValueError):
            engine.add_request([5, 6], SamplingParams(**bad))
    while engine.has_unfinished_requests():
        engine.step()
    agree(model, prompts[:1], [engine.request(good).output_token_ids], reference[:1])
    assert engine.pool.num_used == 0


def test_a_kv_budget_too_small_for_one_block_is_refused(real):
    model, tok = real
    with pytest.raises(ValueError, match="holds no block"):
        Engine(model, tok, EngineConfig(kv_cache_memory=1000))


def test_generate_is_all_or_nothing_on_a_bad_prompt(real):
    model, tok = real
    llm = LLM.from_model(model, tok)
    with pytest.raises(ValueError, match="context"):
        llm.generate([chat_ids(tok, "hi"), [5] * model.cfg.context_length], GREEDY)
    assert not llm.engine.has_unfinished_requests() and llm.engine.pool.num_used == 0
    with pytest.raises(ValueError, match="2 SamplingParams for 1 prompts"):
        llm.generate(["hi"], [GREEDY, GREEDY])


def test_seeded_sampling_in_the_engine_is_reproducible(real):
    model, tok = real
    llm = LLM.from_model(model, tok)
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=12, seed=3, ignore_eos=True)
    first = llm.generate(["Once upon a time", "The sea"], params)
    again = llm.generate(["Once upon a time"], params)
    assert first[0].outputs[0].token_ids == again[0].outputs[0].token_ids
    assert len(first[1].outputs[0].token_ids) == 12


def test_free_gpu_memory_counts_what_pytorch_caches_but_no_tensor_holds(monkeypatch):
    """A KV pool sized from mem_get_info alone would shrink with every Engine made in one process."""
    import torch

    from enginelib.model.device import free_gpu_memory

    gib = 2**30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (3 * gib, 15 * gib))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 5 * gib)  # cached by PyTorch...
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 1 * gib)  # ...of which 4 GiB unused
    assert free_gpu_memory("cuda") == 7 * gib


def _stop_across_a_token_edge(tok, token_ids: list[int]) -> str:
    """A 5-character stop string from the middle of a greedy answer, starting 2 characters before a
    token edge: the token that brings its first 2 characters must not stream them."""
    text = tok.decode(token_ids, skip_special_tokens=True)
    edges = [len(tok.decode(token_ids[:i], skip_special_tokens=True)) for i in range(1, len(token_ids))]
    for edge in sorted(edges, key=lambda e: abs(e - len(text) // 2)):
        stop = text[edge - 2:edge + 3]
        if len(stop) == 5 and text.find(stop) == edge - 2 and text[edge - 2:edge].strip():
            return stop
    raise AssertionError(f"no usable stop string in {text!r}")


def _stream_with_stop(engine: Engine, tok, questions: list[str]) -> dict[str, str]:
    """Stream the questions, each with a stop string cut from its own greedy answer; check every delta."""
    params = {}
    llm = LLM.from_model(engine.model, tok)
    answers = llm.generate([chat_ids(tok, q) for q in questions], GREEDY)
    for q, answer in zip(questions, answers):
        stop = _stop_across_a_token_edge(tok, answer.outputs[0].token_ids)
        params[engine.add_request(chat_ids(tok, q), SamplingParams(temperature=0, max_tokens=40, stop=[stop]))] = q
    finals = {rid: out.outputs[0].text for rid, out in  # the same requests, not streamed: the final texts
              zip(params, llm.generate([chat_ids(tok, q) for q in params.values()],
                                       [engine.request(rid).params for rid in params]))}
    pieces, reasons = {rid: "" for rid in params}, {}
    history = {rid: [] for rid in params}
    for delta in engine.stream():
        pieces[delta.request_id] += delta.text
        history[delta.request_id].append(pieces[delta.request_id])
        if delta.finished:
            reasons[delta.request_id] = delta.finish_reason
    for rid in params:
        final = finals[rid]
        assert pieces[rid] == final
        assert all(final.startswith(sent) for sent in history[rid]), "a delta ran past the final text"
    assert engine.pool.num_used == 0
    return reasons


def test_stream_never_sends_text_a_stop_string_later_cuts_off(real):
    model, tok = real
    reasons = _stream_with_stop(Engine(model, tok), tok, ["List the planets of the solar system."])
    assert list(reasons.values()) == ["stop"]


def test_stream_with_stop_strings_for_several_requests_at_once(real):
    model, tok = real
    reasons = _stream_with_stop(Engine(model, tok), tok, QUESTIONS[2:6])
    assert "stop" in reasons.values()
