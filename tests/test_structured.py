"""Structured output (chapter 12) on the real model: every kind of spec gives output that parses and ends with "stop",
requests without one keep their greedy tokens beside them, preemption and speculation keep a grammar right, the
tokens a grammar forces can be appended unsampled (jump-forward), and a bad spec is refused before it runs."""
from __future__ import annotations

import json
import re

import pytest
import torch

from enginelib import LLM
from enginelib.baselines import generate_cached
from enginelib.config import EngineConfig, SamplingParams, SchedulerConfig, SpeculativeConfig
from enginelib.core.engine import Engine
from enginelib.model.structured import StructuredOutputManager
from enginelib.structured_output import StructuredOutput

from .conftest import chat_ids

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 20},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120}}}
DATE = r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])-[0-3][0-9]"
ANSWER = 'start: "The answer is " NUMBER "."\nNUMBER: /[0-9]{1,4}/'
CITIES = ("Paris", "London", "Berlin")


def person(text: str) -> bool:
    value = json.loads(text)
    return set(value) == {"name", "age"} and isinstance(value["name"], str) and isinstance(value["age"], int)


KINDS = {  # kind: (question, spec, the check its output must pass)
    "json": ("Describe a famous scientist as JSON with name and age.", StructuredOutput(json=PERSON), person),
    "json_object": ("What is 2 + 2? Answer as a JSON object.", StructuredOutput(json_object=True),
                    lambda t: isinstance(json.loads(t), dict)),
    "regex": ("On which date did Apollo 11 land on the moon?", StructuredOutput(regex=DATE),
              lambda t: re.fullmatch(DATE, t) is not None),
    "choice": ("What is the capital of France?", StructuredOutput(choice=list(CITIES)), lambda t: t in CITIES),
    "grammar": ("What is 12 times 7?", StructuredOutput(grammar=ANSWER),
                lambda t: re.fullmatch(r"The answer is [0-9]{1,4}\.", t) is not None),
}
PLAIN = ["List three colors.", "Write a haiku about the sea."]
GREEDY = SamplingParams(temperature=0, max_tokens=24)


def held(spec: StructuredOutput, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=kw.pop("max_tokens", 60), structured_output=spec, **kw)


def run(engine: Engine, prompts: list[list[int]], params: list[SamplingParams]) -> list:
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.pool.num_used == 0 and not engine.structured.grammars
    return [engine.request(i) for i in ids]


@pytest.fixture(scope="module")
def mixed(real):
    """The plain requests alone, and the same beside one request of every kind (one batch)."""
    model, tok = real
    plain = [chat_ids(tok, q) for q in PLAIN]
    alone = run(Engine(model, tok, EngineConfig(num_blocks=128)), plain, [GREEDY] * len(plain))
    kinds = [chat_ids(tok, question) for question, _, _ in KINDS.values()]
    engine = Engine(model, tok, EngineConfig(num_blocks=128))
    both = run(engine, plain + kinds, [GREEDY] * len(plain) + [held(spec) for _, spec, _ in KINDS.values()])
    return plain, alone, both[:len(plain)], both[len(plain):], engine


@pytest.mark.parametrize("kind", KINDS)
def test_every_kind_of_spec_gives_output_that_parses(real, mixed, kind):
    request = mixed[3][list(KINDS).index(kind)]
    text = real[1].decode(request.output_token_ids, skip_special_tokens=True)
    assert request.finish_reason == "stop", (request.finish_reason, text)
    assert KINDS[kind][2](text), text


def test_plain_requests_beside_grammars_keep_their_greedy_tokens(real, mixed, agree):
    plain, alone, beside, _, engine = mixed
    assert engine.structured.stats.masks > 0
    print(agree(real[0], plain, [r.output_token_ids for r in beside], [r.output_token_ids for r in alone]))


def test_logprobs_stay_the_models_own(real):
    """The mask edits a copy of the row: a constrained token's logprob and the top tokens are the raw model's."""
    model, tok = real
    prompt = chat_ids(tok, "What is the capital of France?")
    free, bound = run(Engine(model, tok, EngineConfig(num_blocks=64)), [prompt, prompt],
                      [SamplingParams(temperature=0, max_tokens=1, logprobs=3),
                       held(StructuredOutput(choice=["Berlin"]), max_tokens=4, logprobs=3)])
    assert tok.decode(bound.output_token_ids, skip_special_tokens=True) == "Berlin"
    first, constrained = free.output_logprobs[0], bound.output_logprobs[0]
    assert constrained.top == first.top  # the same prompt, the same raw logits
    assert constrained.token_id != first.token_id and constrained.rank > 1  # the model's own pick was not Berlin


