"""Choosing the next token: greedy, temperature, top-k, top-p, seeded."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch


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


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator | None:
    """A private random stream for one request, or None to use torch's global one."""
    if seed is None:
        return None
    return torch.Generator(device=device).manual_seed(seed)


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature-scale logits [B, V] and mask (to -inf) tokens outside top-k and top-p."""
    logits = logits.float() / params.temperature
    if params.top_k > 0:
        kth = torch.topk(logits, min(params.top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        # Drop a token when the tokens ranked above it already cover top_p.
        outside = probs.cumsum(dim=-1) - probs >= params.top_p
        sorted_logits = sorted_logits.masked_fill(outside, float("-inf"))
        logits = torch.empty_like(logits).scatter_(-1, order, sorted_logits)
    return logits


def sample(logits: torch.Tensor, params: SamplingParams,
           generator: torch.Generator | None = None) -> torch.Tensor:
    """Pick one token per row of logits [B, V] -> [B]."""
    if params.greedy:
        return logits.argmax(dim=-1)
    probs = filter_logits(logits, params).softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def finish_reason(token: int, num_generated: int, params: SamplingParams, eos_token_id: int | None) -> str | None:
    """Why a request stops after emitting ``token``, or None if it goes on."""
    if (token == eos_token_id and not params.ignore_eos) or token in params.stop_token_ids:
        return "stop"
    if num_generated >= params.max_tokens:
        return "length"
    return None
