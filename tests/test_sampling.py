"""Sampling: validation of parameters, and each filter doing what it says."""
from __future__ import annotations

import pytest
import torch

from enginelib.model.logits_processors import apply_history
from enginelib.model.sampling import SamplingParams, filter_logits, make_generator, sample


@pytest.mark.parametrize("bad, message", [
    (dict(max_tokens=0), "max_tokens"), (dict(max_tokens=-3), "max_tokens"),
    (dict(temperature=-0.1), "temperature"), (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"),
    (dict(top_k=-2), "top_k"), (dict(top_k=2.5), "top_k"),
    (dict(min_p=-0.1), "min_p"), (dict(min_p=1.5), "min_p"), (dict(min_p="0.1"), "min_p"),
    (dict(min_tokens=-1), "min_tokens"), (dict(min_tokens=17), "min_tokens"), (dict(min_tokens=True), "min_tokens"),
    (dict(presence_penalty=2.5), "presence_penalty"), (dict(frequency_penalty=-3), "frequency_penalty"),
    (dict(frequency_penalty=float("nan")), "frequency_penalty"), (dict(repetition_penalty=0), "repetition_penalty"),
    (dict(repetition_penalty=float("inf")), "repetition_penalty"), (dict(skip_special_tokens=1), "skip_special_tokens"),
])
def test_bad_sampling_values_are_refused_with_the_name_of_the_field(bad, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**bad)


def test_a_single_stop_string_becomes_a_list():
    assert SamplingParams(stop="\n").stop == ["\n"]


def test_greedy_is_argmax():
    logits = torch.randn(4, 50)
    assert torch.equal(sample(logits, SamplingParams(temperature=0)), logits.argmax(-1))


def test_top_k_one_and_a_tiny_top_p_both_leave_only_the_best_token():
    torch.manual_seed(0)
    logits = torch.randn(8, 100)
    # 5e-324 is 0 in float32, where the probabilities are: the best token must stay all the same (the fuzz test's find)
    for params in (SamplingParams(top_k=1), SamplingParams(top_p=1e-6), SamplingParams(top_p=5e-324)):
        assert torch.equal(sample(logits, params), logits.argmax(-1))


def test_top_k_keeps_exactly_k_tokens():
    logits = torch.randn(3, 40)
    kept = filter_logits(logits, SamplingParams(top_k=5)).isfinite().sum(-1)
    assert kept.tolist() == [5, 5, 5]


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    kept = filter_logits(probs.log(), SamplingParams(top_p=0.8)).isfinite()
    assert kept.tolist() == [[True, True, False, False]]
    kept = filter_logits(probs.log(), SamplingParams(top_p=0.81)).isfinite()
    assert kept.tolist() == [[True, True, True, False]]


def test_temperature_sharpens_and_flattens():
    logits = torch.tensor([[2.0, 1.0, 0.0]])
    cold = filter_logits(logits, SamplingParams(temperature=0.5)).softmax(-1)
    hot = filter_logits(logits, SamplingParams(temperature=2.0)).softmax(-1)
    assert cold[0, 0] > logits.softmax(-1)[0, 0] > hot[0, 0]


def test_a_seed_makes_sampling_reproducible():
    logits = torch.randn(1, 1000)
    params = SamplingParams(temperature=1.0, seed=7)
    draws = [[int(sample(logits, params, g)) for _ in range(20)]
             for g in (make_generator(7), make_generator(7))]
    assert draws[0] == draws[1]
    assert len(set(draws[0])) > 1


def test_min_p_keeps_the_tokens_at_least_min_p_times_as_likely_as_the_best():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    kept = filter_logits(probs.log(), SamplingParams(min_p=0.3)).isfinite()  # 0.3 * 0.5 = 0.15: kept, 0.05 not
    assert kept.tolist() == [[True, True, True, False]]
    assert filter_logits(probs.log(), SamplingParams(min_p=1.0)).isfinite().sum() == 1
    assert filter_logits(probs.log(), SamplingParams(min_p=0.0)).isfinite().all()


def seen(params: SamplingParams, prompt: list[int], output: list[int]) -> tuple:
    """The history of a request that has read ``prompt`` and written ``output``: apply_history's middle arguments."""
    return params, prompt, output


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_seen_tokens():
    logits = torch.tensor([2.0, -1.0, 3.0, -4.0, 1.0])
    out = apply_history(logits.clone(), *seen(SamplingParams(repetition_penalty=2.0), [0, 1], [1, 3]), None)
    assert out.tolist() == [1.0, -2.0, 3.0, -8.0, 1.0]  # 0, 1 in the prompt, 3 in the output; 2, 4 unseen


def test_presence_and_frequency_penalties_count_output_tokens_only():
    logits = torch.zeros(5)
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    out = apply_history(logits.clone(), *seen(params, [4, 4, 4], [1, 1, 2]), None)
    assert out.tolist() == [0.0, -1.0, -0.75, 0.0, 0.0]  # token 1 twice: 0.5 + 2 * 0.25; the prompt's 4: untouched


def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    logits = torch.zeros(6)
    params = SamplingParams(min_tokens=2, stop_token_ids=[3, 99])  # 99: outside this vocabulary, skipped
    masked = apply_history(logits.clone(), *seen(params, [0], [1]), eos_token_id=5)
    assert masked.isinf().tolist() == [False, False, False, True, False, True]
    assert apply_history(logits.clone(), *seen(params, [0], [1, 2]), eos_token_id=5).isfinite().all()


def test_default_params_use_no_history():
    """The runner edits a row only for a request whose logits depend on its tokens: default greedy is untouched."""
    assert not SamplingParams().uses_history and not SamplingParams(min_p=0.5, temperature=0.7).uses_history
    for knob in (dict(min_tokens=1), dict(repetition_penalty=1.1), dict(presence_penalty=0.1),
                 dict(frequency_penalty=-0.1)):
        assert SamplingParams(**knob).uses_history, knob


def test_sample_j_of_n_is_seeded_seed_plus_j_within_64_bits():
    """n samples are n requests seeded seed + j; the largest valid seed wraps to the smallest (schemathesis found
    seed 2**64 - 1 with n = 2 refused: its second sample's seed did not fit)."""
    assert [SamplingParams(seed=7, n=3).sample(j).seed for j in range(3)] == [7, 8, 9]
    top = SamplingParams(seed=2**64 - 1, n=2)
    assert [top.sample(j).seed for j in range(2)] == [2**64 - 1, -2**63]
    assert top.sample(1).n == 1 and SamplingParams(n=2).sample(1).seed is None
