"""Decode through torch.compile (issue 11): the same tokens as eager, buckets padded up, a clear fallback.

Compiling costs seconds per bucket, so the model-sized check uses one bucket
and the tiny model covers padding, bucket changes and speculation's
verification steps (a row per token). ``CompiledDecoder.calls`` counts the steps each bucket
ran, so a test cannot pass by quietly running everything eagerly.
"""
from __future__ import annotations

import pytest
import torch

from enginelib.config import SamplingParams
from enginelib.core.engine import Engine, EngineConfig
from enginelib.speed import compiled
from enginelib.speed.compiled import CompileConfig, compile_unavailable
from enginelib.speed.speculative import SpeculativeConfig

from .conftest import DEVICE, chat_ids, tiny_tokenizer

needs_compiler = pytest.mark.skipif(compile_unavailable(DEVICE) is not None,
                                    reason=str(compile_unavailable(DEVICE)))


def _run(engine: Engine, prompts: list[list[int]], lengths: list[int]) -> list[list[int]]:
    ids = [engine.add_request(p, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)) for p, n in zip(prompts, lengths)]
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    assert engine.stats().pool.used == 0  # no block leaked
    return [done[i] for i in ids]


@needs_compiler
def test_compiled_decode_gives_the_eager_tokens_on_the_real_model(real, agree):
    model, tok = real  # on a CPU its linears are oneDNN-packed: the compiled step gets plain ones, same weights
    prompts = [chat_ids(tok, q) for q in ("What is a KV cache?", "Name three colours.")]
    lengths = [12, 7]  # two sequences, then one padded up to the one bucket
    limit = getattr(torch._dynamo.config, compiled.RECOMPILE_LIMIT)
    engine = Engine(model, tok, EngineConfig(compile=CompileConfig(batch_sizes=(2,))))
    assert getattr(torch._dynamo.config, compiled.RECOMPILE_LIMIT) == limit, "raised for tracing only, then restored"
    assert set(engine.runner.compile_report.seconds) == {2} and engine.runner.compile_report.total_seconds > 0
    # attention runs in our C++ decode kernel on a CPU in float32, in our Triton one on a GPU where Triton runs (the
    # oracle below is the eager SDPA path)
    if DEVICE.type == "cpu":
        kernel = "cpp" if model.dtype == torch.float32 else None
    else:
        from enginelib.speed import triton_kernels
        kernel = "triton" if triton_kernels.unavailable(DEVICE, model.dtype) is None else None
    assert engine.runner.compiled.kernel == kernel
    got = _run(engine, prompts, lengths)
    expected = _run(Engine(model, tok), prompts, lengths)
    agree(model, prompts, got, expected)
    assert engine.runner.compiled.calls[2] == max(lengths) - 1  # every decode step, none eager
    # on a CPU, once traced, the graph is called without dynamo (the same tokens, as checked above)
    assert (engine.runner.compiled.direct.get(2) is not None) == (DEVICE.type == "cpu")


@pytest.mark.skipif(DEVICE.type != "cuda" or compile_unavailable(DEVICE) is not None,
                    reason="CUDA graphs need a GPU (ENGINELIB_TEST_DEVICE=cuda)")
def test_cuda_graphs_replay_between_the_attention_calls(real, agree):
    model, tok = real
    prompts = [chat_ids(tok, q) for q in ("What is a KV cache?", "Name three colours.", "Why is the sky blue?")]
    lengths = [14, 9, 5]  # three sequences in the bucket of 4, then two, then one
    engine = Engine(model, tok, EngineConfig(compile=CompileConfig(batch_sizes=(1, 2, 4), mode="reduce-overhead")))
    assert engine.runner.compiled.cuda_graphs
    got = _run(engine, prompts, lengths)
    expected = _run(Engine(model, tok), prompts, lengths)
    agree(model, prompts, got, expected)
    assert sum(engine.runner.compiled.calls.values()) == max(lengths) - 1


@needs_compiler
def test_buckets_pad_up_and_bigger_batches_run_eagerly(tiny_dt):
    tok = tiny_tokenizer(tiny_dt.cfg.vocab_size)
    prompts = [[(7 * i + j) % 200 + 1 for j in range(5 + i)] for i in range(6)]
    lengths = [9, 8, 7, 6, 5, 4]  # six sequences shrinking to one: eager at 6 and 5, then buckets 4, 2 (padding 3), 1
    engine = Engine(tiny_dt, tok, EngineConfig(num_blocks=64, compile=CompileConfig(batch_sizes=(1, 2, 4))))
    got = _run(engine, prompts, lengths)
    assert got == _run(Engine(tiny_dt, tok, EngineConfig(num_blocks=64)), prompts, lengths)
    assert engine.runner.compiled.calls[4] >= 2 and engine.runner.compiled.calls[2] >= 1 and engine.runner.compiled.calls[1] >= 1
    if DEVICE.type == "cpu":  # every bucket's graph called directly once traced, padding rows and all
        assert all(engine.runner.compiled.direct.get(b) is not None for b in (1, 2, 4))
    assert engine.runner.compiled.bucket(3) == 4 and engine.runner.compiled.bucket(5) is None


