"""The record of which path ran (enginelib/speed/paths.py): every fallback from a requested path is seen, and
under ``ENGINELIB_STRICT_PATHS=1`` one from a path asked for by name raises. Fallbacks are forced here on the
CPU: a quantized kernel that fails, kernels made unavailable, a compile that fails, CUDA graphs inductor skipped."""
from __future__ import annotations

import json

import pytest
import torch

import enginelib.env as env
from enginelib.config import CompileConfig
from enginelib.core.paged_cache import PagedKVCache
from enginelib.speed import compiled, cpu_kernels, paths
from enginelib.speed.quant import kernels, quant_info, quantize

from .conftest import DEVICE, TINY_ON_CPU, tiny_device


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    """Each test starts with no events, no log file and strict mode off."""
    monkeypatch.delenv(env.STRICT_PATHS, raising=False)
    monkeypatch.delenv(env.PATHS_LOG, raising=False)
    paths.clear()
    yield
    paths.clear()


def test_events_are_recorded_once_tagged_with_their_section_and_logged_to_the_file(tmp_path, monkeypatch):
    log = tmp_path / "paths.jsonl"
    monkeypatch.setenv(env.PATHS_LOG, str(log))
    for _ in range(3):  # a kernel called every layer of every step: one event
        paths.ran("decode attention", "triton")
    with paths.section("systems"):
        paths.fell_back("quant kernel int4 64x64", "auto (with triton)", "auto without it", "it failed", explicit=False)
        paths.ran("decode attention", "triton")  # the same path in another section is another event
    assert [(e.what, e.section, e.fallback) for e in paths.events()] == [
        ("decode attention", "", False), ("quant kernel int4 64x64", "systems", True),
        ("decode attention", "systems", False)]
    assert paths.fallbacks() == [paths.events()[1]] and paths.fallbacks()[0].why == "it failed"
    assert len(log.read_text().splitlines()) == 3 and json.loads(log.read_text().splitlines()[1])["fallback"] is True
    log.write_text(log.read_text() * 2)  # two processes that recorded the same events: read back once
    assert paths.read_log(log) == paths.events()
    assert paths.read_log(tmp_path / "absent.jsonl") == []


@pytest.mark.parametrize("value, raises", [("1", True), ("true", True), ("0", False), ("", False)])
def test_strict_mode_raises_on_a_fallback_from_a_path_asked_for_by_name_only(monkeypatch, value, raises):
    monkeypatch.setenv(env.STRICT_PATHS, value)
    paths.fell_back("quant kernel int8 8x8", "auto (with cpp)", "auto without it", "no compiler", explicit=False)
    if raises:
        with pytest.raises(paths.FallbackError, match="compiled decode: asked for torch.compile .* no Triton"):
            paths.fell_back("compiled decode", "torch.compile (mode=default)", "eager", "no Triton")
    else:
        paths.fell_back("compiled decode", "torch.compile (mode=default)", "eager", "no Triton")
    assert [e.what for e in paths.fallbacks()] == ["quant kernel int8 8x8", "compiled decode"]  # recorded either way


def test_auto_records_the_kernels_it_left_out_and_the_one_it_chose(tiny, monkeypatch):
    """A candidate that raises (a Triton kernel a GPU's compiler refuses) and kernels that cannot run here (our
    C++ ones, made unavailable) are fallbacks of ``auto``: recorded, warned about as before, never raised (auto
    was not asked for them by name), and the chosen kernel is recorded as what ran."""
    def broken(x: torch.Tensor, prepared: object) -> torch.Tensor:
        raise RuntimeError("this GPU's compiler refused the kernel")

    monkeypatch.setitem(kernels.KERNELS, "broken", kernels.Kernel("broken", ("int8",), ("cpu", "cuda"), lambda qw: qw,
                                                                  broken, lambda p: p))
    monkeypatch.setattr(cpu_kernels, "unavailable", lambda *args: "forced: no C++ kernels here")
    monkeypatch.setenv(env.STRICT_PATHS, "1")
    with pytest.warns(RuntimeWarning, match="kernel 'broken' left out"):
        q = quantize(tiny, "int8")
    info = quant_info(q)
    left_out = {(e.what, e.requested): e.why for e in paths.fallbacks()}
    for (fmt, (n, k)), chosen in info.kernels.items():
        what = f"quant kernel {fmt} {n}x{k}"
        assert "RuntimeError: this GPU's compiler refused the kernel" in left_out[(what, "auto (with broken)")]
        if tiny.device.type == "cpu":  # our C++ kernels are candidates on a CPU only
            assert left_out[(what, "auto (with cpp)")] == left_out[(what, "auto (with cpp_q8)")] == (
                "forced: no C++ kernels here")
        assert paths.PathEvent(what, "auto", chosen) in paths.events()
    assert all(e.ran == "auto without it" for e in paths.fallbacks())


def test_a_kernel_asked_for_by_name_records_what_ran_and_no_fallback(tiny):
    q = quantize(tiny, "int4", "reference")
    assert not paths.fallbacks()
    assert {e.what for e in paths.events()} == {f"quant kernel int4 {n}x{k}" for _, (n, k) in quant_info(q).kernels}
    assert {(e.requested, e.ran) for e in paths.events()} == {("reference", "reference")}


