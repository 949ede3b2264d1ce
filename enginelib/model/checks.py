"""Comparing greedy tokens across batch shapes, code paths and dtypes: identical, or a near-tie.

In float32 on a CPU the engine's greedy tokens equal the single-request
reference exactly, whatever the batching. In float16 (or bfloat16) they need
not: a different batch shape sums the same products in another order, the
logits move by a few rounding steps, and where the two best tokens are almost
level the argmax can flip. From there the two continuations differ, and both
are right. :func:`check_greedy` tells that apart from a bug: a request passes
when its tokens are identical, or when they first differ at a *near-tie*, a
position where both tokens' logits are within ``threshold`` of the float32
reference model's best (usually they are its top two; with activations rounded to
int8, as chapter 13's fastest kernels do, a third candidate can be as close).

``NEAR_TIE_MARGIN`` is 0.25 logits. Measured on SmolLM2-135M on a CPU, teacher-forced
over the float32 greedy runs of eight chat prompts (393 positions), float16 against
float32: float16 moved the gap between the reference's top two logits by 0.008 at
the median, 0.036 at the 99th percentile and 0.055 at worst (any single logit by
0.046 median, 0.12 at worst). Two float16 runs of different batch shapes can
disagree by both errors at once, about 0.11; 0.25 is twice that, 4.5x one run's
worst, and just above 2 x 0.12 (a margin whose two logits both move their most). It is
still selective: 12% of the positions had a float32 margin below 0.2 (27% below 0.5),
and both tokens must be that close to the best. bfloat16 rounds 8x more coarsely:
pass a larger ``threshold`` for it (not measured here; a T4 has no bfloat16).
"""
from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from enginelib.model.transformer import Transformer

NEAR_TIE_MARGIN = 0.25  # logits below the float32 best within which an argmax may flip in float16: see the docstring


@dataclass(frozen=True)
class Divergence:
    """Where one request's tokens first differ, and how close the two tokens' logits were to the best there."""

    request: int   # index into the sequences given to check_greedy
    position: int  # index into the generated tokens
    # float32 reference, given prompt + expected[:position]: its best logit minus the lower of the two tokens'
    # (for a flip between its top two, the top-2 margin)
    margin: float


@dataclass(frozen=True)
class Agreement:
    """The verdict of :func:`check_greedy` (which raises on anything worse)."""

    identical: int
    near_ties: tuple[Divergence, ...]
    threshold: float = NEAR_TIE_MARGIN

    @property
    def total(self) -> int:
        return self.identical + len(self.near_ties)

    def __str__(self) -> str:
        text = f"{self.identical} of {self.total} requests identical token for token"
        if self.near_ties:
            where = ", ".join(f"request {d.request} at token {d.position} (margin {d.margin:.3f})"
                              for d in self.near_ties)
            text += (f"; {len(self.near_ties)} diverged at a near-tie of the float32 reference "
                     f"(both tokens within {self.threshold} of its best logit): {where}")
        return text


def float32_reference(model: Transformer) -> Transformer:
    """The model itself when it is float32, else a float32 copy of it (same weights, upcast)."""
    if model.dtype == torch.float32:
        return model
    return copy.deepcopy(model).float()


@torch.inference_mode()
def gaps_to_best(reference: Transformer, ids: Sequence[int], tokens: Sequence[int]) -> tuple[int, list[float]]:
    """The reference's best next token after ``ids``, and how far below its logit each of ``tokens``' is."""
    logits = reference(torch.tensor([list(ids)], device=reference.device), last_only=True)[0, -1].float()
    best = int(logits.argmax())
    return best, [float(logits[best] - logits[t]) for t in tokens]


def check_greedy(model: Transformer, prompts: Sequence[Sequence[int]], got: Sequence[Sequence[int]],
                 expected: Sequence[Sequence[int]], *, threshold: float = NEAR_TIE_MARGIN,
                 reference: Transformer | None = None) -> Agreement:
    """Check greedy tokens ``got`` against ``expected``, request by request; raise if any differ for real.

    A request passes when its tokens are identical, or when they first differ
    at a position where both tokens' logits are within ``threshold`` of the
    float32 reference's best (given the prompt and ``expected`` up to there).
    Anything else raises AssertionError naming the request, the position, the
    tokens and how far below the best they were. The reference is ``model``
    itself in float32, else a float32 copy (pass ``reference`` to reuse one).
    """
    if not len(prompts) == len(got) == len(expected):
        raise ValueError(f"give one entry per request: {len(prompts)} prompts, {len(got)} got, "
                         f"{len(expected)} expected")
    identical, ties = 0, []
    for i, (prompt, ours, theirs) in enumerate(zip(prompts, got, expected)):
        ours, theirs = list(ours), list(theirs)
        if ours == theirs:
            identical += 1
            continue
        pos = next((j for j, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
        if pos is None:
            raise AssertionError(f"request {i}: the tokens agree but one run is longer ({len(ours)} tokens "
                                 f"vs {len(theirs)} expected): a stop condition differs, not a near-tie")
        reference = reference or float32_reference(model)
        best, gaps = gaps_to_best(reference, [*prompt, *theirs[:pos]], (ours[pos], theirs[pos]))
        margin = max(gaps)
        if margin >= threshold:
            raise AssertionError(
                f"request {i} diverges at generated token {pos}: got {ours[pos]}, expected {theirs[pos]}; the "
                f"float32 reference's best there is {best}, with a margin of {gaps[0]:.3f} and {gaps[1]:.3f} "
                f"logits over them (near-tie threshold {threshold}). This is not a rounding flip: look for a "
                "bug in the code path that produced it.")
        ties.append(Divergence(i, pos, margin))
    return Agreement(identical, tuple(ties), threshold)


__all__ = ["NEAR_TIE_MARGIN", "Agreement", "Divergence", "check_greedy", "float32_reference"]
