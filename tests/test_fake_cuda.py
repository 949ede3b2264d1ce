"""The GPU path proven without a GPU: the engine's steps run on fake CUDA tensors, and every host sync is counted.

CI has no GPU, so a bug only a GPU shows (a CPU tensor meeting a CUDA one, a step that stops to wait for the
device) would reach the first reader with a T4. PyTorch's ``FakeTensorMode`` gives tensors a device and a shape
but no data: every operator checks its inputs' devices, as CUDA would (``FakeTensorDeviceMismatchError``), and
computes only its output's shape. Over it, :class:`HostSyncs` counts each point where a GPU step would make the
host wait for the device: device data read on the host (``tolist``, ``item``, ``bool``, ``int``), a copy to the
host, a blocking copy to the device (``torch.tensor(data, device="cuda")``: a pageable copy, then a stream sync),
and operators whose output's shape depends on the data (``nonzero``, boolean indexing, ``masked_select``,
``repeat_interleave`` without ``output_size``). It records where in enginelib each happened and hands back a
stand-in (zeros, an empty result), so the step runs on and every sync of it is counted. A step may wait once:
the ``.tolist()`` of its sampled tokens.

Tracing indexes CUDA tensors from Python, which enters a CUDA device guard, and a CPU-only torch has none (on a
CUDA build without a GPU FakeTensorMode installs torch's no-op one itself): the fixture builds a one-line C++
file that registers that same no-op guard (about a second, with the C++ compiler and ninja the CPU kernels use).
"""
from __future__ import annotations

import copy
import dataclasses
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from enginelib.config import EngineConfig, SamplingParams, SpeculativeConfig
from enginelib.core.batch import Batch, SequenceWork
from enginelib.core.engine import Engine
from enginelib.model import Transformer

from .conftest import tiny_tokenizer

aten = torch.ops.aten
CUDA = torch.device("cuda")
PACKAGE = str(Path(__file__).resolve().parents[1] / "enginelib")

GUARD = """#include <c10/core/impl/DeviceGuardImplInterface.h>
// torch's own no-op device guard for CUDA, which a CPU-only build lacks (tests/test_fake_cuda.py)
C10_REGISTER_GUARD_IMPL(CUDA, c10::impl::NoOpDeviceGuardImpl<c10::DeviceType::CUDA>);
"""


@pytest.fixture(scope="module")
def fake(tmp_path_factory) -> FakeTensorMode:
    """A FakeTensorMode in which tensors can live on ``cuda`` (with a CUDA device guard in this process)."""
    if not torch.backends.cuda.is_built():
        from torch.utils.cpp_extension import is_ninja_available, load

        from enginelib.speed.compiled import compile_unavailable

        reason = compile_unavailable("cpu") or (None if is_ninja_available() else "ninja is not installed")
        if reason:
            pytest.skip(f"the fake CUDA device guard is built with a C++ compiler: {reason}")
        where = tmp_path_factory.mktemp("fake_cuda_guard")
        (where / "guard.cpp").write_text(GUARD)
        load("enginelib_fake_cuda_guard", [str(where / "guard.cpp")], build_directory=str(where),
             is_python_module=False)
    return FakeTensorMode()


# ---------------------------------------------------------------- counting host syncs

@dataclass
class Sync:
    """One point where the host would wait for the GPU."""

    what: str   # the operator or method
    where: str  # the innermost enginelib frame: file:line (function)

    def __str__(self) -> str:
        return f"{self.what} at {self.where}"


def _where() -> str:
    for frame in reversed(traceback.extract_stack()[:-1]):
        if frame.filename.startswith(PACKAGE):
            return f"{frame.filename[len(PACKAGE) - len('enginelib'):]}:{frame.lineno} ({frame.name})"
    return "outside enginelib"


def _on_cuda(*tensors: object) -> bool:
    return any(isinstance(t, torch.Tensor) and t.device.type == "cuda" for t in tensors)


def _zeros(shape: tuple[int, ...], dtype: torch.dtype) -> object:
    """What ``tolist`` of such a tensor gives, filled with zeros (the data a fake tensor does not have)."""
    zero = False if dtype == torch.bool else 0.0 if dtype.is_floating_point else 0
    return zero if not shape else [_zeros(shape[1:], dtype) for _ in range(shape[0])]


_READS = {"tolist", "item", "__bool__", "__int__", "__float__", "__index__"}


