"""Part I's ways to generate text, each the reference for the next.

- :func:`generate_naive` (chapter 2) recomputes the whole sequence for every token;
- :func:`generate_cached` (chapter 3) keeps K/V in a contiguous cache;
- :func:`generate_static` (chapter 4) runs a padded batch until its longest member ends.

Their greedy outputs agree token for token: that is the oracle every later
engine is checked against. ``min_tokens`` and the penalties edit the logits through the engine's own
:func:`~enginelib.model.logits_processors.apply_history`, so a penalised request is an oracle too.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from enginelib.baselines.kv_cache import ContiguousKVCache
from enginelib.config import SamplingParams, finish_reason
from enginelib.config import check_request as validate
from enginelib.model.logits_processors import apply_history
from enginelib.model.sampling import make_generator, sample
from enginelib.model.transformer import Transformer


@dataclass
class Generation:
    """One request's result: its tokens, why it stopped, and when each token came."""

    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" (EOS or a stop token) or "length"
    token_times: list[float] = field(default_factory=list)  # seconds from the start, per token


def check_request(model: Transformer, prompt_ids: list[int], params: SamplingParams) -> None:
    """Refuse, with a message saying what to change, what cannot run (the engine's checks, and one more)."""
    validate(prompt_ids, params, model.cfg.vocab_size, model.cfg.context_length)
    if params.stop:
        raise ValueError("stop strings are applied by the engine (chapter 7); Part I's generators "
                         "stop on tokens: use stop_token_ids")
    if params.structured_output is not None:
        raise ValueError("structured output is applied by the engine (chapter 12); Part I's generators do not "
                         "constrain tokens: run the request through Engine or LLM")


def _next_tokens(logits: torch.Tensor, params: SamplingParams, gens: list[Generation],
                 generator: torch.Generator | None, eos: int | None) -> torch.Tensor:
    """One token per row of ``logits`` [B, V] (row i is ``gens[i]``'s), after ``min_tokens`` and the penalties
    edit a copy of each row by its own tokens so far, as the engine's runner does."""
    if params.uses_history:
        logits = logits.clone()
        for row, gen in zip(logits, gens):
            apply_history(row, params, gen.prompt_ids, gen.token_ids, eos)
    return sample(logits, params, generator)


def _append(gen: Generation, token: int, start: float, params: SamplingParams, eos: int | None) -> bool:
    """Record one new token; return True when the request is finished."""
    gen.token_ids.append(token)
    gen.token_times.append(time.perf_counter() - start)
    gen.finish_reason = finish_reason(token, len(gen.token_ids), params, eos)
    return gen.finish_reason is not None


@torch.inference_mode()
def generate_naive(model: Transformer, prompt_ids: list[int], params: SamplingParams,
                   eos_token_id: int | None = None) -> Generation:
    """Feed the whole sequence through the model for every new token: no cache at all."""
    check_request(model, prompt_ids, params)
    gen, start = Generation(list(prompt_ids)), time.perf_counter()
    generator = make_generator(params.seed, model.device)
    ids = torch.tensor([prompt_ids], device=model.device)
    while True:
        logits = model(ids, last_only=True)[:, -1]
        token = int(_next_tokens(logits, params, [gen], generator, eos_token_id)[0])
        if _append(gen, token, start, params, eos_token_id):
            return gen
        ids = torch.cat([ids, ids.new_tensor([[token]])], dim=1)


@torch.inference_mode()
def generate_cached(model: Transformer, prompt_ids: list[int], params: SamplingParams,
                    eos_token_id: int | None = None) -> Generation:
    """Prefill the prompt once into a contiguous KV cache, then feed one token per step."""
    check_request(model, prompt_ids, params)
    gen, start = Generation(list(prompt_ids)), time.perf_counter()
    generator = make_generator(params.seed, model.device)
    cache = ContiguousKVCache(model.cfg, 1, len(prompt_ids) + params.max_tokens,
                              device=model.device, dtype=model.dtype)
    ids = torch.tensor([prompt_ids], device=model.device)
    while True:
        logits = model(ids, cache, last_only=True)[:, -1]
        token = int(_next_tokens(logits, params, [gen], generator, eos_token_id)[0])
        if _append(gen, token, start, params, eos_token_id):
            return gen
        ids = ids.new_tensor([[token]])


@dataclass
class StaticBatchRun:
    """What one static batch did: per-request results and the batch's step clock."""

    generations: list[Generation]
    step_times: list[float]  # seconds from the start to the end of each step (step 0 = prefill)
    padded_prompt_len: int

    @property
    def num_steps(self) -> int:
        return len(self.step_times)

    @property
    def useful_fraction(self) -> float:
        """Generated tokens / token slots the batch computed (finished rows still ride along)."""
        return sum(len(g.token_ids) for g in self.generations) / (len(self.generations) * self.num_steps)


@torch.inference_mode()
def generate_static(model: Transformer, prompts: list[list[int]], params: SamplingParams,
                    eos_token_id: int | None = None, pad_token_id: int = 0) -> StaticBatchRun:
    """Left-pad the prompts into one batch and decode until every request is done.

    A finished row keeps its seat (and its compute) until the last one ends:
    that is the straggler problem continuous batching removes.
    """
    for p in prompts:
        check_request(model, p, params)
    width = max(len(p) for p in prompts)
    pad = [width - len(p) for p in prompts]
    gens = [Generation(list(p)) for p in prompts]
    start, step_times = time.perf_counter(), []
    generator = make_generator(params.seed, model.device)
    cache = ContiguousKVCache(model.cfg, len(prompts), width + params.max_tokens,
                              device=model.device, dtype=model.dtype, pad=pad)
    ids = torch.tensor([[pad_token_id] * n + p for n, p in zip(pad, prompts)], device=model.device)
    while True:
        logits = model(ids, cache, last_only=True)[:, -1]
        tokens = _next_tokens(logits, params, gens, generator, eos_token_id).tolist()
        for gen, token in zip(gens, tokens):
            if gen.finish_reason is None:
                _append(gen, token, start, params, eos_token_id)
        step_times.append(time.perf_counter() - start)
        if all(g.finish_reason for g in gens):
            return StaticBatchRun(gens, step_times, width)
        ids = ids.new_tensor(tokens)[:, None]


def generate_static_batches(model: Transformer, prompts: list[list[int]], params: SamplingParams,
                            batch_size: int, eos_token_id: int | None = None) -> list[StaticBatchRun]:
    """Serve a list of prompts in arrival order, ``batch_size`` at a time."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")
    return [generate_static(model, prompts[i:i + batch_size], params, eos_token_id)
            for i in range(0, len(prompts), batch_size)]