@needs_compiler
def test_the_cpp_wrapper_gives_the_eager_tokens(tiny):
    """Inductor's C++ wrapper (CPU): the step's kernel calls in C++, our C++ operators among them; with the
    weights frozen into the graph, as the benchmark's fastest single stream runs."""
    tok = tiny_tokenizer(tiny.cfg.vocab_size)
    prompts = [[(5 * i + j) % 200 + 1 for j in range(4 + 3 * i)] for i in range(3)]
    lengths = [6, 4, 3]  # three sequences, then two, then one, all padded up to the one bucket
    config = CompileConfig(batch_sizes=(4,), cpp_wrapper=True, freeze=True)
    engine = Engine(tiny, tok, EngineConfig(num_blocks=32, compile=config))
    assert _run(engine, prompts, lengths) == _run(Engine(tiny, tok, EngineConfig(num_blocks=32)), prompts, lengths)
    assert engine.runner.compiled.calls[4] == max(lengths) - 1 and engine.runner.compiled.direct[4] is not None


@needs_compiler
def test_frozen_float32_linears_run_on_onednn_as_eager_ones_do(tiny):
    """Freezing packs a plain float32 linear for MKL's matmul; the traced model's linears call oneDNN's, the
    kernel the eager linears run (1.3-2x faster at the decode shapes on the book's CPU), on a weight packed
    in the graph, which freezing folds into a constant: no packing is left in the step."""
    from torch._inductor.utils import run_and_get_code

    tok = tiny_tokenizer(tiny.cfg.vocab_size)
    config = CompileConfig(batch_sizes=(2,), freeze=True)
    engine, code = run_and_get_code(lambda: Engine(tiny, tok, EngineConfig(num_blocks=32, compile=config)))
    code = "\n".join(code)
    assert "mkldnn._linear_pointwise" in code and "_mkl_linear" not in code
    assert "onednn_packed_weight" not in code and "_frozen_param" in code  # packed once, at compile time
    assert _run(engine, [[1, 2, 3], [4, 5]], [4, 3]) == _run(Engine(tiny, tok, EngineConfig(num_blocks=32)),
                                                          [[1, 2, 3], [4, 5]], [4, 3])


def test_a_trace_that_is_not_the_whole_step_is_not_called_directly():
    """Dynamo's call must return the graph's one output; otherwise (a graph break, Python between graphs)
    calling the graph alone would skip work, so the bucket keeps going through dynamo."""
    x, y, weight = torch.ones(2), torch.zeros(2), torch.full((2,), 3.0)
    built = compiled._Built(lambda a, w, b: (a * w + b,), [x, weight, y])
    out = built.fn(x, weight, y)[0]
    assert compiled.CompiledDecoder._direct_call(built, (x, y), out) is None  # first call not recorded
    built.first_outputs = (out,)
    assert compiled.CompiledDecoder._direct_call(built, (x, y), out.clone()) is None  # not what the call returned
    direct = compiled.CompiledDecoder._direct_call(built, (x, y), out)
    assert direct((torch.full((2,), 2.0), torch.ones(2))).tolist() == [7.0, 7.0]  # new arguments, same weight


@needs_compiler
def test_speculation_verifies_in_the_compiled_graphs(tiny_dt):
    """A verification (the last token and k guesses, every row sampled) runs in the bucket of its tokens: on a
    CPU in float32 each row attends through the C++ kernel up to its own position, so the guesses are causal."""
    tok = tiny_tokenizer(tiny_dt.cfg.vocab_size)
    prompts = [[3, 4, 5, 3, 4, 5, 3, 4], [9, 8, 7, 6], [5, 6, 5, 6, 5]]
    spec = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1)
    engine = Engine(tiny_dt, tok, EngineConfig(num_blocks=64, speculative=spec,
                                               compile=CompileConfig(batch_sizes=(1, 2, 4, 8))))
    got = _run(engine, prompts, [10, 12, 9])
    assert got == _run(Engine(tiny_dt, tok, EngineConfig(num_blocks=64)), prompts, [10, 12, 9])
    assert engine.runner.spec_stats.proposed > 0 and engine.runner.spec_stats.accepted > 0
    # a sequence verifying 3 guesses has 4 rows: bucket 4, or 8 beside other sequences (3 decoding alone: 4)
    assert engine.runner.compiled.calls[8] > 0 and engine.runner.compiled.calls[4] > 0
    # every step after the prefill ran compiled: nothing bigger than 8 rows, nothing but sampled rows
    assert sum(engine.runner.compiled.calls.values()) == engine.steps - 1


