"""Our C++ int8/int4 kernels (enginelib/speed/cpu_kernels.py): equal to the plain-PyTorch reference up to float32
rounding on every tile shape, in the AVX2 path and the plain fallback, inside torch.compile; asking whether they
can run builds nothing, a CPU without AVX2 gets one sentence everywhere, and when they cannot be built the reason
names the fix."""
from __future__ import annotations

import os
import re
import shutil
import subprocess

import pytest
import torch

from enginelib.speed import cpu_kernels
from enginelib.speed.quant import KERNELS, QuantLinear, kernel_unavailable, quant_info, quantize, quantize_weight

CPU = torch.device("cpu")
# The first kernel call builds them (once per source, compiler, Python and torch, then cached on disk). On CI
# ($CI set) a missing compiler or ninja fails the tests.
pytestmark = pytest.mark.skipif(cpu_kernels.unavailable() is not None and not os.environ.get("CI"),
                                reason=f"the C++ kernels cannot be built here: {cpu_kernels.unavailable()}")

# Float32 in another order than F.linear: relative errors of order 1e-7; a wrong code, nibble or scale is ~1.
TOL = 1e-5


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).norm() / want.norm()).item()


def weight(n: int, k: int, seed: int) -> torch.Tensor:
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05
    w[1, :32] += 0.4  # a group far from zero: the int4 minimum must carry it
    return w


