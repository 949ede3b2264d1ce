"""The whole decode step in one C++ call (``EngineConfig(fused_step=True)``, enginelib.speed.fused_step): the eager
step's logits and K/V on a toy model, the eager engine's greedy tokens on the real one, and a clear error where the
model or the config cannot have it.

Both sides round the activations to int8 before every matvec (the ``cpp_q8`` kernels), so where their float
arithmetic differs in the last bits (RMSNorm's sum, RoPE's angles, SiLU's exponential) a code can round the other
way: the logits agree to about 1% of their range, not bit for bit, and greedy tokens may part at a near-tie.
"""
from __future__ import annotations

import pytest
import torch

from enginelib.config import SamplingParams
from enginelib.core.engine import Engine, EngineConfig
from enginelib.model.checks import check_greedy
from enginelib.speed import cpu_kernels
from enginelib.speed.compiled import CompileConfig
from enginelib.speed.fused_step import FusedDecodeStep, fused_step_unavailable
from enginelib.speed.huge_pages import huge_pages_unavailable, move_to_huge_pages
from enginelib.speed.quant import load_quantized, quantize

from .conftest import chat_ids, tiny_tokenizer
from .test_compiled import _decode_batch, _random_cache

pytestmark = pytest.mark.skipif(cpu_kernels.unavailable("cpu") is not None,
                                reason=str(cpu_kernels.unavailable("cpu")))


@pytest.mark.parametrize("path,threads", [("fastest", None), ("plain", None), ("fastest", 1)])
def test_one_call_gives_the_eager_steps_logits_and_keys(tiny, path, threads):
    model = quantize(tiny, "int4", "cpp_q8", head="int8")
    step = FusedDecodeStep(model)
    if path == "plain":
        step.path = cpu_kernels.q8_path_number("plain")
    eager, fused = _random_cache(model.cfg, 0), _random_cache(model.cfg, 0)
    batch = _decode_batch(eager, [5, 9, 2])  # three sequences, one new token each, their blocks apart
    before = torch.get_num_threads()
    torch.set_num_threads(threads or before)  # one thread: a team of one, no barrier waits
    try:
        with torch.inference_mode():
            want = model(batch.token_ids, eager.bind(batch), positions=batch.positions,
                         logits_indices=batch.logits_indices)
            got, argmax = step(batch, fused)
    finally:
        torch.set_num_threads(before)
    assert step.serves(batch) and step.steps == 1 and got.shape == want.shape
    assert torch.equal(argmax, got.argmax(dim=-1))  # each row's, from the threads' shares of its columns
    assert (got - want).abs().max() < 0.02 * want.abs().max()  # a lost residual or a wrong angle is far off
    written = (eager.k != _random_cache(model.cfg, 0).k).any(dim=(0, 3, 4))  # [blocks, slots]: the new keys' slots
    assert written.sum() == 3 and torch.equal((fused.k != _random_cache(model.cfg, 0).k).any(dim=(0, 3, 4)), written)
    torch.testing.assert_close(fused.k, eager.k, atol=0.05, rtol=0.05)
    torch.testing.assert_close(fused.v, eager.v, atol=0.05, rtol=0.05)


def test_the_engine_decodes_the_eager_tokens_on_the_real_gguf(real):
    _, tok = real
    model, _ = load_quantized(progress=False, kernel="cpp_q8")
    prompts = [chat_ids(tok, q) for q in ("Name a fruit.", "What is 2 + 2?", "Say hello in French.")]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)

    def run(config: EngineConfig) -> tuple[Engine, list[list[int]]]:
        engine = Engine(model, tok, config)
        ids = [engine.add_request(p, params) for p in prompts]
        while engine.has_unfinished_requests():
            engine.step()
        assert engine.stats().pool.used == 0  # no block leaked
        return engine, [list(engine.request(i).output_token_ids) for i in ids]

    fused, got = run(EngineConfig(fused_step=True))
    _, expected = run(EngineConfig())
    assert fused.runner.compiled.steps == 15  # every decode step of the three, together, ran as one call
    # int8 rounding of the activations moves a logit by up to ~1 where the two sides' floats differ (see above)
    check_greedy(model, prompts, got, expected, reference=model, threshold=1.0)


def test_what_cannot_fuse_is_refused_with_the_reason(tiny):
    tok = tiny_tokenizer(tiny.cfg.vocab_size)
    with pytest.raises(ValueError, match="every layer int4 with the cpp_q8 kernel"):
        Engine(tiny, tok, EngineConfig(fused_step=True))  # float32 layers
    assert "int8 or q8_0 head" in fused_step_unavailable(quantize(tiny, "int4", "cpp_q8"))  # a float head
    step = FusedDecodeStep(quantize(tiny, "int4", "cpp_q8", head="int8"))
    cache = _random_cache(tiny.cfg, 0)
    tensors = list(step.tensors)
    tensors[4] = tensors[4][:-1]  # the first layer's input norm, one short: refused, not read past
    step.weights = torch.classes.enginelib.DecodeWeights(tensors)
    with pytest.raises(RuntimeError, match=r"weight 4 must be a norm: contiguous float32 \[64\]"):
        step(_decode_batch(cache, [5]), cache)
    with pytest.raises(ValueError, match="fused_step and compile are two ways"):
        Engine(quantize(tiny, "int4", "cpp_q8", head="int8"), tok,
               EngineConfig(fused_step=True, compile=CompileConfig(batch_sizes=(1,))))


@pytest.mark.skipif(huge_pages_unavailable() is not None, reason=str(huge_pages_unavailable()))
def test_the_weights_move_to_huge_pages_once_with_their_values(tiny):
    model = quantize(tiny, "int4", "cpp_q8", head="int8")
    layers = [m for m in model.modules() if hasattr(m, "prepared")]
    before = [(w.data.clone(), w.scale.clone()) for w in (m.prepared for m in layers)]
    FusedDecodeStep(model)  # moves them: one arena, starting on a 2 MiB boundary, each tensor on a cache line
    assert not move_to_huge_pages(model)  # not twice
    starts = [t.data_ptr() for m in layers for t in (m.prepared.data, m.prepared.scale)]
    assert min(starts) % (2 << 20) == 0 and all(p % 64 == 0 for p in starts)
    assert max(starts) - min(starts) < sum(m.prepared.data.nbytes + m.prepared.scale.nbytes for m in layers) * 2
    for m, (data, scale) in zip(layers, before):
        assert torch.equal(m.prepared.data, data) and torch.equal(m.prepared.scale, scale)
