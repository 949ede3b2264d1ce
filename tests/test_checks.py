"""check_greedy: identical passes, a flip at a real near-tie of the float32 model passes, anything else raises."""
from __future__ import annotations

import pytest
import torch

import enginelib
from enginelib.baselines import generate_cached
from enginelib.model.checks import NEAR_TIE_MARGIN, Agreement, Divergence, check_greedy
from enginelib.model.sampling import SamplingParams

from .conftest import chat_ids

GREEDY = SamplingParams(temperature=0, max_tokens=64)


@pytest.fixture(scope="module")
def run(real_f32):
    """A float32 greedy run, and the reference's top-2 tokens and margin at every generated position."""
    model, tok = real_f32
    prompt = chat_ids(tok, "Tell me a story about a dragon.")
    tokens = generate_cached(model, prompt, GREEDY, tok.eos_token_id).token_ids
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + tokens]))[0, len(prompt) - 1:-1]
    best = logits.topk(2, dim=-1)
    assert best.indices[:, 0].tolist() == tokens, "teacher forcing must reproduce the greedy run"
    return prompt, tokens, best.indices.tolist(), (best.values[:, 0] - best.values[:, 1]).tolist()


def test_identical_tokens_pass(real_f32, run):
    prompt, tokens, _, _ = run
    verdict = check_greedy(real_f32[0], [prompt, prompt], [tokens, tokens[:5]], [tokens, tokens[:5]])
    assert verdict == Agreement(2, ())
    assert str(verdict) == "2 of 2 requests identical token for token"


def test_a_flip_at_a_real_near_tie_passes(real_f32, run):
    prompt, tokens, top2, margins = run
    pos = min(range(len(margins)), key=margins.__getitem__)  # the closest call of the whole run
    assert margins[pos] < NEAR_TIE_MARGIN / 4, f"this run has no near-tie (smallest margin {margins[pos]:.3f})"
    flipped = tokens[:pos] + [top2[pos][1]] + tokens[pos + 1:]  # the runner-up, then anything
    verdict = check_greedy(real_f32[0], [prompt, prompt], [tokens, flipped], [tokens, tokens])
    assert verdict.identical == 1 and len(verdict.near_ties) == 1
    tie = verdict.near_ties[0]
    assert (tie.request, tie.position) == (1, pos) and tie.margin == pytest.approx(margins[pos], abs=1e-4)
    assert f"request 1 at token {pos}" in str(verdict) and "near-tie" in str(verdict)
    print(verdict)


def test_a_flip_at_a_big_margin_raises_and_says_where(real_f32, run):
    prompt, tokens, top2, margins = run
    pos = max(range(len(margins)), key=margins.__getitem__)
    assert margins[pos] > NEAR_TIE_MARGIN
    flipped = tokens[:pos] + [top2[pos][1]]
    with pytest.raises(AssertionError, match=rf"request 0 diverges at generated token {pos}: "
                                             rf"got {top2[pos][1]}, expected {tokens[pos]}.*margin"):
        check_greedy(real_f32[0], [prompt], [flipped], [tokens])


def test_a_token_far_below_the_best_raises_even_at_a_near_tie(real_f32, run):
    prompt, tokens, top2, margins = run
    pos = min(range(len(margins)), key=margins.__getitem__)
    with torch.inference_mode():
        logits = real_f32[0](torch.tensor([prompt + tokens[:pos]]), last_only=True)[0, -1]
    stranger = next(t for t in range(100, 200) if logits.max() - logits[t] > NEAR_TIE_MARGIN)
    with pytest.raises(AssertionError, match="not a rounding flip"):
        check_greedy(real_f32[0], [prompt], [tokens[:pos] + [stranger]], [tokens])


class FixedLogits(torch.nn.Module):
    """A stand-in reference model that predicts the same logits after any tokens."""

    device = torch.device("cpu")

    def __init__(self, logits: list[float]) -> None:
        super().__init__()
        self.logits = torch.tensor(logits)

    def forward(self, ids: torch.Tensor, last_only: bool = False) -> torch.Tensor:
        return self.logits.expand(1, 1 if last_only else ids.shape[1], -1)


def test_a_three_way_near_tie_passes_and_the_runner_up_need_not_be_involved():
    """Rounded int8 activations (chapter 13) can flip between the 2nd and 3rd candidates: both are near the best."""
    reference = FixedLogits([0.0, 5.0, 4.95, 4.9, 4.0])
    verdict = check_greedy(None, [[0]], [[1, 3]], [[1, 2]], reference=reference)
    assert verdict.near_ties == (Divergence(0, 1, pytest.approx(0.1)),)
    assert "within 0.25 of its best logit" in str(verdict)
    with pytest.raises(AssertionError, match=r"got 4, expected 2; .* best there is 1, with a margin of 1\.000 "
                                             r"and 0\.050 .*not a rounding flip"):
        check_greedy(None, [[0]], [[1, 4]], [[1, 2]], reference=reference)


def test_same_tokens_but_a_different_length_raise(real_f32, run):
    prompt, tokens, _, _ = run
    with pytest.raises(AssertionError, match="one run is longer"):
        check_greedy(real_f32[0], [prompt], [tokens[:10]], [tokens[:12]])
    with pytest.raises(ValueError, match="one entry per request"):
        check_greedy(real_f32[0], [prompt], [tokens], [tokens, tokens])


def test_a_float16_model_against_float32_tokens(real, real_f32):
    """The float16 model's own greedy runs, checked against float32's with a float32 copy as reference."""
    m32, tok = real_f32
    m16 = real[0] if real[0].dtype == torch.float16 else enginelib.load_model(
        device="cpu", dtype=torch.float16, progress=False)[0]
    prompts = [chat_ids(tok, q) for q in ("Tell me a story about a dragon.", "List three colors.")]
    params = SamplingParams(temperature=0, max_tokens=32)
    got = [generate_cached(m16, p, params, tok.eos_token_id).token_ids for p in prompts]
    expected = [generate_cached(m32, p, params, tok.eos_token_id).token_ids for p in prompts]
    verdict = check_greedy(m16, prompts, got, expected)  # no reference given: a float32 copy of m16
    assert verdict.total == 2
    assert all(isinstance(d, Divergence) and d.margin < NEAR_TIE_MARGIN for d in verdict.near_ties)
    print(verdict)


def test_the_benchmark_checks_requests_past_the_oracles_few_against_the_static_batcher(real_f32, run):
    """kv_cache serves one request of three; the engine's third is checked against static's, and a wrong one noted."""
    from enginelib.bench.results import SystemResult, check_same_tokens
    from enginelib.bench.workloads import BenchRequest, Workload

    prompt, tokens, top2, margins = run
    pos = max(range(len(margins)), key=margins.__getitem__)  # the clearest call: its runner-up is no near-tie
    wrong = tokens[:pos] + [top2[pos][1]] + tokens[pos + 1:]
    wl = Workload("three", [BenchRequest(prompt, len(tokens)) for _ in range(3)])

    def system(name: str, outputs: list[list[int]]) -> SystemResult:
        return SystemResult(name, len(outputs), sum(map(len, outputs)), 1.0, outputs=outputs)

    results = {"kv_cache": system("kv_cache", [tokens]), "static": system("static", [tokens] * 3),
               "engine": system("engine", [tokens, tokens, wrong])}
    check_same_tokens(real_f32[0], wl, results)
    assert "differs from static" in results["engine"].note and "kv_cache" not in results["engine"].note
    assert results["static"].note == ""
    results["engine"] = system("engine", [tokens] * 3)
    check_same_tokens(real_f32[0], wl, results)
    assert results["engine"].note == ""
