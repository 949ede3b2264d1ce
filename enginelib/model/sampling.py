"""Choosing the next token: greedy, temperature, min-p, top-k, top-p, seeded."""
from __future__ import annotations

import torch

from enginelib.config import SamplingParams, finish_reason  # noqa: F401  (re-exported: Part I imports them from here)


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator | None:
    """A private random stream for one request, or None to use torch's global one."""
    if seed is None:
        return None
    return torch.Generator(device=device).manual_seed(seed)


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature-scale logits [B, V] and mask (to -inf) tokens outside min-p, top-k and top-p (vLLM's order)."""
    # a masked token (-inf) stays masked whatever the temperature: -inf / inf (a temperature past float32's range)
    # would be NaN, and +inf (a tiny repetition_penalty's division) is capped, so no row's softmax is NaN
    logits = logits.float().clamp(max=torch.finfo(torch.float32).max)
    logits = torch.where(logits.isneginf(), logits, logits / params.temperature)
    if params.min_p > 0:
        probs = logits.softmax(dim=-1)
        logits = logits.masked_fill(probs < params.min_p * probs.max(dim=-1, keepdim=True).values, float("-inf"))
    if params.top_k > 0:
        kth = torch.topk(logits, min(params.top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        # Drop a token when the tokens ranked above it already cover top_p.
        outside = probs.cumsum(dim=-1) - probs >= params.top_p
        outside[..., 0] = False  # the likeliest always stays: a top_p below float32's range compares as 0 >= 0
        sorted_logits = sorted_logits.masked_fill(outside, float("-inf"))
        logits = torch.empty_like(logits).scatter_(-1, order, sorted_logits)
    return logits


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None) -> torch.Tensor:
    """Pick one token per row of logits [B, V] -> [B]."""
    if params.greedy:
        return logits.argmax(dim=-1)
    probs = filter_logits(logits, params).softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor,
                   num_top: int) -> list[tuple[int, float, list[tuple[int, float]], int]]:
    """Each row's token (from ``tokens`` [B]), its log-probability, the row's ``num_top`` likeliest tokens with
    theirs, best first, and the token's rank (1: the likeliest; vLLM reports it), in one transfer; from the raw
    logits [B, V], what the model thinks (vLLM's default)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(1, tokens.view(-1, 1).long())
    rank = (logprobs > chosen).sum(dim=-1, keepdim=True) + 1
    top = logprobs.topk(min(num_top, logprobs.shape[-1]), dim=-1)
    # token ids are exact in float64: one tensor, one transfer
    host = torch.cat([tokens.view(-1, 1).double(), chosen.double(), rank.double(), top.values.double(),
                      top.indices.double()], dim=1).tolist()
    k = top.values.shape[1]
    return [(int(row[0]), row[1], [(int(i), v) for v, i in zip(row[3:3 + k], row[3 + k:])], int(row[2]))
            for row in host]
