"""The ``structured`` section: what a grammar's token mask costs per decode step, against the step (chapter 12).

A few greedy chat requests asking for a person as JSON run on one engine config three times: held to a JSON
Schema; free, each for as many tokens as its constrained twin took (so both runs decode the same batch shapes);
and held to the schema with jump-forward decoding. Each step is timed around ``engine.step()``; the engine's
:class:`~enginelib.model.structured.StructuredStats` count the host time of the masks (llguidance computing
each, and applying it to its row). The first step (every prompt's prefill) is left out of the step times. Two runs'
step times on a shared CPU differ by more than the masks cost: ``mask_fraction`` (of the constrained steps' own
time) is the figure that holds from run to run.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field, replace

import llguidance

from enginelib.bench.workloads import chat_prompt
from enginelib.config import EngineConfig, SamplingParams
from enginelib.core.engine import Engine
from enginelib.model.grammar import compiler_for, grammar_text
from enginelib.model.tokenizer import Tokenizer
from enginelib.model.transformer import Transformer
from enginelib.structured_output import StructuredOutput

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "born", "field"],
          "properties": {"name": {"type": "string", "maxLength": 30},
                         "born": {"type": "integer", "minimum": 0, "maximum": 2100},
                         "field": {"type": "string", "maxLength": 30}}}
PEOPLE = ("Ada Lovelace", "Alan Turing", "Grace Hopper", "Marie Curie", "Emmy Noether", "Claude Shannon",
          "Rosalind Franklin", "John von Neumann")
MAX_TOKENS = 64


@dataclass
class _Run:
    """One run's decode steps: each one's seconds, and the masks' seconds within it."""
    outputs: list[list[int]] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    step_seconds: list[float] = field(default_factory=list)
    mask_seconds: float = 0.0
    masks: int = 0
    forced_tokens: int = 0
    steps: int = 0  # every step, the prefill's too


def valid(text: str) -> bool:
    """The text is one JSON object with exactly :data:`SCHEMA`'s keys, of its types."""
    try:
        value = json.loads(text)
    except ValueError:
        return False
    return (isinstance(value, dict) and set(value) == set(SCHEMA["required"]) and isinstance(value["name"], str)
            and isinstance(value["born"], int) and isinstance(value["field"], str))


def _run(model: Transformer, tok: Tokenizer, prompts: list[list[int]], params: list[SamplingParams],
         config: EngineConfig) -> _Run:
    engine = Engine(model, tok, config)
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    run = _Run()
    while engine.has_unfinished_requests():
        before, masks = engine.structured.stats.mask_seconds, engine.structured.stats.masks
        start = time.perf_counter()
        engine.step()
        elapsed = time.perf_counter() - start
        run.steps += 1
        if run.steps > 1:  # the first step prefills every prompt: not a decode step
            run.step_seconds.append(elapsed)
            run.mask_seconds += engine.structured.stats.mask_seconds - before
            run.masks += engine.structured.stats.masks - masks
    run.forced_tokens = engine.structured.stats.forced_tokens
    for i in ids:
        request = engine.request(i)
        run.outputs.append(list(request.output_token_ids))
        run.texts.append(tok.decode(request.output_token_ids, skip_special_tokens=True))
    return run


def structured_effect(model: Transformer, tok: Tokenizer, config: EngineConfig, quick: bool) -> dict:
    """The mask's cost per decode step against the step, and what jump-forward saves (see the module's doc)."""
    prompts = [chat_prompt(tok, f"Give {who} as JSON with the keys name, born (the year) and field.")
               for who in PEOPLE[:4 if quick else 8]]
    spec = StructuredOutput(json=SCHEMA)
    compiler = compiler_for(tok, model.cfg.vocab_size)  # the vocabulary for llguidance: once per tokenizer
    start = time.perf_counter()  # the grammar alone, and its first mask
    llguidance.LLMatcher(compiler.tokenizer, grammar_text(spec), log_level=0).compute_bitmask()
    compile_ms = 1000 * (time.perf_counter() - start)
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, structured_output=spec)
    held = _run(model, tok, prompts, [greedy] * len(prompts), config)
    free = _run(model, tok, prompts, [SamplingParams(temperature=0, max_tokens=len(out), ignore_eos=True)
                                      for out in held.outputs], config)
    jump = _run(model, tok, prompts, [greedy] * len(prompts), replace(config, jump_forward=True))
    step, step_free = _mean(held.step_seconds), _mean(free.step_seconds)
    return {"requests": len(prompts), "compile_ms": compile_ms,
            "mask_ms": 1000 * held.mask_seconds / held.masks if held.masks else None,
            "mask_ms_per_step": 1000 * held.mask_seconds / len(held.step_seconds),
            "step_ms": 1000 * step, "step_ms_plain": 1000 * step_free,
            "mask_fraction": held.mask_seconds / sum(held.step_seconds),
            "valid": sum(map(valid, held.texts)) / len(prompts),
            "jump_forward": {"steps": jump.steps, "steps_plain": held.steps, "forced_tokens": jump.forced_tokens,
                             "tokens": sum(map(len, jump.outputs)), "tokens_plain": sum(map(len, held.outputs)),
                             "valid": sum(map(valid, jump.texts)) / len(prompts)},
            "example": held.texts[0]}


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)
