"""The Triton kernels (issue 27): paged decode attention and int8/int4 weight-only matmuls.

On a CPU they run under Triton's interpreter (numpy, slowly: tiny shapes here), the only place CI runs
them; with ``ENGINELIB_TEST_DEVICE=cuda`` the same tests compile and run them on the GPU (.ci/gpu_check.sh).
Without Triton installed the module is skipped, saying so.

The interpreter needs TRITON_INTERPRET=1 from before Triton is first imported (``triton.language``'s own
helpers are decorated then) until the kernels have run, and a pytest session has usually imported Triton
long before this file (torch.compile does, even on a CPU). So on a CPU one test here reruns this file in a
fresh process with TRITON_INTERPRET=1 (``test_the_kernels_under_the_interpreter``), and the others run only
there: the rest of the session never sees the variable. ``TRITON_INTERPRET=1 pytest tests/test_triton.py``
runs them directly.
"""
from __future__ import annotations

import functools
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from enginelib.core.batch import Batch, SequenceWork
from enginelib.core.paged_cache import PagedKVCache
from enginelib.model import ModelConfig

from .conftest import DEVICE, tiny_tokenizer

pytest.importorskip("triton", reason="Triton is not installed (pip install triton): its kernels are not checked")

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"  # this process runs kernels in the interpreter
LAUNCHER = DEVICE.type == "cpu" and not INTERPRETED            # this process only starts the one that does


def _fix_interpreter_loop_bounds() -> None:
    """Triton's interpreter before 3.9 turns a tensor into a loop bound with ``int(array)``, which numpy 2.3+
    refuses for its one-element arrays ("only 0-dimensional arrays can be converted"): every ``range`` over a
    kernel argument fails. Triton 3.9 squeezes first; this does the same for older ones (interpreter only)."""
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor
    if getattr(original, "enginelib_fixed", False):
        return

    def patch(tensor, scope) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    patch.enginelib_fixed = True
    interpreter._patch_lang_tensor = patch


if INTERPRETED:
    _fix_interpreter_loop_bounds()

from enginelib.speed import triton_kernels as tk  # noqa: E402 - after the interpreter's fix


@pytest.fixture(autouse=True)
def _where_kernels_run(request):
    """In the launching process (a CPU without TRITON_INTERPRET) only the launcher runs."""
    if LAUNCHER and request.function.__name__ != "test_the_kernels_under_the_interpreter":
        pytest.skip("runs under Triton's interpreter in a fresh process: test_the_kernels_under_the_interpreter")


@pytest.mark.skipif(not LAUNCHER, reason="this process runs the kernels itself")
def test_the_kernels_under_the_interpreter():
    """Every other test of this file, in a fresh process with TRITON_INTERPRET=1 (see the module's docstring)."""
    root = Path(__file__).resolve().parents[1]
    command = [sys.executable, "-m", "pytest", "-q", "-rfEs", "-o", "addopts=", "-p", "no:cacheprovider",
               "-k", "not test_the_kernels_under_the_interpreter", str(Path(__file__).relative_to(root))]
    run = subprocess.run(command, cwd=root, capture_output=True, text=True, timeout=900, check=False,
                         env={**os.environ, "TRITON_INTERPRET": "1"})
    summary = run.stdout.strip().splitlines()[-1] if run.stdout.strip() else "(no output)"
    print(f"under Triton's interpreter: {summary}")
    assert run.returncode == 0, run.stdout[-8000:] + run.stderr[-2000:]
    assert re.fullmatch(r"\d+ passed, 1 deselected in .*", summary), run.stdout[-4000:]  # none skipped or failed


GROUP_SHAPES = [(96, 256), (40, 96)]  # (N, K): output tiles and K steps with ragged ends (int4: 8 and 3 groups)


def _tolerance(dtype: torch.dtype) -> dict[str, float]:
    return {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 1e-2, "atol": 1e-2}


# ---------------------------------------------------------------- paged decode attention