def _tolist_frame() -> FrameType | None:
    """The frame of the ``FakeTensor.tolist`` that is reading elements one by one, if one is."""
    frame = sys._getframe(2)
    while frame is not None and not (frame.f_code.co_name == "tolist" and frame.f_code.co_filename.endswith("fake_tensor.py")):
        frame = frame.f_back
    return frame


class _HostReads(TorchFunctionMode):
    """Device data read on the host, caught where Python asks for it: zeros come back. A fake tensor's ``tolist``
    reads its elements one ``item`` at a time: those count as the one sync that ``tolist`` is on a GPU.
    (And host memory asked to be pinned comes unpinned: a CPU-only torch has no allocator for it.)"""

    def __init__(self, syncs: HostSyncs) -> None:
        super().__init__()
        self.syncs = syncs
        self.tolist: FrameType | None = None  # the tolist whose elements are being read

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", None)
        if name in _READS and _on_cuda(args[0]):
            listing = _tolist_frame() if name == "item" else None
            if listing is None or listing is not self.tolist:
                self.syncs.record("tolist" if listing is not None else name)
            self.tolist = listing
            return _zeros(tuple(args[0].shape), args[0].dtype)
        if kwargs and kwargs.get("pin_memory") and not torch.cuda.is_available():
            kwargs = {**kwargs, "pin_memory": False}  # pinned memory is CUDA's to allocate: here, the tensor unpinned
        return func(*args, **(kwargs or {}))


class _DataDependentOps(TorchDispatchMode):
    """Operators that make the host wait on a GPU: recorded, then run with a stand-in so the step goes on."""

    def __init__(self, syncs: HostSyncs) -> None:
        super().__init__()
        self.syncs = syncs

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        named = {a.name: v for a, v in zip(func._schema.arguments, args)} | kwargs
        values = [i for v in named.values() for i in (v if isinstance(v, (list, tuple)) else [v])]
        if not any(isinstance(v, torch.device) and v.type == "cuda" for v in values) and not _on_cuda(*values):
            return func(*args, **kwargs)
        record = self.syncs.record
        if func is aten.nonzero.default:
            record("nonzero")
            return torch.empty(0, args[0].dim(), dtype=torch.long, device=args[0].device)
        if func is aten.masked_select.default:
            record("masked_select")
            return args[0].new_empty(0)
        if func in (aten.index.Tensor, aten.index_put.default, aten.index_put_.default) and any(
                i is not None and i.dtype in (torch.bool, torch.uint8) for i in args[1]):
            record(f"boolean indexing ({func.__name__})")
            as_positions = [j for i in args[1] for j in (
                [i] if i is None or i.dtype not in (torch.bool, torch.uint8) else [i.new_empty(0, dtype=torch.long)] * i.dim())]
            return func(args[0], as_positions, *args[2:], **kwargs)
        if func is aten.bincount.default:  # its length is the largest value's, read on the host
            record("bincount")
            length = max(named.get("minlength") or 0, 1)
            dtype = torch.long if named.get("weights") is None else named["weights"].dtype
            return torch.zeros(length, dtype=dtype, device=args[0].device)
        if func in (aten._unique2.default, aten.unique_dim.default, aten.unique_consecutive.default):
            record(func.__name__)  # then fake mode's own error: no size to stand in for
        if func is aten.repeat_interleave.Tensor and named.get("output_size") is None:
            record("repeat_interleave without output_size")
            return func(*args, **{**kwargs, "output_size": args[0].numel()})
        if func is aten._local_scalar_dense.default:
            record("_local_scalar_dense")
            return _zeros((), args[0].dtype)
        if func in (aten.equal.default, aten.is_nonzero.default):
            record(func.__name__)
            return False
        if func is aten.copy_.default:
            source, target = named["src"], named["self"].device
        elif func is aten._to_copy.default or func.overloadpacket is aten.to:
            source = named["self"]
            target = named["other"].device if "other" in named else named.get("device") or source.device
        else:
            return func(*args, **kwargs)
        if source.device.type == "cuda" and torch.device(target).type == "cpu":
            record("copy to the host")
        elif source.device.type == "cpu" and torch.device(target).type == "cuda":
            if not named.get("non_blocking"):
                record("blocking copy to the device")
            if func.overloadpacket is aten.to:  # as the one copy it is: for a one-element constant (a fake tensor that
                # keeps its value) fake mode would run ``to`` for real, on the CUDA a CPU-only torch lacks
                dtype = named["other"].dtype if "other" in named else named.get("dtype")
                keep = {k: v for k, v in named.items() if k in ("layout", "pin_memory", "non_blocking", "memory_format")}
                return aten._to_copy.default(source, device=torch.device(target), dtype=dtype, **keep)
        return func(*args, **kwargs)


