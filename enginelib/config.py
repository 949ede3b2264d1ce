"""What a request asks for, and when it is done: plain data, no torch.

The scheduling side (requests, scheduler, KV-cache manager) imports this and
not :mod:`enginelib.model.sampling`, which holds the tensor code, as vLLM keeps
``sampling_params.py`` apart from its sampler.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field


def _is_int(value: object) -> bool:
    """An int that is not a bool: ``True`` would otherwise pass as 1 and hide a mix-up of arguments."""
    return isinstance(value, int) and not isinstance(value, bool)


def _check_number(name: str, value: object, example: str) -> None:
    """Refuse a non-number or a nan/inf up front: either would crash or sample garbage only later, mid-batch."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r} ({type(value).__name__}): pass e.g. {name}={example}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}: pass e.g. {name}={example}")


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop, shaped like vLLM's ``SamplingParams``.

    ``temperature=0`` means greedy. ``top_k`` of 0 or -1 and ``top_p`` of 1 turn
    those filters off. ``seed`` makes sampling reproducible per request.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 16
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    seed: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self._check_types()
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 means greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k must be a positive integer, or 0 / -1 to disable it; got {self.top_k!r}")

    def _check_types(self) -> None:
        """Checks the range checks below cannot make: a string or nan there would raise TypeError or pass."""
        _check_number("temperature", self.temperature, "0.7 (0 means greedy)")
        _check_number("top_p", self.top_p, "0.9 (1 turns it off)")
        if not isinstance(self.stop, (list, tuple)) or not all(isinstance(s, str) for s in self.stop):
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}")
        if any(s == "" for s in self.stop):
            raise ValueError(f"stop strings must not be empty (one would match before any text), got {self.stop!r}: "
                             "pass only non-empty strings in stop")
        self.stop = list(self.stop)
        if not isinstance(self.stop_token_ids, (list, tuple)) or not all(_is_int(t) for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be a list of integer token ids, got {self.stop_token_ids!r}")
        self.stop_token_ids = list(self.stop_token_ids)
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def finish_reason(token: int, num_generated: int, params: SamplingParams, eos_token_id: int | None) -> str | None:
    """Why a request stops after emitting ``token``, or None if it goes on."""
    if (token == eos_token_id and not params.ignore_eos) or token in params.stop_token_ids:
        return "stop"
    if num_generated >= params.max_tokens:
        return "length"
    return None


def stop_hold_back(params: SamplingParams) -> int:
    """How many trailing characters a stream keeps back: a stop string may start in them and end in a
    token still to come, and then the final text ends before it (0 without stop strings)."""
    return max((len(s) for s in params.stop), default=1) - 1


def check_request(prompt_ids: list[int], params: SamplingParams, vocab_size: int, context_length: int) -> None:
    """Refuse, with what to change, a request no generator or engine can run (shared by both)."""
    if not isinstance(params, SamplingParams):
        raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}: "
                         "pass SamplingParams(...) or None for the defaults")
    if not prompt_ids:
        raise ValueError("the prompt is empty: give at least one token")
    bad = [t for t in prompt_ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"token ids {bad[:5]} are outside the vocabulary (0..{vocab_size - 1})")
    if len(prompt_ids) + params.max_tokens > context_length:
        raise ValueError(f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the "
                         f"model's context of {context_length} tokens: shorten the prompt or lower max_tokens")