def test_no_compiler_falls_back_to_eager_with_the_fix_named(tiny_dt, monkeypatch):
    if DEVICE.type != "cpu":
        pytest.skip("the C++ compiler is the CPU's requirement")
    monkeypatch.setattr(compiled.shutil, "which", lambda name: None)
    tok = tiny_tokenizer(tiny_dt.cfg.vocab_size)
    with pytest.warns(RuntimeWarning, match="C\\+\\+ compiler.*apt-get install g\\+\\+.*runs eagerly"):
        engine = Engine(tiny_dt, tok, EngineConfig(num_blocks=32, compile=CompileConfig()))
    assert engine.runner.compiled is None and engine.runner.compile_report is None
    assert _run(engine, [[1, 2, 3]], [4]) == _run(Engine(tiny_dt, tok, EngineConfig(num_blocks=32)), [[1, 2, 3]], [4])
    with pytest.raises(ValueError, match="C\\+\\+ compiler"):
        Engine(tiny_dt, tok, EngineConfig(num_blocks=32, compile=CompileConfig(fallback=False)))


def test_bad_compile_settings_are_refused(real):
    for sizes in ((), (0, 2), (4, 2), (2, 2), (1.5,)):
        with pytest.raises(ValueError, match="batch_sizes"):
            CompileConfig(batch_sizes=sizes)
    with pytest.raises(ValueError, match="mode must be"):
        CompileConfig(mode="fastest")
    assert "not supported" in compile_unavailable(torch.device("meta"))


def test_unpacking_shares_the_weights(real):
    from enginelib.model.device import PackedLinear, unpack_linears

    model = real[0]
    plain = unpack_linears(model)
    if not any(isinstance(m, PackedLinear) for m in model.modules()):
        assert plain is model
        return
    assert not any(isinstance(m, PackedLinear) for m in plain.modules())
    assert all(a is b for a, b in zip(model.parameters(), plain.parameters()))
    assert plain.lm_head.weight is plain.embed_tokens.weight  # still tied
    ids = torch.tensor([[1, 2, 3, 4]], device=model.device)
    with torch.no_grad():  # the same weights, multiplied by another kernel: equal up to float32 rounding
        torch.testing.assert_close(plain(ids), model(ids), rtol=1e-4, atol=2e-3)


def test_a_failed_compile_falls_back_or_raises(tiny_dt, monkeypatch):
    def fail(self, cache):
        raise torch._dynamo.exc.BackendCompilerFailed(lambda *a: None, RuntimeError("C++ compile error: boom"), None)

    monkeypatch.setattr(compiled.CompiledDecoder, "compile", fail)
    monkeypatch.setattr(compiled, "compile_unavailable", lambda device: None)
    tok = tiny_tokenizer(tiny_dt.cfg.vocab_size)
    with pytest.warns(RuntimeWarning, match="torch.compile failed.*boom.*runs eagerly"):
        engine = Engine(tiny_dt, tok, EngineConfig(num_blocks=32, compile=CompileConfig()))
    assert engine.runner.compiled is None and _run(engine, [[1, 2, 3]], [3])
    with pytest.raises(ValueError, match="torch.compile failed.*fallback=True"):
        Engine(tiny_dt, tok, EngineConfig(num_blocks=32, compile=CompileConfig(fallback=False)))


# --- attention as an opaque operator, given everything it reads and writes ------------------