@dataclass
class HostSyncs:
    """``with HostSyncs() as syncs:`` inside a FakeTensorMode: ``syncs.events`` lists each host sync, in order."""

    events: list[Sync] = field(default_factory=list)

    def record(self, what: str) -> None:
        self.events.append(Sync(what, _where()))

    def __enter__(self) -> HostSyncs:
        self._modes = (_HostReads(self), _DataDependentOps(self))
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)


def steps_until_done(engine: Engine, syncs: HostSyncs, limit: int = 40) -> list[list[Sync]]:
    """Step ``engine`` until its requests finish: each step's syncs."""
    per_step = []
    while engine.has_unfinished_requests():
        start = len(syncs.events)
        engine.step()
        per_step.append(syncs.events[start:])
        assert len(per_step) < limit, "the requests never finished"
    return per_step


def assert_one_sync_a_step(per_step: list[list[Sync]]) -> None:
    """Each step waits once, for its sampled tokens (every step of these samples)."""
    for i, events in enumerate(per_step):
        assert [e.what for e in events] == ["tolist"], (
            f"step {i} makes the host wait {len(events)} times (once is the tokens' .tolist()):\n  "
            + "\n  ".join(map(str, events)))


# ---------------------------------------------------------------- the model and engines on fake CUDA

@pytest.fixture
def on_cuda(fake, tiny) -> Callable[[torch.dtype], Transformer]:
    """``on_cuda(dtype)``: the tiny random model, its tensors made fake ones on CUDA (call it outside ``fake``)."""
    def move(dtype: torch.dtype = torch.float32) -> Transformer:
        model = copy.deepcopy(tiny)  # a real copy (deepcopy inside the mode would meet real tensors)
        with fake:
            return model._apply(lambda t: fake.from_tensor(t).to(CUDA, dtype if t.is_floating_point() else t.dtype))
    return move


PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28]]
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
SAMPLED = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, max_tokens=4, ignore_eos=True)
# the logits edits that read a request's tokens so far (min_tokens, the three penalties), and min_p
PENALISED = SamplingParams(temperature=0.7, min_p=0.05, max_tokens=4, min_tokens=3, repetition_penalty=1.3,
                           presence_penalty=0.5, frequency_penalty=0.3)


def engine_on(model: Transformer, **config) -> Engine:
    """An engine of 32 blocks of 4 tokens (the memory given too: a GPU's free memory is asked otherwise)."""
    return Engine(model, tiny_tokenizer(model.cfg.vocab_size),
                  EngineConfig(num_blocks=32, block_size=4, kv_cache_memory=1 << 20, **config))


def test_fake_cuda_catches_a_device_mix_and_counts_syncs(fake):
    """The harness can fail: a CPU index into a CUDA tensor raises as on a GPU, and each kind of wait is counted."""
    from torch._subclasses.fake_tensor import FakeTensorDeviceMismatchError

    with fake, HostSyncs() as syncs:
        lens = torch.empty(3, dtype=torch.long, device=CUDA)
        with pytest.raises(FakeTensorDeviceMismatchError):
            torch.arange(4) < lens[:, None]
        ok = torch.arange(4, device=CUDA) < lens[:, None]  # the same on one device: no sync, no error
        assert ok.device.type == "cuda" and not syncs.events
        lens[ok.any(1)]
        ok.nonzero()
        lens.repeat_interleave(lens)
        lens.repeat_interleave(lens, output_size=6)  # told the size: no wait
        torch.bincount(lens, minlength=8)
        torch.tensor([1, 2, 3], device=CUDA)
        lens.cpu()
        assert lens.tolist() == [0, 0, 0] and int(lens[0]) == 0
    assert [e.what for e in syncs.events] == [
        "boolean indexing (index.Tensor)", "nonzero", "repeat_interleave without output_size", "bincount",
        "blocking copy to the device", "copy to the host", "tolist", "__int__"]


