"""``LLM``: the offline facade, shaped like vLLM's, over one :class:`Engine`."""
from __future__ import annotations

import os
from dataclasses import replace

import torch
from tqdm.auto import tqdm

from enginelib.config import EngineConfig, SamplingParams
from enginelib.core.engine import Engine
from enginelib.core.outputs import RequestOutput
from enginelib.model.tokenizer import Tokenizer
from enginelib.model.transformer import Transformer
from enginelib.model.weights import DEFAULT_MODEL, load_model

Prompt = str | list[int]


def fan_out(params: SamplingParams, n: int | None = None) -> list[SamplingParams]:
    """A prompt's ``n`` samples (``params.n`` unless given) as the params of ``n`` requests of their own, sample j
    seeded ``seed + j`` (as vLLM's child requests): ``LLM.generate`` and the server fan ``n`` out here alone."""
    return [params.sample(j) for j in range(params.n if n is None else n)]


def _samples(outs: list[RequestOutput]) -> RequestOutput:
    """One prompt's n samples as one output (the first's id and metrics), completion j being sample j."""
    if len(outs) == 1:
        return outs[0]
    completions = [replace(out.outputs[0], index=j) for j, out in enumerate(outs)]
    return replace(outs[0], outputs=completions)


class LLM:
    """``LLM(model="smollm2-135m", **engine_args).generate(prompts, SamplingParams(...))``."""

    def __init__(self, model: str | os.PathLike = DEFAULT_MODEL, *, device: str | torch.device | None = None,
                 dtype: torch.dtype | None = None, **engine_args) -> None:
        net, tokenizer = load_model(model, device=device, dtype=dtype, progress=False)
        self._setup(net, tokenizer, engine_args)

    @classmethod
    def from_model(cls, model: Transformer, tokenizer: Tokenizer, **engine_args) -> "LLM":
        """Wrap a model already loaded (tests and chapters share one)."""
        llm = cls.__new__(cls)
        llm._setup(model, tokenizer, engine_args)
        return llm

    def _setup(self, model: Transformer, tokenizer: Tokenizer, engine_args: dict) -> None:
        self.model, self.tokenizer = model, tokenizer
        self.engine = Engine(model, tokenizer, EngineConfig.from_args(**engine_args))

    def generate(self, prompts: Prompt | list[Prompt],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in input order."""
        if not isinstance(prompts, (str, list, tuple)):  # checked here: None or a dict would crash below
            raise ValueError(f"prompts must be a string, a list of int token ids, or a list of those; "
                             f"got {type(prompts).__name__}: pass e.g. ['Hello'] or [tokenizer.encode('Hello')]")
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        params = params if isinstance(params, list) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts: give one, or one each")
        ids: list[list[str]] = []  # per prompt, its n samples' request ids
        try:
            for prompt, p in zip(prompts, params):
                ids.append([])
                for sample in fan_out(p):  # n samples: n requests; the later ones find the prompt's blocks cached
                    ids[-1].append(self.engine.add_request(prompt, sample))
        except ValueError:
            for rid in (rid for group in ids for rid in group):  # all or nothing: take back the ones queued
                self.engine.abort(rid)
            self.engine.step()
            raise
        wanted = {rid for group in ids for rid in group}
        results: dict[str, RequestOutput] = {}
        with tqdm(total=len(wanted), desc="requests", disable=not use_tqdm) as bar:
            while len(results) < len(wanted):
                for out in self.engine.step():
                    if out.finished and out.request_id in wanted and out.request_id not in results:
                        results[out.request_id] = out
                        bar.update()
        return [_samples([results[rid] for rid in group]) for group in ids]

    def chat(self, messages: list[dict[str, str]] | list[list[dict[str, str]]],
             sampling_params: SamplingParams | list[SamplingParams] | None = None) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation (or a list of them), then generate."""
        if not isinstance(messages, (list, tuple)) or not messages:
            raise ValueError(f"chat needs a non-empty list of messages (or of conversations), got {messages!r}: "
                             "pass e.g. [{'role': 'user', 'content': 'Hello'}]")
        conversations = [messages] if isinstance(messages[0], dict) else messages
        prompts = [self.tokenizer.apply_chat_template(c) for c in conversations]
        return self.generate(prompts, sampling_params)