def test_a_complete_grammar_ends_the_request_even_with_ignore_eos(real):
    model, tok = real
    spec = StructuredOutput(choice=list(CITIES))
    outs = LLM.from_model(model, tok, num_blocks=64).generate(
        [chat_ids(tok, "Name a city.")] * 3,
        [held(spec, ignore_eos=True)] + [SamplingParams(temperature=1.0, seed=s, max_tokens=20, structured_output=spec)
                                         for s in (1, 2)])
    for out in outs:
        assert out.outputs[0].finish_reason == "stop" and out.outputs[0].text in CITIES, out.outputs[0]
        assert tok.eos_token_id not in out.outputs[0].token_ids[:-1]


def test_preempted_requests_keep_their_grammar(real):
    """A pool too small for all of them: recomputed requests' matchers keep their state, outputs still parse."""
    model, tok = real
    names = ["Ada Lovelace", "Alan Turing", "Grace Hopper", "Marie Curie", "Emmy Noether"]
    prompts = [chat_ids(tok, f"Give {n} as JSON with name and age.") for n in names]
    params = [held(StructuredOutput(json=PERSON))] * len(prompts)
    roomy = run(Engine(model, tok, EngineConfig(num_blocks=128)), prompts, params)
    engine = Engine(model, tok, EngineConfig(num_blocks=14, block_size=8, scheduler=SchedulerConfig(8, 2048)))
    tight = run(engine, prompts, params)
    assert engine.stats().preemptions > 0, "the pool was meant to force preemption"
    for a, b in zip(tight, roomy):
        text = tok.decode(a.output_token_ids, skip_special_tokens=True)
        assert a.finish_reason == "stop" and person(text), text
        assert a.output_token_ids == b.output_token_ids


def test_speculation_leaves_grammar_requests_unguessed(real):
    """With n-gram speculation the plain request is guessed for and the grammar's is not; both stay right."""
    model, tok = real
    prompts = [chat_ids(tok, "Repeat after me: one two three one two three one two three"),
               chat_ids(tok, "Give Ada Lovelace as JSON with name and age.")]
    params = [SamplingParams(temperature=0, max_tokens=20), held(StructuredOutput(json=PERSON))]
    plain = run(Engine(model, tok, EngineConfig(num_blocks=64)), prompts, params)
    engine = Engine(model, tok, EngineConfig(num_blocks=64, speculative=SpeculativeConfig("ngram", 3)))
    spec = run(engine, prompts, params)
    assert engine.runner.spec_stats.proposed > 0
    assert [r.output_token_ids for r in spec] == [r.output_token_ids for r in plain]
    assert person(tok.decode(spec[1].output_token_ids, skip_special_tokens=True))


def test_jump_forward_appends_forced_tokens_in_fewer_steps(real):
    model, tok = real
    prompts = [chat_ids(tok, f"Give {n} as JSON with name and age.") for n in ("Alan Turing", "Grace Hopper")]
    params = [held(StructuredOutput(json=PERSON))] * 2
    engine = Engine(model, tok, EngineConfig(num_blocks=64, jump_forward=True))
    first = engine.add_request(prompts[0], params[0])
    forced = tok.decode(engine.structured.forced_tokens(first))
    assert forced.startswith('{"'), forced  # the schema's opening, before the model says anything
    engine.abort(first)
    jumped = run(engine, prompts, params)
    sampled_engine = Engine(model, tok, EngineConfig(num_blocks=64))
    sampled = run(sampled_engine, prompts, params)
    assert engine.structured.stats.forced_tokens > 0 and sampled_engine.structured.stats.forced_tokens == 0
    assert engine.steps < sampled_engine.steps
    for request in jumped + sampled:  # both held to the schema, with and without forced tokens
        assert request.finish_reason == "stop" and person(tok.decode(request.output_token_ids,
                                                                     skip_special_tokens=True))