def _decode_batch(cache, lengths: list[int], first_block: int = 1):
    """One decode step of sequences of ``lengths`` keys (after it), their blocks laid out from ``first_block``."""
    from enginelib.core.batch import Batch, SequenceWork

    per_seq = [-(-n // cache.block_size) for n in lengths]
    starts = [first_block + sum(per_seq[:i]) for i in range(len(lengths))]
    seqs = [SequenceWork([(7 * n) % 50 + 1], n - 1, list(range(s, s + b)))
            for n, s, b in zip(lengths, starts, per_seq)]
    return Batch.build(seqs, cache.block_size, "cpu")


def _random_cache(cfg, seed: int):
    from enginelib.core.paged_cache import PagedKVCache

    cache = PagedKVCache(cfg, num_blocks=32, block_size=4)
    generator = torch.Generator().manual_seed(seed)
    cache.k.copy_(torch.randn(cache.k.shape, generator=generator))
    cache.v.copy_(torch.randn(cache.v.shape, generator=generator))
    return cache


def test_the_opaque_operator_attends_as_the_engine_does(tiny):
    """``paged_attend`` gets the pools, slots, padded tables, mask and sizes as inputs: it writes the real
    rows' K/V where the eager cache writes them and returns the eager cache's attention, padding rows zero."""
    cfg = tiny.cfg
    eager, given = _random_cache(cfg, 0), _random_cache(cfg, 0)
    batch = _decode_batch(eager, [5, 9, 2])
    n, p, width = batch.num_tokens, 4, 8  # one padding row; tables padded to 8 blocks
    generator = torch.Generator().manual_seed(1)
    q = torch.randn(1, p, cfg.num_heads, cfg.head_dim, generator=generator)
    k, v = (torch.randn(1, p, cfg.num_kv_heads, cfg.head_dim, generator=generator) for _ in range(2))
    tables = batch.block_tables.new_zeros(p, width)
    tables[:n, :batch.block_tables.shape[1]] = batch.block_tables
    positions = torch.nn.functional.pad(batch.positions, (0, p - n))
    mask = compiled.row_mask(positions, width * given.block_size, cfg.num_heads // cfg.num_kv_heads, given.k.dtype)
    sizes = torch.tensor([n, batch.block_tables.shape[1]])
    for layer in range(cfg.num_layers):
        expected = eager.bind(batch).attend(layer, q[:, :n], k[:, :n], v[:, :n])
        got = torch.ops.enginelib.paged_attend(q, k, v, given.k[layer], given.v[layer],
                                               torch.nn.functional.pad(batch.slot_mapping, (0, p - n)),
                                               tables, mask, sizes)
        assert torch.equal(got[:, :n], expected) and not got[:, n:].any()
    assert torch.equal(given.k, eager.k) and torch.equal(given.v, eager.v)  # the same slots written, nothing else


@needs_compiler
def test_the_opaque_operator_path_gives_the_eager_tokens(tiny):
    """The GPU's path (the opaque operator, tables padded to one width per bucket), run on a CPU in float32
    (where greedy tokens are exact): padding rows, bucket changes and speculation's verification rows give
    the eager engine's tokens."""
    tok = tiny_tokenizer(tiny.cfg.vocab_size)
    prompts = [[3, 4, 5, 3, 4, 5, 3, 4], [9, 8, 7, 6], [5, 6, 5, 6, 5]]
    spec = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1)
    engine = Engine(tiny, tok, EngineConfig(num_blocks=64, speculative=spec))
    decoder = compiled.CompiledDecoder(tiny, CompileConfig(batch_sizes=(2, 4, 8)), fused_attention=False)
    engine.runner.compiled, engine.runner.compile_report = decoder, decoder.compile(engine.runner.cache)
    got = _run(engine, prompts, [10, 12, 9])
    assert got == _run(Engine(tiny, tok, EngineConfig(num_blocks=64)), prompts, [10, 12, 9])
    assert engine.runner.spec_stats.accepted > 0 and len(decoder.calls) > 1  # more than one bucket ran
    assert all(decoder.direct.get(b) is not None for b in decoder.calls)  # called directly once traced


@needs_compiler
def test_two_decoders_in_two_threads_share_no_state(tiny):
    """Nothing is bound between calls: two compiled decoders over two caches, stepping at the same time in
    two threads, each get the eager attention over their own cache; and the module keeps no mutable state."""
    import threading

    mutable = {name for name, value in vars(compiled).items()
               if not name.startswith("__") and isinstance(value, (dict, list, set, bytearray, threading.local))}
    assert not mutable and not hasattr(compiled, "bound")
    config = CompileConfig(batch_sizes=(4,))
    caches = [_random_cache(tiny.cfg, seed) for seed in (0, 1)]
    batches = [_decode_batch(caches[0], [5, 9, 2]), _decode_batch(caches[1], [13, 3, 7, 6])]
    expected = []
    for seed, batch in enumerate(batches):  # eager attention, on a fresh copy of each cache
        with torch.inference_mode():
            expected.append(tiny(batch.token_ids, _random_cache(tiny.cfg, seed).bind(batch), positions=batch.positions)[0])
    decoders = [compiled.CompiledDecoder(tiny, config, fused_attention=False) for _ in caches]
    for decoder, cache in zip(decoders, caches):
        decoder.compile(cache)  # writes only block 0 (the batches' blocks start at 1), then clears it
    start, results = threading.Barrier(2), [[], []]

    def steps(i: int) -> None:
        start.wait()
        for _ in range(20):
            results[i].append(decoders[i](batches[i], caches[i]))

    threads = [threading.Thread(target=steps, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in range(2):
        assert len(results[i]) == 20 and decoders[i].calls[4] == 20
        for logits in results[i]:  # the same step again and again: its own K/V rewritten in its own cache
            torch.testing.assert_close(logits, expected[i], rtol=1e-5, atol=1e-5)