def test_penalties_and_min_tokens_on_fake_cuda_wait_once_a_step(fake, on_cuda):
    """A request's own logits edits (its tokens so far as indices on the device, counts by a scatter) add no sync."""
    model = on_cuda()
    with fake, HostSyncs() as syncs:
        engine = engine_on(model)
        engine.add_request(PROMPTS[0], PENALISED)
        engine.add_request(PROMPTS[1], GREEDY)
        per_step = steps_until_done(engine, syncs)
    assert_one_sync_a_step(per_step)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_an_engine_on_fake_cuda_waits_once_a_step(fake, on_cuda, dtype):
    """Batch.build, the paged cache's gather path (decodes alone, prefills and decodes in one step), the model and
    sampling (greedy and filtered), on CUDA tensors: no device mixed up, one sync a step."""
    model = on_cuda(dtype)
    with fake, HostSyncs() as syncs:
        engine = engine_on(model)
        assert engine.cache.k.device.type == "cuda" and engine.cache.decode_kernel is None
        engine.add_request(PROMPTS[0], GREEDY)
        engine.add_request(PROMPTS[1], SAMPLED)
        engine.step()
        engine.add_request(PROMPTS[2], GREEDY)  # joins while the others decode: a mixed step
        syncs.events.clear()
        per_step = steps_until_done(engine, syncs)
    assert len(per_step) >= 4
    assert_one_sync_a_step(per_step)


def test_the_fused_decode_path_on_fake_cuda_reaches_its_kernel(fake, on_cuda):
    """With a fused decode kernel (Triton's on a GPU; here a stand-in that checks what it is given), decode steps
    bind the cache for it: the tables are checked on the host, nothing crosses devices, one sync a step."""
    calls = []

    def kernel(q, k, v, k_pool, v_pool, block_tables, context_lens):
        assert all(t.device.type == "cuda" for t in (q, k, v, k_pool, v_pool, block_tables, context_lens))
        assert q.dim() == 3 and block_tables.shape[0] == context_lens.shape[0] == q.shape[0]
        calls.append(q.shape[0])
        return torch.empty_like(q)

    model = on_cuda()
    with fake, HostSyncs() as syncs:
        engine = engine_on(model)
        engine.cache.decode_kernel = kernel
        for prompt in PROMPTS:
            engine.add_request(prompt, GREEDY)
        per_step = steps_until_done(engine, syncs)
    assert calls and set(calls) == {3}, "decode steps of all three went through the kernel"
    assert_one_sync_a_step(per_step)


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_speculative_verification_on_fake_cuda_waits_once_a_step(fake, on_cuda, params):
    """N-gram guesses verified on CUDA (greedy: argmax; sampled: rejection sampling): one transfer a step."""
    # a fake step's tokens read as 0, so a prompt with 0s in it always has an n-gram to propose from
    prompt = [0, 5, 6, 0, 5, 6, 0, 5]
    model = on_cuda()
    with fake, HostSyncs() as syncs:
        engine = engine_on(model, speculative=SpeculativeConfig(num_speculative_tokens=3))
        engine.add_request(prompt, dataclasses.replace(params, max_tokens=12))
        per_step = steps_until_done(engine, syncs)
    assert engine.runner.spec_stats.verifications >= 2
    assert_one_sync_a_step(per_step)


def test_a_bad_table_is_refused_on_the_host(fake):
    """The check a fused kernel trusts (blocks in the pool, keys within the table) reads the host's lists: the same
    errors as before, on CUDA tensors, with no sync."""
    pool = torch.zeros(1, 12, 4, 1, 8)
    with fake, HostSyncs() as syncs:
        for table, message in (([3, 12], "block 12 is outside the pool of 12"),
                               ([-1, 2], "block -1 is outside the pool of 12")):
            batch = Batch.build([SequenceWork([1], 5, table), SequenceWork([2], 0, [0, 99])], 4, CUDA)
            with pytest.raises(RuntimeError, match=message):
                batch.check_pool(12)
        batch = Batch.build([SequenceWork([1], 3, [3, 99])], 4, CUDA)  # block 99 holds no key yet: never read
        batch.check_pool(12)
        with pytest.raises(ValueError, match="cannot hold"):
            Batch.build([SequenceWork([1] * 5, 4, [0, 1])], 4, CUDA)
        with pytest.raises(ValueError, match="cannot start at position -1"):
            Batch.build([SequenceWork([1], -1, [0])], 4, CUDA)
    assert not syncs.events and pool.shape[1] == 12