ODD = ['say "hi"', "back\\slash", "été\n", "😀"]  # choices a grammar's string literals must escape


@pytest.mark.parametrize("spec, texts", [
    (StructuredOutput(choice=ODD), ODD),
    (StructuredOutput(regex=DATE), ["1969-07-20", "2024-12-31"]),
    (StructuredOutput(grammar=ANSWER), ["The answer is 84."]),
    (StructuredOutput(grammar='root ::= "yes" | "no"'), ["yes", "no"]),  # llama.cpp's GBNF, converted
    (StructuredOutput(json=PERSON), ['{"name": "Ada", "age": 36}'])])
def test_a_grammar_takes_exactly_its_texts(real, spec, texts):
    """Without the model: each text's tokens pass the mask one by one and complete the grammar; a text one
    character short does not."""
    model, tok = real
    engine = Engine(model, tok, EngineConfig(num_blocks=4))
    compiler = engine.structured.compiler
    for text in texts:
        matcher = compiler.matcher(spec)
        assert matcher.consume_tokens(tok.encode(text)) and matcher.is_stopped(), (text, matcher.get_error())
        short = compiler.matcher(spec)
        assert not (short.consume_tokens(tok.encode(text[:-1])) and short.is_accepting()), text


def test_the_torch_path_of_the_mask_allows_what_numpys_does(real):
    """A row NumPy cannot hold (bfloat16 here; on a GPU, any row) is masked with torch ops: the same tokens stay."""
    model, tok = real
    manager = StructuredOutputManager(tok, model.cfg.vocab_size)
    for request_id in ("numpy", "torch"):
        manager.add(request_id, StructuredOutput(json=PERSON))
    row = torch.randn(1, model.cfg.vocab_size)
    by_numpy = manager.mask(row.clone(), "numpy", [])
    by_torch = manager.mask(row.clone().bfloat16(), "torch", [])
    allowed = ~by_numpy.isneginf()
    assert torch.equal(allowed, ~by_torch.isneginf()) and 0 < int(allowed.sum()) < model.cfg.vocab_size
    assert torch.equal(by_numpy[allowed], row[allowed]) and manager.stats.masks == 2


BAD = {  # what: (spec, words in the error)
    "a regex with an open group": (StructuredOutput(regex="(ab"), "regex"),
    "a schema of an unknown type": (StructuredOutput(json={"type": "nonsense"}), "json"),
    "a grammar with an undefined rule": (StructuredOutput(grammar="start: missing"), "grammar"),
}


@pytest.mark.parametrize("what", BAD)
def test_a_spec_that_does_not_compile_is_refused_before_it_runs(real, what):
    spec, words = BAD[what]
    engine = Engine(*real, EngineConfig(num_blocks=16))
    with pytest.raises(ValueError, match=f"structured output: the {words} is not usable"):
        engine.add_request("Hi", held(spec))
    assert not engine.has_unfinished_requests() and not engine.structured.grammars
    assert engine.add_request("Hi", held(StructuredOutput(choice=["ok"]))) == "0"  # a refused one used up no id


@pytest.mark.parametrize("args, words", [({}, "exactly one"), ({"regex": "a", "choice": ["a"]}, "regex and choice"),
                                         ({"choice": "yes"}, "list of strings"), ({"choice": ["a", ""]}, "non-empty"),
                                         ({"json": "{not json"}, "not valid JSON"), ({"json": [1]}, "object"),
                                         ({"grammar": ""}, "non-empty"), ({"json_object": "yes"}, "True or False")])
def test_malformed_specs_are_refused_where_they_are_written(args, words):
    with pytest.raises(ValueError, match=words):
        StructuredOutput(**args)


def test_sampling_params_take_a_spec_only(real):
    with pytest.raises(ValueError, match="structured_output must be a StructuredOutput"):
        SamplingParams(structured_output={"json": {}})
    assert StructuredOutput(json='{"type": "object"}') == StructuredOutput(json={"type": "object"})
    with pytest.raises(ValueError, match="applied by the engine"):  # Part I's generators would ignore it
        generate_cached(real[0], [1, 2], held(StructuredOutput(choice=["a"])), real[1].eos_token_id)