def run(fmt: str, x: torch.Tensor, w: torch.Tensor, simd: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(cpp's output, the reference's) for ``x`` times ``w`` stored in ``fmt``."""
    qw = quantize_weight(w, fmt)
    want = QuantLinear(qw, None, "reference")(x)
    if fmt == "int8":
        return cpu_kernels.int8_linear(x, qw.data, qw.scale, simd), want
    return cpu_kernels.int4_linear(x, qw.data, qw.scale, qw.minimum, simd), want


# N = 13: not a multiple of the 2- and 4-row tiles; M = 3: a 2-row tile then a 1-row one; M = 32: eight 4-row
# tiles; K = 40 (int8 only): 8-wide vectors plus a scalar tail.
@pytest.mark.parametrize("simd", [True, False], ids=["avx2", "plain"])
@pytest.mark.parametrize("fmt,n,k", [("int8", 13, 64), ("int8", 96, 160), ("int8", 7, 40),
                                     ("int4", 13, 64), ("int4", 96, 160)])
def test_kernels_equal_the_reference(fmt, n, k, simd):
    w = weight(n, k, seed=n + k)
    for m in (1, 3, 32):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
        got, want = run(fmt, x, w, simd)
        assert got.shape == (m, n) and got.dtype == torch.float32
        assert rel(got, want) < TOL, f"{fmt} {n}x{k}, M={m}, simd={simd}: error {rel(got, want):.2g}"


def rounded(x: torch.Tensor) -> torch.Tensor:
    """``x`` as the q8 kernels see it: each group of 32 rounded to int8 steps of (its largest |x|) / 127."""
    g = x.view(x.shape[0], -1, 32)
    d = g.abs().amax(dim=-1, keepdim=True) / 127
    return ((g * (1 / d)).round() * d).view_as(x)


# The q8 kernels' tiles: one block of 4 output rows by 2 activation rows, then 1 (M = 3); N = 13 ends in a
# block with one real row. K = 160: five groups of 32; K = 576, the model's: eighteen
def q8_args(fmt: str, n: int, k: int):
    """A random weight in the q8 kernels' layout: rows in blocks of 4 (13 rows: the last block has one)."""
    qw = quantize_weight(weight(n, k, seed=n), fmt)
    kernel = cpu_kernels.int4q8_linear if fmt == "int4" else cpu_kernels.int8q8_linear
    if fmt != "int4":
        scale = cpu_kernels.interleave(qw.scale) if fmt == "q8_0" else qw.scale  # q8_0: a scale per group
        return qw, kernel, (cpu_kernels.interleave(qw.data.reshape(n, k // 32, 32)), scale, n)
    return qw, kernel, (*(cpu_kernels.interleave(t) for t in (qw.data, qw.scale, qw.minimum)), n)


def built_q8_path(path: str) -> str:
    """``path`` where this CPU's build has it; else the test is skipped, saying which CPU feature it needs."""
    why = cpu_kernels.unavailable()
    if why is None and path not in cpu_kernels.q8_paths():
        why = "it lacks the instructions: avx2_vnni needs AVX-VNNI or AVX-512 VNNI, avx512_vnni AVX-512 BW and VNNI"
    if why:
        pytest.skip(f"the q8 path {path!r} is not built on this CPU ({why})")
    return path


@pytest.mark.parametrize("path", cpu_kernels.Q8_PATHS)
@pytest.mark.parametrize("k", [160, 576])
@pytest.mark.parametrize("fmt", ["int8", "int4", "q8_0"])
def test_q8_kernels_multiply_the_rounded_activations_exactly(fmt, k, path):
    """cpp_q8 = (x rounded per group of 32) times the stored weight, up to float32 rounding, on every path
    this CPU builds: the only error is the activations' rounding, about 0.5%; and a row gets the same bits
    alone or in a batch."""
    path = built_q8_path(path)
    for n in (13, 96):
        qw, kernel, args = q8_args(fmt, n, k)
        for m in (1, 3, 32):
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
            got = kernel(x, *args, path=path)
            assert rel(got, torch.nn.functional.linear(rounded(x), qw.dequantize())) < TOL
            assert 1e-3 < rel(got, torch.nn.functional.linear(x, qw.dequantize())) < 1e-2
            assert torch.equal(kernel(x[-1:], *args, path=path)[0], got[-1])


@pytest.mark.parametrize("path", cpu_kernels.Q8_PATHS[1:])
def test_simd_rounding_of_x_gives_the_plain_loops_codes(path):
    """Every SIMD path rounds x to int8 with vector instructions, the plain path in a loop: the same codes and
    scales. A one-hot weight (row n: code 1 at input n, scale 1) reads each code times its group's scale out
    exactly, on groups that are all zero, negative, tiny, and on values halfway between two steps."""
    path = built_q8_path(path)
    k = 96
    x = torch.randn(4, k, generator=torch.Generator().manual_seed(0))
    x[1, :32] = 0  # a group with no scale
    x[2] = -x[2].abs() * 1e-30
    x[3, :32] = torch.arange(32) - 16.5  # halves, and amax 127: a scale of 1 keeps them halves (ties to even)
    x[3, 31] = 127
    eye = cpu_kernels.interleave(torch.eye(k, dtype=torch.int8).reshape(k, k // 32, 32))
    args = (eye, torch.ones(k), k)
    assert torch.equal(cpu_kernels.int8q8_linear(x, *args, path=path),
                       cpu_kernels.int8q8_linear(x, *args, path="plain"))


@pytest.mark.parametrize("fmt", ["int8", "int4", "q8_0"])
def test_vnni_at_256_bits_gives_avx2s_bits(fmt):
    """vpdpbusd sums the same byte products into the same int32 as maddubs + madd (no int16 saturates: |w|, |x|
    <= 128 and 127), and the float sums run in the same order: the same bits, so the same tokens."""
    built_q8_path("avx2_vnni")
    _, kernel, args = q8_args(fmt, 96, 576)
    x = torch.randn(5, 576, generator=torch.Generator().manual_seed(5))
    assert torch.equal(kernel(x, *args, path="avx2_vnni"), kernel(x, *args, path="avx2"))


def test_the_fastest_built_path_is_the_default_and_a_missing_one_is_named():
    built_q8_path("avx2")
    _, kernel, args = q8_args("int4", 13, 160)
    x = torch.randn(2, 160, generator=torch.Generator().manual_seed(2))
    assert torch.equal(kernel(x, *args), kernel(x, *args, path=cpu_kernels.q8_paths()[-1]))
    with pytest.raises(RuntimeError, match="path .avx9. is not built on this CPU"):
        kernel(x, *args, path="avx9")


def test_the_simd_path_is_built_where_the_cpu_has_avx2():
    flags = cpu_kernels._cpu_flags().split()
    if "avx2" in flags and "fma" in flags:
        assert cpu_kernels.has_simd()


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_lm_head_shape(fmt):
    """The biggest weight (49152 x 576), split among threads, with a batch that uses every tile height."""
    w = weight(49152, 576, seed=7)
    x = torch.randn(7, 576, generator=torch.Generator().manual_seed(8))
    got, want = run(fmt, x, w, simd=True)
    assert rel(got, want) < TOL
    # each output adds its products in the same order whatever tile it falls in: a row alone, same bits
    layer = QuantLinear(quantize_weight(w, fmt), None, "cpp")
    for row in (0, 4, 6):  # in a 4-row, a 2-row and a 1-row tile
        assert torch.equal(layer(x[row:row + 1])[0], got[row])


def test_bad_shapes_raise():
    q = quantize_weight(weight(8, 64, seed=1), "int8")
    with pytest.raises(RuntimeError, match="x has 32 columns, the weight 64"):
        cpu_kernels.int8_linear(torch.randn(2, 32), q.data, q.scale)


def test_quantized_model_compiles_and_gives_the_same_logits(tiny):
    """int4 layers and an int8 head, both ops traced by torch.compile (inductor) as opaque custom ops."""
    model = quantize(tiny, "int4", "cpp", head="int8")
    assert {layer.kernel.name for layer in model.modules() if isinstance(layer, QuantLinear)} == {"cpp"}
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    with torch.inference_mode():
        eager = model(ids)
        want = quantize(tiny, "int4", "reference", head="int8")(ids)
        compiled = torch.compile(model)(ids)
    assert rel(eager, want) < TOL
    assert rel(compiled, eager) < TOL


def test_unavailable_names_the_fix_and_auto_skips_it(tiny, monkeypatch, tmp_path):
    real_which = shutil.which
    monkeypatch.setattr(cpu_kernels.shutil, "which", lambda tool: None if tool == cpu_kernels.compiler() else
                        real_which(tool))
    reason = kernel_unavailable("cpp", "int8", (96, 64), CPU)
    assert "no C++ compiler" in reason and "apt-get install g++" in reason and "xcode-select --install" in reason
    with pytest.raises(ValueError, match="no C\\+\\+ compiler.*use kernel='auto' or 'reference'"):
        quantize(tiny, "int8", "cpp")
    auto = quantize(tiny, "int8")
    assert "cpp" not in {row.kernel for row in quant_info(auto).timings}
    assert "apt-get install g++" in quant_info(auto).skipped["cpp"]  # auto says why it ran without it
    assert "runs on cpu, not cuda" in kernel_unavailable("cpp", "int8", (96, 64), torch.device("cuda"))


def test_a_failed_build_raises_with_the_compilers_words(monkeypatch, tmp_path):
    """The build happens at the first kernel call (or layer made); a failure raises there, with the compiler's
    last lines. Asking whether the kernel runs here never builds; quant's ``auto``, which builds before it
    times (``Kernel.ready``), gives the same words as its reason."""
    monkeypatch.setenv("ENGINELIB_CACHE", str(tmp_path / "cache"))
    broken = tmp_path / "csrc"
    shutil.copytree(cpu_kernels.CSRC, broken)
    # (a missing header stops the compiler at once; an #error would let it read all of torch's headers first)
    source = broken / cpu_kernels.SOURCES[0]
    source.write_text('#include "enginelib_test_broken_build.h"\n' + source.read_text())
    monkeypatch.setattr(cpu_kernels, "CSRC", broken)
    cpu_kernels._load.cache_clear()  # the real build stays loaded; the next load() finds it again
    q = quantize_weight(weight(8, 64, seed=1), "int8")
    failed = "(?s)building enginelib's CPU kernels failed.*enginelib_test_broken_build.h"
    with pytest.raises(RuntimeError, match=failed):
        cpu_kernels.int8_linear(torch.randn(2, 64), q.data, q.scale)
    assert kernel_unavailable("cpp", "int4", (96, 64), CPU) is None  # a yes/no question: it only looks
    with pytest.raises(RuntimeError, match=failed):  # a kernel asked for by name builds as its layer is made
        QuantLinear(q, None, "cpp")
    reason = KERNELS["cpp_q8"].ready(CPU)
    assert "building enginelib's CPU kernels failed" in reason and "enginelib_test_broken_build.h" in reason


def test_asking_whether_they_can_run_never_builds(monkeypatch, tmp_path):
    """unavailable() answers from the device, the dtype, the CPU's flags and $PATH: no compiler runs, no
    build folder appears, even with an empty cache."""
    monkeypatch.setenv("ENGINELIB_CACHE", str(tmp_path))
    cpu_kernels._load.cache_clear()

    def no_process(*args, **kwargs):
        raise AssertionError(f"unavailable() started a process: {args}")

    monkeypatch.setattr(subprocess, "Popen", no_process)
    assert cpu_kernels.unavailable() is None and cpu_kernels.unavailable("cpu", torch.float32) is None
    assert cpu_kernels.unavailable(torch.device("cpu"), torch.bfloat16) == (
        "enginelib's C++ kernels run float32 on a CPU, not bfloat16 on cpu")
    assert cpu_kernels.unavailable("cuda", torch.float32).endswith("not float32 on cuda")
    assert cpu_kernels.unavailable("cuda").endswith("not on cuda")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("machine,flags", [("x86_64", "flags : fpu sse sse2 avx f16c"),  # an AVX (not AVX2) CPU
                                           ("x86_64", "flags : fpu sse2 avx avx2 f16c"),  # AVX2 without FMA
                                           ("aarch64", "Features : fp asimd evtstrm aes crc32")])
def test_a_cpu_without_avx2_gets_the_one_sentence_everywhere(tiny, monkeypatch, machine, flags):
    monkeypatch.setattr(cpu_kernels.platform, "machine", lambda: machine)
    monkeypatch.setattr(cpu_kernels, "_cpu_flags", lambda: flags)
    cpu_kernels._load.cache_clear()
    from enginelib.speed.factory import decode_attention_kernel
    from enginelib.speed.compiled import compile_unavailable
    from enginelib.speed.speculative import compile_draft_unavailable

    assert cpu_kernels.unavailable() == cpu_kernels.unavailable("cpu", torch.float32) == cpu_kernels.NO_AVX2
    one = re.escape(cpu_kernels.NO_AVX2)
    q = quantize_weight(weight(8, 64, seed=1), "int8")
    with pytest.raises(RuntimeError, match=one):
        cpu_kernels.int8_linear(torch.randn(2, 64), q.data, q.scale)
    with pytest.raises(RuntimeError, match=one):
        cpu_kernels.has_simd()
    assert kernel_unavailable("cpp_q8", "int4", (96, 64), CPU) == cpu_kernels.NO_AVX2
    with pytest.raises(ValueError, match=one):
        decode_attention_kernel(tiny.device, tiny.dtype)
    assert compile_draft_unavailable(tiny) == (compile_unavailable(CPU) or cpu_kernels.NO_AVX2)


def test_the_build_key_changes_with_the_compiler_python_and_torch(monkeypatch, tmp_path):
    real = subprocess.run([cpu_kernels.compiler(), "--version"], capture_output=True, text=True, check=True).stdout
    assert cpu_kernels.compiler_version() == real.splitlines()[0]  # e.g. "c++ (Debian 12.2.0-14) 12.2.0"
    monkeypatch.setenv("ENGINELIB_CACHE", str(tmp_path))
    monkeypatch.setattr(cpu_kernels, "compiler_version", lambda: "c++ (Debian 12.2.0-14) 12.2.0")
    monkeypatch.setattr(cpu_kernels, "python_abi", lambda: "cpython-311-x86_64-linux-gnu")
    first = cpu_kernels.build_dir()
    assert first.parent == tmp_path / "kernels" and first == cpu_kernels.build_dir()
    monkeypatch.setattr(cpu_kernels, "compiler_version", lambda: "c++ (Debian 14.2.0-19) 14.2.0")
    second = cpu_kernels.build_dir()
    monkeypatch.setattr(cpu_kernels, "python_abi", lambda: "cpython-312-x86_64-linux-gnu")
    third = cpu_kernels.build_dir()
    assert len({first, second, third}) == 3
    base = (b"source", "g++ 12", "cpython-311", "2.13.0", "flags : avx2 fma")
    changed = {cpu_kernels.build_key(*base[:i], other, *base[i + 1:])
               for i, other in enumerate((b"source2", "g++ 13", "cpython-312", "2.14.0", "flags : avx2"))}
    assert cpu_kernels.build_key(*base) not in changed and len(changed) == 5


def test_compiled_graphs_are_keyed_by_our_operators_build_and_schemas():
    """A graph inductor caches on disk is found again by a key that hashes its options, not our operators'
    code or schemas: compiled's options carry both, so a graph built against another build is not reused."""
    from enginelib.config import CompileConfig
    from enginelib.speed.compiled import _options

    if cpu_kernels.unavailable():
        pytest.skip(cpu_kernels.unavailable())
    keys = _options(CompileConfig(cpp_wrapper=True), torch.device("cpu"))["unsafe_marked_cacheable_functions"]
    assert set(keys) == {f"torch.ops.enginelib.{name}" for name in cpu_kernels.OPERATORS}
    assert len(set(keys.values())) == 1 and next(iter(keys.values())).startswith(cpu_kernels.build_dir().name)
    with torch._inductor.config.patch(unsafe_marked_cacheable_functions=keys):  # the options inductor hashes
        assert torch._inductor.config.save_config_portable()["unsafe_marked_cacheable_functions"] == keys
    schema = "int4q8_linear(Tensor x, Tensor codes, Tensor scale, Tensor minimum, int rows, int path=-1) -> Tensor"
    older = schema.replace("int path=-1", "bool simd=True")  # a schema as it was before
    key = cpu_kernels.graph_cache_key("b", [schema])
    assert key != cpu_kernels.graph_cache_key("b", [older]) and key != cpu_kernels.graph_cache_key("c", [schema])


def test_engine_batch_equals_each_request_alone(real_f32):
    """Bit-identical rows in any batch: the engine's batched greedy tokens are each request's own, exactly."""
    from enginelib.config import SamplingParams

    from .conftest import batched_equals_alone, chat_ids

    model, tok = real_f32
    q = quantize(model, "int4", "cpp", head="int8")
    greedy = SamplingParams(temperature=0, max_tokens=8)
    prompts = [chat_ids(tok, p) for p in ("Name a fruit.", "What is 2 + 2?", "Say hello in French.")]
    batched_equals_alone(q, tok, prompts, greedy)


@pytest.mark.parametrize("simd", [True, False])
def test_decode_attention_writes_the_new_keys_and_reads_through_the_block_tables(simd):
    """The fused decode attention stores each new K/V at its sequence's last position, then equals
    softmax(q K^T / sqrt(D)) V over keys gathered by hand, each KV head shared by H / KV query heads."""
    g = torch.Generator().manual_seed(5)
    num_blocks, block_size, kv, h, d = 12, 4, 3, 9, 64
    k_pool, v_pool = (torch.randn(num_blocks, block_size, kv, d, generator=g) for _ in range(2))
    tables = torch.tensor([[7, 2, 9, 0], [3, 11, 0, 0], [5, 0, 0, 0]])  # padded with block 0, never read
    lens = torch.tensor([14, 6, 1])
    q, k, v = torch.randn(3, h, d, generator=g), torch.randn(3, kv, d, generator=g), torch.randn(3, kv, d, generator=g)
    before = k_pool.clone()
    got = cpu_kernels.decode_attention(q, k, v, k_pool, v_pool, tables, lens, simd)
    for s in range(3):
        slots = (tables[s][:, None] * block_size + torch.arange(block_size)).flatten()[:lens[s]]
        assert torch.equal(k_pool.flatten(0, 1)[slots[-1]], k[s]) and torch.equal(v_pool.flatten(0, 1)[slots[-1]], v[s])
        keys, values = (pool.flatten(0, 1)[slots].repeat_interleave(h // kv, dim=1) for pool in (k_pool, v_pool))
        weights = torch.softmax(torch.einsum("hd,thd->ht", q[s], keys) / d ** 0.5, dim=-1)
        torch.testing.assert_close(got[s], torch.einsum("ht,thd->hd", weights, values), rtol=1e-5, atol=1e-5)
    assert (k_pool != before).flatten(2).any(-1).sum() == 3  # nothing else written
    # a padding row (a compiled step's batch filled up to its bucket): no keys, nothing written, zeros out
    written = k_pool.clone()
    padded = cpu_kernels.decode_attention(q, k, v, k_pool, v_pool, tables, torch.tensor([14, 0, 1]), simd)
    assert torch.equal(padded[1], torch.zeros(h, d)) and torch.equal(padded[0], got[0]) and torch.equal(k_pool, written)
    with pytest.raises(RuntimeError, match="sequence 1 has 17 keys; its table holds 16"):
        cpu_kernels.decode_attention(q, k, v, k_pool, v_pool, tables, torch.tensor([14, 17, 1]))
    with pytest.raises(RuntimeError, match="sequence 1 has -1 keys"):
        cpu_kernels.decode_attention(q, k, v, k_pool, v_pool, tables, torch.tensor([14, -1, 1]))
    with pytest.raises(RuntimeError, match="block 12 is outside the pool of 12"):
        cpu_kernels.decode_attention(q, k, v, k_pool, v_pool, tables.masked_fill(tables == 11, 12), lens)


def test_the_eager_engine_can_attend_with_the_decode_kernel(real_f32, tiny, agree):
    """EngineConfig(cpu_decode_kernel=True): decode steps attend in the C++ kernel, prefills as before; the
    tokens are the default engine's (up to a near tie), no block is leaked, and elsewhere it is refused."""
    from enginelib.config import SamplingParams
    from enginelib.core.engine import Engine, EngineConfig

    from .conftest import chat_ids

    model, tok = real_f32
    if model.device.type != "cpu":
        pytest.skip("the decode kernel is a CPU kernel")
    greedy = SamplingParams(temperature=0, max_tokens=12)
    prompts = [chat_ids(tok, p) for p in ("Name a fruit.", "What is 2 + 2?", "Say hello in French.")]

    def run(config: EngineConfig) -> list[list[int]]:
        engine = Engine(model, tok, config)
        ids = [engine.add_request(p, greedy) for p in prompts]
        while engine.has_unfinished_requests():
            engine.step()
        assert engine.stats().pool.used == 0
        return [engine.request(i).output_token_ids for i in ids]

    fused = EngineConfig(num_blocks=64, cpu_decode_kernel=True)
    agree(model, prompts, run(fused), run(EngineConfig(num_blocks=64)))
    refused = "cpu_decode_kernel cannot be used here: enginelib's C\\+\\+ kernels run float32 on a CPU, not bfloat16"
    with pytest.raises(ValueError, match=refused):
        Engine(tiny.to(torch.bfloat16), tok, fused)
