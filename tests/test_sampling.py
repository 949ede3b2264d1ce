"""Sampling: validation of parameters, and each filter doing what it says."""
from __future__ import annotations

import pytest
import torch

from enginelib.model.sampling import SamplingParams, filter_logits, make_generator, sample


@pytest.mark.parametrize("bad, message", [
    (dict(max_tokens=0), "max_tokens"), (dict(max_tokens=-3), "max_tokens"),
    (dict(temperature=-0.1), "temperature"), (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"),
    (dict(top_k=-2), "top_k"), (dict(top_k=2.5), "top_k"),
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