def test_compiled_verification_gives_each_token_its_table_with_no_sync(fake):
    """The compiled step's rows: a decode's table, or a verifying sequence's repeated per token with the keys up to
    each token's position; on CUDA the repeat is told its size (the host knows it), so nothing waits."""
    from enginelib.speed.compiled import token_tables

    seqs = [SequenceWork([1, 2, 3], 5, [4, 7], num_draft=2), SequenceWork([9], 2, [1])]
    want_rows, want_lens = token_tables(Batch.build(seqs, 4))  # on the CPU, with data
    assert want_rows.tolist() == [[4, 7]] * 3 + [[1, 0]] and want_lens.tolist() == [6, 7, 8, 3]
    with fake, HostSyncs() as syncs:
        rows, lens = token_tables(Batch.build(seqs, 4, CUDA))
        decode = Batch.build([SequenceWork([1], 5, [4, 7]), SequenceWork([9], 2, [1])], 4, CUDA)
        assert token_tables(decode) == (decode.block_tables, decode.context_lens)
    assert rows.shape == (4, 2) and rows.device.type == lens.device.type == "cuda" and lens.shape == (4,)
    assert not syncs.events, syncs.events


@pytest.mark.parametrize(("fmt", "kernel"), [("int8", "reference"), ("int4", "reference"), ("q8_0", "reference"),
                                             ("int8", "int8pack"), ("float16", "native")])
def test_quantized_linears_on_fake_cuda_wait_once_a_step(fake, on_cuda, fmt, kernel):
    """Quantized on the GPU with each kernel CUDA runs (but Triton's, which needs the real GPU: ``auto`` too, which
    times kernels with CUDA's clock) and decoding: one sync a step."""
    from enginelib.speed.quant import quant_info, quantize

    model = on_cuda()
    with fake:
        quantized = quantize(model, fmt, kernel)
    assert set(quant_info(quantized).kernels.values()) == {kernel}
    with fake, HostSyncs() as syncs:
        engine = engine_on(quantized)
        for prompt in PROMPTS[:2]:
            engine.add_request(prompt, SAMPLED)
        per_step = steps_until_done(engine, syncs)
    assert_one_sync_a_step(per_step)


def test_triton_is_refused_for_a_dtype_the_gpu_lacks(monkeypatch):
    """``kernel_unavailable`` asks Triton about the activations' dtype too: on a T4 (compute capability 7.5, emulated
    here), bfloat16 is refused when the kernel is chosen, not at the first matmul."""
    from enginelib.speed import triton_kernels
    from enginelib.speed.quant import choose_kernels, kernel_unavailable, quantize_weight

    if triton_kernels._MISSING:
        pytest.skip(triton_kernels._MISSING)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    assert kernel_unavailable("triton", "int8", (96, 64), CUDA, torch.float16) is None
    no_bf16 = "no bfloat16 matmul"
    assert no_bf16 in kernel_unavailable("triton", "int4", (96, 64), CUDA, torch.bfloat16)
    assert "not float64" in kernel_unavailable("triton", "int8", (96, 64), CUDA, torch.float64)
    weights = {"w": quantize_weight(torch.randn(96, 64), "int8")}
    with pytest.raises(ValueError, match=no_bf16):
        choose_kernels("triton", weights, None, CUDA, dtype=torch.bfloat16)
    assert choose_kernels("triton", weights, None, CUDA, dtype=torch.float16)[("int8", (96, 64))].kernel == "triton"


def test_the_whole_compiled_step_on_fake_cuda_waits_for_nothing(fake, on_cuda):
    """The step a GPU's compiled decode runs with attention in the Triton kernel's operator, as one CUDA graph per
    bucket captures it: every input on the device (tables padded to a fixed width, context lengths, the pools the
    operator writes) and not one host sync anywhere in it (a capture fails on one)."""
    from enginelib.speed import triton_kernels  # noqa: F401  (registers enginelib::triton_decode_attention)
    from enginelib.speed.compiled import _GraphCache

    model = on_cuda()
    cfg = model.cfg
    with fake, HostSyncs() as syncs:
        k_pool, v_pool = (torch.empty(cfg.num_layers, 32, 4, cfg.num_kv_heads, cfg.head_dim, device=CUDA)
                          for _ in range(2))
        tables = torch.empty(4, 8, dtype=torch.long, device=CUDA)  # a bucket of 4 rows, 8 blocks wide
        lens = torch.empty(4, dtype=torch.long, device=CUDA)
        token_ids, positions = (torch.empty(4, dtype=torch.long, device=CUDA) for _ in range(2))
        logits = model(token_ids, _GraphCache(tables, lens, k_pool, v_pool, "triton"), positions=positions)
    assert logits.device.type == "cuda" and logits.shape[-1] == cfg.vocab_size
    assert not syncs.events, syncs.events