def _decoder(tiny, monkeypatch, mode: str | None = None) -> tuple[compiled.CompiledDecoder, PagedKVCache]:
    """A compiled decoder on the opaque operator's path (no C++ kernels needed), not yet traced."""
    monkeypatch.setattr(compiled, "compile_unavailable", lambda device: None)  # whether or not a compiler is here
    decoder = compiled.CompiledDecoder(tiny, CompileConfig(batch_sizes=(1,), mode=mode), fused_attention=False)
    return decoder, PagedKVCache(tiny.cfg, 8, 16, device=tiny.device, dtype=tiny.dtype)


def test_a_compile_that_fails_is_recorded_before_the_caller_runs_eagerly_and_strict_raises(tiny, monkeypatch):
    """Chapter 14 catches a failed compile and runs eagerly: the failure is in the record all the same; strict,
    it raises a FallbackError (which the runner's ``except BackendCompilerFailed`` does not swallow)."""
    decoder, cache = _decoder(tiny, monkeypatch)

    def refused(*args: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("inductor refused the graph")

    monkeypatch.setattr(decoder, "_step", refused)
    with pytest.raises(RuntimeError, match="inductor refused"):
        decoder.compile(cache)
    [event] = paths.fallbacks()
    assert (event.what, event.requested) == ("compiled decode", "torch.compile (mode=default)")
    assert event.why == "RuntimeError: inductor refused the graph" and "eager" in event.ran
    paths.clear()
    monkeypatch.setenv(env.STRICT_PATHS, "1")
    with pytest.raises(paths.FallbackError, match="compiled decode: asked for torch.compile") as raised:
        decoder.compile(cache)
    assert isinstance(raised.value.__context__, RuntimeError)  # the compile's own error, chained
    with pytest.raises(paths.FallbackError, match="no Triton here"):  # the runner's eager fallback (its hook)
        compiled.fell_back_to_eager(CompileConfig(mode="reduce-overhead"), "no Triton here")
    assert paths.fallbacks()[-1].requested == "torch.compile (mode=reduce-overhead)"


@pytest.mark.parametrize("skipped_graphs", [0, 1])
def test_a_compiled_step_records_its_path_and_whether_inductor_skipped_its_cuda_graphs(tiny, monkeypatch,
                                                                                      skipped_graphs):
    """The first call of a bucket records the compiled path; with CUDA graphs asked for, inductor's count of
    skipped graphs (it only logs why) decides between "CUDA graphs ran" and a fallback. Faked on the CPU: a
    stand-in for the traced step, and the counter."""
    decoder, cache = _decoder(tiny, monkeypatch, mode="reduce-overhead")
    decoder.cuda_graphs = True  # as on a GPU with mode="reduce-overhead"
    monkeypatch.setattr(decoder, "_step", lambda *args: torch.zeros(1, tiny.cfg.vocab_size, device=tiny.device))
    counts = iter([0, skipped_graphs, 5, 5 + skipped_graphs])  # before and after each first call: +0 or +1 skipped
    monkeypatch.setattr(compiled, "_cudagraph_skips", lambda: next(counts))
    decoder.compile(cache)
    ran = [e for e in paths.events() if e.what == "compiled decode"]
    assert [(e.requested, e.fallback) for e in ran] == [("torch.compile (mode=reduce-overhead)", False)]
    assert "the paged_attend operator" in ran[0].ran
    graphs = [e for e in paths.events() if e.what == "CUDA graphs"]
    assert [e.fallback for e in graphs] == [bool(skipped_graphs)]
    if skipped_graphs:
        monkeypatch.setenv(env.STRICT_PATHS, "1")
        paths.clear()
        with pytest.raises(paths.FallbackError, match="CUDA graphs: asked for mode=reduce-overhead"):
            decoder.compile(cache)


def test_the_draft_compiles_on_a_gpu_without_the_cpus_cpp_kernels(monkeypatch):
    """compile_draft on a GPU runs the engine's opaque attention, so the C++ kernels are asked about on a CPU only:
    a chapter on a T4 compiles its draft instead of leaving it eager."""
    from enginelib.speed import speculative

    class Draft:  # what compile_draft_unavailable reads of a model
        def __init__(self, device: str, dtype: torch.dtype) -> None:
            self.device, self.dtype = torch.device(device), dtype

    monkeypatch.setattr(speculative, "compile_unavailable", lambda device: None)
    monkeypatch.setattr(cpu_kernels, "unavailable", lambda device, dtype=None: "no AVX2 here")
    assert speculative.compile_draft_unavailable(Draft("cuda", torch.float16)) is None
    assert speculative.compile_draft_unavailable(Draft("cpu", torch.float32)) == "no AVX2 here"
    monkeypatch.setattr(speculative, "compile_unavailable", lambda device: "no Triton")
    assert speculative.compile_draft_unavailable(Draft("cuda", torch.float16)) == "no Triton"


def test_the_tiny_fixture_goes_to_the_test_device_except_where_it_must_stay_on_the_cpu(tiny):
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert tiny_device("test_paged", cuda) == cuda and tiny_device("test_speculative", cuda) == cuda
    assert all(tiny_device(module, cuda) == cpu for module in TINY_ON_CPU)
    assert tiny.device.type == DEVICE.type and tiny.dtype == torch.float32  # this module is not one of them
