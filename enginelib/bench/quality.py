"""What quantizing costs in quality and what it saves in bytes (chapter 13's table, the ``quant`` section).

Measurement, not conversion: it lives with the benchmark, which alone may run Part I's generators
(:mod:`enginelib.baselines`) as its yardstick; :mod:`enginelib.speed.quant` only converts models.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from enginelib.baselines.generate import generate_cached
from enginelib.config import SamplingParams
from enginelib.model.transformer import Transformer
from enginelib.speed.quant import QuantLinear, linear_layers, quant_info

DATA_DIR = Path(__file__).parents[1] / "data"  # enginelib/data: the texts the repository ships

def shakespeare() -> str:
    """The public-domain text the repository ships for perplexity (see ``enginelib/data/README.md``)."""
    return (DATA_DIR / "shakespeare.txt").read_text(encoding="utf-8")


@dataclass
class Perplexity:
    """exp(mean negative log-likelihood) of the next token, over ``tokens`` scored tokens."""

    perplexity: float
    nll: float
    tokens: int


@torch.inference_mode()
def perplexity(model: Transformer, tokenizer, text: str | None = None, *, window: int = 256,
               max_tokens: int | None = None) -> Perplexity:
    """How surprised the model is by ``text`` (default: :func:`shakespeare`).

    The token ids are cut into non-overlapping windows of ``window`` tokens; each
    window runs without a cache, and every token after a window's first is scored
    on the tokens before it in that window. ``max_tokens`` keeps only the first
    that many token ids (a quick estimate). Same text and windows: comparable numbers.
    """
    if window < 2:
        raise ValueError(f"window must be at least 2 tokens (one to read, one to predict), got {window}")
    ids = tokenizer.encode(shakespeare() if text is None else text)[:max_tokens]
    if len(ids) < 2:
        raise ValueError("the text is shorter than 2 tokens: give a longer text or a larger max_tokens")
    total, count = 0.0, 0
    for start in range(0, len(ids) - 1, window):
        chunk = torch.tensor([ids[start:start + window]], device=model.device)
        if chunk.shape[1] < 2:
            break
        logits = model(chunk)[0, :-1].float()
        total += F.cross_entropy(logits, chunk[0, 1:], reduction="sum").item()
        count += chunk.shape[1] - 1
    return Perplexity(math.exp(total / count), total / count, count)


@dataclass
class GreedyAgreement:
    """Greedy tokens equal to the reference model's, counted up to each prompt's first divergence.

    ``matched[i]``: how many of prompt i's greedy tokens equal the reference's
    before the first that differs (all of them if none does); ``lengths[i]``: how
    many tokens the reference generated. ``agreement`` = sum(matched) / sum(lengths):
    1.0 means the same text for every prompt. Once two texts differ they go their
    own ways, so tokens after the first divergence are not compared.
    """

    matched: list[int]
    lengths: list[int]

    @property
    def agreement(self) -> float:
        return sum(self.matched) / max(1, sum(self.lengths))

    @property
    def identical(self) -> int:
        return sum(m == n for m, n in zip(self.matched, self.lengths))


def greedy_agreement(reference_model: Transformer, model: Transformer, tokenizer, prompts: list[str | list[int]],
                     max_tokens: int = 32) -> GreedyAgreement:
    """Greedy-decode each prompt with both models (Part I's cached generator); see :class:`GreedyAgreement`."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    matched, lengths = [], []
    for prompt in prompts:
        ids = tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        want = generate_cached(reference_model, ids, params, tokenizer.eos_token_id).token_ids
        got = generate_cached(model, ids, params, tokenizer.eos_token_id).token_ids
        same = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), min(len(want), len(got)))
        matched.append(same)
        lengths.append(len(want))
    return GreedyAgreement(matched, lengths)


def _tensor_bytes(model: nn.Module) -> int:
    """Bytes of the model's float tensors, each counted once (a tied head shares the embedding's)."""
    seen, total = set(), 0
    for t in (*model.parameters(), *model.buffers()):
        if id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


def weight_bytes(model: nn.Module) -> int:
    """Bytes of every weight the model holds: float tensors once each (a tied head counts once) plus stored
    quantized forms."""
    return _tensor_bytes(model) + sum(m.nbytes for m in model.modules() if isinstance(m, QuantLinear))


def linear_bytes_per_param(model: nn.Module) -> float:
    """Bytes per weight of the linear layers (LM head included), scales and minimums counted."""
    size = numel = 0
    for _, linear in linear_layers(model):
        size += linear.weight.numel() * linear.weight.element_size()
        numel += linear.weight.numel()
    for m in model.modules():
        if isinstance(m, QuantLinear):
            size, numel = size + m.nbytes, numel + m.in_features * m.out_features
    return size / numel


@dataclass
class FormatRow:
    """One row of chapter 13's table."""

    fmt: str
    bytes_per_param: float
    weight_bytes: int
    perplexity: float
    kernels: str  # which kernel ran each weight shape


def format_row(name: str, model: Transformer, tokenizer, text: str | None = None, *, window: int = 256,
               max_tokens: int | None = None) -> FormatRow:
    """Measure one model for the table: its size, and its perplexity on ``text`` (default: the shipped Shakespeare)."""
    info = quant_info(model)
    kernels = "float" if info is None else ", ".join(sorted(set(info.kernels.values())))
    ppl = perplexity(model, tokenizer, text, window=window, max_tokens=max_tokens)
    return FormatRow(name, linear_bytes_per_param(model), weight_bytes(model), ppl.perplexity, kernels)


@torch.inference_mode()
def decode_tokens_per_second(model: Transformer, tokenizer, prompt: str = "Once upon a time",
                             max_tokens: int = 32) -> float:
    """Single-stream greedy decode speed: tokens after the first, divided by the time they took."""
    gen = generate_cached(model, tokenizer.encode(prompt), SamplingParams(temperature=0, max_tokens=max_tokens,
                                                                         ignore_eos=True))
    times = gen.token_times
    return (len(times) - 1) / (times[-1] - times[0])
