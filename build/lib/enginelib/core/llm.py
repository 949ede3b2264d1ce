"""``LLM``: the offline facade, shaped like vLLM's, over one :class:`Engine`."""
from __future__ import annotations

import os

import torch
from tqdm.auto import tqdm

from enginelib.config import EngineConfig, SamplingParams
from enginelib.core.engine import Engine
from enginelib.core.outputs import RequestOutput
from enginelib.model.tokenizer import Tokenizer
from enginelib.model.transformer import Transformer
from enginelib.model.weights import DEFAULT_MODEL, load_model

Prompt = str | list[int]


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
        ids = []
        try:
            for prompt, p in zip(prompts, params):
                ids.append(self.engine.add_request(prompt, p))
        except ValueError:
            for rid in ids:  # all or nothing: take back the ones already queued
                self.engine.abort(rid)
            self.engine.step()
            raise
        results: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), desc="requests", disable=not use_tqdm) as bar:
            while len(results) < len(ids):
                for out in self.engine.step():
                    if out.finished and out.request_id in ids and out.request_id not in results:
                        results[out.request_id] = out
                        bar.update()
        return [results[rid] for rid in ids]

    def chat(self, messages: list[dict[str, str]] | list[list[dict[str, str]]],
             sampling_params: SamplingParams | list[SamplingParams] | None = None) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation (or a list of them), then generate."""
        if not isinstance(messages, (list, tuple)) or not messages:
            raise ValueError(f"chat needs a non-empty list of messages (or of conversations), got {messages!r}: "
                             "pass e.g. [{'role': 'user', 'content': 'Hello'}]")
        conversations = [messages] if isinstance(messages[0], dict) else messages
        prompts = [self.tokenizer.apply_chat_template(c) for c in conversations]
        return self.generate(prompts, sampling_params)