@pytest.mark.parametrize("parts", [1, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_decode_attention_equals_gather_and_sdpa_through_the_cache(dtype, parts):
    """A decode step of sequences holding 1, block_size, 37 and 250 keys: the cache with the Triton kernel
    gives the gather + SDPA path's attention (paged_cache.paged_attention), and the same pools after; in one
    program per sequence and KV head, or with each sequence's 16 table columns split in 4 shares (some empty)."""
    block_size, kv, heads, dim = 16, 3, 9, 64  # SmolLM2-135M's heads: 3 KV heads, 3 query heads each
    cfg = ModelConfig.tiny(num_heads=heads, num_kv_heads=kv, head_dim=dim, num_layers=1)
    lengths = [1, block_size, 37, 250]
    g = torch.Generator().manual_seed(0)
    free = torch.randperm(64, generator=g).tolist()  # blocks scattered through the pool
    seqs = []
    for n in lengths:
        table = [free.pop() for _ in range(-(-n // block_size))]
        seqs.append(SequenceWork([1], n - 1, table))
    batch = Batch.build(seqs, block_size, DEVICE)
    caches = [PagedKVCache(cfg, 64, block_size, device=DEVICE, dtype=dtype, decode_kernel=kernel)
              for kernel in (None, functools.partial(tk.decode_attention, parts=parts))]
    old = torch.randn(caches[0].k.shape, generator=g).to(DEVICE, dtype)  # the keys cached before this step
    for cache in caches:
        cache.k.copy_(old)
        cache.v.copy_(old.flip(-1))
    q = torch.randn(1, len(seqs), heads, dim, generator=g).to(DEVICE, dtype)
    k, v = (torch.randn(1, len(seqs), kv, dim, generator=g).to(DEVICE, dtype) for _ in range(2))
    want, got = (cache.bind(batch).attend(0, q, k, v) for cache in caches)
    assert caches[1]._fused and not caches[0]._fused
    torch.testing.assert_close(got, want, **_tolerance(dtype))
    assert torch.equal(caches[1].k, caches[0].k) and torch.equal(caches[1].v, caches[0].v)


def test_decode_attention_writes_the_new_keys_and_leaves_padding_rows_alone():
    """The C++ kernel's contract: the new K/V land at each sequence's last position, a row with no keys
    (a compiled step's padding) writes nothing and gives zeros; int32 tables work as int64 ones."""
    g = torch.Generator().manual_seed(5)
    num_blocks, block_size, kv, h, d = 12, 4, 3, 9, 48  # a head size that is not a power of two
    k_pool, v_pool = (torch.randn(num_blocks, block_size, kv, d, generator=g).to(DEVICE) for _ in range(2))
    tables = torch.tensor([[7, 2, 9, 0], [3, 11, 0, 0], [5, 0, 0, 0]], device=DEVICE)
    lens = torch.tensor([14, 0, 1], device=DEVICE)
    q, k, v = (torch.randn(3, n, d, generator=g).to(DEVICE) for n in (h, kv, kv))
    before = k_pool.clone()
    got = tk.decode_attention(q, k, v, k_pool, v_pool, tables.int(), lens.int())
    for s in (0, 2):
        slots = (tables[s][:, None] * block_size + torch.arange(block_size, device=DEVICE)).flatten()[:lens[s]]
        assert torch.equal(k_pool.flatten(0, 1)[slots[-1]], k[s]) and torch.equal(v_pool.flatten(0, 1)[slots[-1]], v[s])
        keys, values = (pool.flatten(0, 1)[slots].repeat_interleave(h // kv, dim=1) for pool in (k_pool, v_pool))
        weights = torch.softmax(torch.einsum("hd,thd->ht", q[s], keys) / d ** 0.5, dim=-1)
        torch.testing.assert_close(got[s], torch.einsum("ht,thd->hd", weights, values), rtol=1e-5, atol=1e-5)
    assert torch.equal(got[1], torch.zeros(h, d, device=DEVICE))
    assert (k_pool != before).flatten(2).any(-1).sum() == 2  # two rows wrote one slot each, the padding none
    split = tk.decode_attention(q, k, v, k_pool, v_pool, tables, lens, parts=2)  # shares merged: the same
    torch.testing.assert_close(split, got, rtol=1e-5, atol=1e-5)
    assert torch.equal(split[1], got[1])
    with pytest.raises(ValueError, match="share one dtype"):
        tk.decode_attention(q.half(), k, v, k_pool, v_pool, tables, lens)


def test_a_few_long_sequences_are_split_so_every_multiprocessor_works(monkeypatch):
    """flash-decoding's split, sized for an H200's 132 multiprocessors: 1 sequence x 3 KV heads gets 32 shares
    of 4 blocks (never under 4 blocks a share), 32 sequences 3 shares, and 100 sequences need none."""
    monkeypatch.setattr(tk, "_multiprocessors", lambda device: 132)
    gpu = torch.device("cuda")
    assert tk.partitions(1, 3, 128, gpu) == 32 and tk.partitions(1, 3, 6, gpu) == 1
    assert tk.partitions(32, 3, 128, gpu) == 3 and tk.partitions(100, 3, 128, gpu) == 1
    assert tk.partitions(1, 1, 4096, gpu) == tk.MAX_PARTS


def test_an_engine_attending_in_triton_gives_the_default_engines_tokens(tiny_dt):
    """The whole path: the tiny model's engine with its cache's decode kernel set to Triton's (on a CPU the
    runner would pick the C++ one; here it is set by hand) generates the default engine's greedy tokens."""
    from enginelib.config import EngineConfig, SamplingParams
    from enginelib.core.engine import Engine

    model = tiny_dt.float()
    tok = tiny_tokenizer(model.cfg.vocab_size)
    prompts = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28]]
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)

    def run(fused: bool) -> list[list[int]]:
        engine = Engine(model, tok, EngineConfig(num_blocks=32, block_size=4))
        if fused:
            engine.runner.cache.decode_kernel = tk.decode_attention
        ids = [engine.add_request(p, greedy) for p in prompts]
        while engine.has_unfinished_requests():
            engine.step()
        return [engine.request(i).output_token_ids for i in ids]

    assert run(True) == run(False)


def test_a_compiled_step_calls_the_triton_kernel_from_its_graph(tiny_dt):
    """The GPU's whole-step graph (issue 41), on a CPU under the interpreter: the compiled decode step holds the
    Triton kernel as an operator of its graph (it writes the pools; tables and context lengths are inputs, padded
    to a bucket), its path is recorded as such, and the engine's greedy tokens equal the eager engine's."""
    from enginelib.config import CompileConfig, EngineConfig, SamplingParams
    from enginelib.core.engine import Engine
    from enginelib.speed import compiled, paths

    model = tiny_dt.float()
    tok = tiny_tokenizer(model.cfg.vocab_size)
    prompts = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28]]
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)

    def run(decoder: compiled.CompiledDecoder | None) -> list[list[int]]:
        engine = Engine(model, tok, EngineConfig(num_blocks=32, block_size=4))
        engine.runner.compiled = decoder
        ids = [engine.add_request(p, greedy) for p in prompts]
        while engine.has_unfinished_requests():
            engine.step()
        return [engine.request(i).output_token_ids for i in ids]

    decoder = compiled.CompiledDecoder(model, CompileConfig(batch_sizes=(2, 4), cpp_wrapper=False),
                                       fused_attention="triton")
    assert decoder.kernel == "triton" and decoder.fused_attention
    assert run(decoder) == run(None)
    assert sum(decoder.calls.values()) >= 5, decoder.calls  # the decode steps ran in the graphs
    assert any("our Triton decode kernel" in event.ran for event in paths.events()), paths.events()
    guesses = Batch.build([SequenceWork([1, 2, 3], 5, [4, 7], num_draft=2)], 4)  # rows that read each other's keys
    assert guesses.num_tokens == len(guesses.logits_indices) and not decoder.serves(guesses)  # eager, not raced
    with pytest.raises(ValueError, match="names a kernel"):
        compiled.CompiledDecoder(model, fused_attention="tpu")


def test_the_runner_picks_one_decode_kernel_per_device():
    """One function decides: Triton on CUDA, C++ on a CPU in float32, a ValueError that says why elsewhere."""
    from enginelib.speed.factory import decode_attention_kernel

    if DEVICE.type == "cuda":
        assert decode_attention_kernel(DEVICE, torch.float16) is tk.decode_attention
        assert decode_attention_kernel(DEVICE, torch.float32) is tk.decode_attention
    else:
        refused = "cpu_decode_kernel cannot be used here: the Triton kernels need a CUDA GPU"
        with pytest.raises(ValueError, match=refused):
            decode_attention_kernel("cuda", torch.float16)
    with pytest.raises(ValueError, match="runs on a CPU \\(C\\+\\+\\) or a CUDA GPU \\(Triton\\), not meta"):
        decode_attention_kernel("meta", torch.float32)


def test_a_plain_engine_imports_no_triton():
    """Neither Triton nor our module is loaded by ``import enginelib`` (torch's own triton helpers may be)."""
    code = ("import enginelib, enginelib.core.engine, sys; print(sorted(m for m in sys.modules if m == 'triton' "
            "or m.startswith('triton.') or m == 'enginelib.speed.triton_kernels'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# ---------------------------------------------------------------- weight-only matmuls

@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_the_matmuls_equal_the_reference_kernel(fmt, dtype):
    """quant's ``triton`` kernel against its ``reference`` (dequantize, F.linear) at decode sizes, M = 1 to 33
    rows (33: a second tile of rows), on shapes whose output rows and inputs end inside a tile."""
    from enginelib.speed.quant import KERNELS, quantize_weight

    kernel = KERNELS["triton"]
    g = torch.Generator().manual_seed(1)
    for n, k in GROUP_SHAPES:
        qw = quantize_weight(torch.randn(n, k, generator=g), fmt)
        qw = type(qw)(qw.fmt, *(None if t is None else t.to(DEVICE) for t in (qw.data, qw.scale, qw.minimum)))
        prepared = kernel.prepare(qw)
        for m in (1, 5, 32, 33):
            x = torch.randn(m, k, generator=g).to(DEVICE, dtype)
            want = KERNELS["reference"].run(x.float(), qw).to(dtype)
            got = kernel.run(x, prepared)
            assert got.dtype == dtype and got.shape == (m, n)
            # as test_quant measures its kernels: the error's norm, relative to the result's (float16's output
            # rounding alone is 2^-11 per element; a wrong scale or layout gives errors of order 1)
            rel = ((got.float() - want.float()).norm() / want.float().norm()).item()
            assert rel <= (1e-5 if dtype == torch.float32 else 2e-3), f"{fmt} M={m} [{n}, {k}]: {rel:.2g}"
        back = kernel.unprepare(prepared)
        assert torch.equal(back.data, qw.data)


def test_the_registry_offers_triton_on_cuda_only():
    from enginelib.speed.quant import KERNELS, kernel_unavailable, measure_kernels, quantize_weight

    assert KERNELS["triton"].devices == ("cuda",) and KERNELS["triton"].formats == ("int8", "int4")
    assert "runs on cuda, not cpu" in kernel_unavailable("triton", "int4", (96, 64), torch.device("cpu"))
    if DEVICE.type != "cuda":
        assert "torch sees none" in kernel_unavailable("triton", "int8", (96, 64), torch.device("cuda"))
        return
    assert kernel_unavailable("triton", "int4", (96, 64), DEVICE) is None
    qw = quantize_weight(torch.randn(256, 512), "int4")
    qw = type(qw)(qw.fmt, qw.data.to(DEVICE), qw.scale.to(DEVICE), qw.minimum.to(DEVICE))
    failed: dict[str, str] = {}
    rows = measure_kernels(qw, torch.randn(64, 512, device=DEVICE), failed)
    assert "triton" in {r.kernel for r in rows}, failed  # auto times it, so it is chosen where fastest
    assert next(r for r in rows if r.kernel == "triton").rel_error < 1e-5


def test_unavailable_says_where_they_run():
    if tk.interpreting():
        assert tk.unavailable("cpu") is None
    else:
        assert "TRITON_INTERPRET=1" in tk.unavailable("cpu")
    assert "not int8" in tk.unavailable(DEVICE, torch.int8)
    assert "not mps" in tk.unavailable("mps")


def test_without_triton_the_reason_names_the_fix(monkeypatch):
    monkeypatch.setattr(tk, "_MISSING", "Triton is not installed (No module named 'triton'): pip install triton")
    assert "pip install triton" in tk.unavailable("cuda")
    with pytest.raises(RuntimeError, match="pip install triton"):
        tk.int8_linear(torch.randn(1, 32), torch.zeros(8, 32, dtype=torch.int8), torch.ones(8))


def test_x_must_match_the_weight():
    with pytest.raises(ValueError, match="x must be \\[M, 32\\]"):
        tk.int8_linear(torch.randn(2, 16, device=DEVICE), torch.zeros(8, 32, dtype=torch.int8, device=DEVICE),
                       torch.ones(8, device=DEVICE))
