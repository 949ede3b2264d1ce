"""The oracle: our model, tokenizer and generators against Hugging Face transformers on the real model.

transformers loads the very same GGUF file with its own code (and its own
dequantization), so agreement here means our decoder, our RoPE un-permutation
and our tokenizer are right, not merely self-consistent.
"""
from __future__ import annotations

import pytest
import torch

import enginelib
from enginelib.baselines import generate_cached, generate_naive, generate_static
from enginelib.model.sampling import SamplingParams

from .conftest import chat_ids

LOGIT_ATOL = 1e-3  # float32 on CPU; observed difference: 0 to a few 1e-5 on logits of magnitude ~30

TEXTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Numbers 12345 and 3.14159, emoji 🙂, ünïcödé   spaces\n\n\ttabs",
    "<|im_start|>user\nWrite a haiku about the sea.<|im_end|>\n<|im_start|>assistant\n",
]


@pytest.fixture(scope="module")
def reference():
    """transformers' model and tokenizer read from the same GGUF file."""
    transformers = pytest.importorskip("transformers")
    path = enginelib.fetch()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return model, tokenizer


@pytest.mark.parametrize("text", TEXTS)
def test_tokenizer_matches_transformers(real_f32, reference, text):
    _, tok = real_f32
    _, ref_tok = reference
    assert tok.encode(text) == ref_tok.encode(text, add_special_tokens=False)
    assert tok.decode(tok.encode(text)) == text


def test_chat_template_matches_transformers(real_f32, reference):
    _, tok = real_f32
    _, ref_tok = reference
    for messages in ([{"role": "user", "content": "hi"}],
                     [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
                      {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3+3?"}]):
        expected = ref_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert tok.apply_chat_template(messages) == expected


@torch.inference_mode()
def test_next_token_logits_match_transformers(real_f32, reference):
    model, tok = real_f32
    ref, _ = reference
    for text in TEXTS:
        ids = torch.tensor([tok.encode(text)])
        torch.testing.assert_close(model(ids), ref(ids).logits, atol=LOGIT_ATOL, rtol=0)


@torch.inference_mode()
@pytest.mark.parametrize("question", ["Write a haiku about the sea.", "Explain what a CPU cache is.",
                                      "Tell me a story about a dragon."])
def test_greedy_continuation_matches_transformers_for_32_tokens(real_f32, reference, question):
    model, tok = real_f32
    ref, _ = reference
    prompt = chat_ids(tok, question)
    expected = ref.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False)[0, len(prompt):]
    assert len(expected) == 32, "pick a prompt whose answer is longer than 32 tokens"
    ours = generate_cached(model, prompt, SamplingParams(temperature=0, max_tokens=32), tok.eos_token_id)
    assert ours.token_ids == expected.tolist()


QUESTIONS = ["What is the capital of France?", "hi", "Write a haiku about the sea.",
             "List three colors.", "Explain gravity to a child in two sentences.",
             "What is 12 times 7? Answer with the number only."]


def test_naive_cached_and_static_batching_agree_token_for_token(real_f32):
    model, tok = real_f32
    prompts = [chat_ids(tok, q) for q in QUESTIONS]
    params = SamplingParams(temperature=0, max_tokens=24)
    naive = [generate_naive(model, p, params, tok.eos_token_id) for p in prompts]
    cached = [generate_cached(model, p, params, tok.eos_token_id) for p in prompts]
    batch = generate_static(model, prompts, params, tok.eos_token_id)
    for n, c, b in zip(naive, cached, batch.generations):
        assert n.token_ids == c.token_ids == b.token_ids
        assert n.finish_reason == c.finish_reason == b.finish_reason
    assert {g.finish_reason for g in naive} == {"stop", "length"}  # both endings exercised
    assert "Paris" in tok.decode(naive[0].token_ids)


def test_seeded_sampling_is_reproducible_and_differs_across_seeds(real_f32):
    model, tok = real_f32
    prompt = chat_ids(tok, "Tell me a story about a dragon.")
    runs = [generate_cached(model, prompt, SamplingParams(temperature=1.0, top_p=0.9, max_tokens=16,
                                                          seed=s, ignore_eos=True), tok.eos_token_id)
            for s in (1, 1, 2)]
    assert runs[0].token_ids == runs[1].token_ids != runs[2].token_ids


def test_a_prompt_longer_than_the_context_is_refused(real_f32):
    model, _ = real_f32
    too_long = [100] * model.cfg.context_length
    with pytest.raises(ValueError, match="exceeds the model's context"):
        generate_cached(model, too_long, SamplingParams(max_tokens=1))


def test_empty_prompts_and_out_of_vocabulary_ids_are_refused(real_f32):
    model, _ = real_f32
    with pytest.raises(ValueError, match="empty"):
        generate_naive(model, [], SamplingParams())
    with pytest.raises(ValueError, match="outside the vocabulary"):
        generate_naive(model, [1, model.cfg.vocab_size], SamplingParams())


def test_stop_token_ids_end_a_request_early(real_f32):
    model, tok = real_f32
    prompt = chat_ids(tok, "What is the capital of France?")
    full = generate_cached(model, prompt, SamplingParams(temperature=0, max_tokens=12), tok.eos_token_id)
    stop_at = full.token_ids[3]
    cut = generate_cached(model, prompt, SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_at]),
                          tok.eos_token_id)
    assert cut.token_ids == full.token_ids[:full.token_ids.index(stop_at) + 1]
    assert cut.finish_reason == "stop"
