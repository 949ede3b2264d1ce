"""Kernels that multiply activations by a stored weight, the layer that holds one, and choosing among them.

Which kernel is fastest depends on the machine and the weight's shape, so ``auto`` *measures* them
(:func:`measure_kernels`, :func:`choose_kernels`); each :class:`QuantLinear` keeps how its kernel was chosen
(:class:`KernelChoice`), so a quantized model carries its own measurements.
"""
from __future__ import annotations

import math
import time
import warnings
from dataclasses import dataclass, field, replace
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from enginelib.speed import cpu_kernels, paths
from enginelib.speed.quant.formats import FORMATS, GROUP_SIZE, QuantizedWeight, pack_int4, unpack_int4

WeightKey = tuple[str, tuple[int, int]]  # (format, [N, K] shape): kernels are chosen per key

# ---------------------------------------------------------------- kernels

@dataclass(frozen=True)
class Kernel:
    """One way to compute ``x @ W.T`` from a stored weight.

    ``prepare`` turns a :class:`QuantizedWeight` into what the kernel keeps
    (often the same tensors; fbgemm and torch's int4 op re-lay them out), ``run``
    multiplies [M, K] activations by it, and ``unprepare`` gives the stored form
    back. ``exact``: the kernel computes the reference's product up to float
    rounding. fbgemm also rounds the *activations* to 8 bits, and ``native`` to
    the weight's half dtype, so they are not: ``auto`` checks those on every layer.
    ``ready``: for a kernel built on this machine (our C++), build it now and say why that failed (None:
    ready). :func:`kernel_unavailable` never calls it (asking must stay cheap); ``auto`` calls it for
    the kernels it is about to time, and ``prepare`` builds too, so a kernel asked for by name raises
    the build's error at once.
    """

    name: str
    formats: tuple[str, ...]
    devices: tuple[str, ...]
    prepare: Callable[[QuantizedWeight], object]
    run: Callable[[torch.Tensor, object], torch.Tensor]
    unprepare: Callable[[object], QuantizedWeight]
    exact: bool = True
    doc: str = ""
    ready: Callable[[torch.device], str | None] | None = None


def _same(qw: QuantizedWeight) -> QuantizedWeight:
    return qw


REFERENCE_BLOCK = 1 << 22  # weights dequantized at a time by the reference kernel (16 MB in float32)


def _reference(x: torch.Tensor, qw: QuantizedWeight) -> torch.Tensor:
    """Dequantize, then ``F.linear``; a big weight (the LM head) a block of rows at a time, so its float
    copy never exists whole: that would double the memory it saves, and costs page faults on every call."""
    n, k = qw.shape
    step = max(1, REFERENCE_BLOCK // k)
    if step >= n:
        return F.linear(x, qw.dequantize(x.dtype))
    return torch.cat([F.linear(x, qw.rows(i, i + step).dequantize(x.dtype)) for i in range(0, n, step)], dim=-1)


def _native_half(x: torch.Tensor, qw: QuantizedWeight) -> torch.Tensor:
    return F.linear(x.to(qw.data.dtype), qw.data).to(x.dtype)


def _int8pack(x: torch.Tensor, qw: QuantizedWeight) -> torch.Tensor:
    return torch._weight_int8pack_mm(x, qw.data, qw.scale.to(x.dtype))


# fbgemm's dynamic int8 linear rounds the activations to 8 bits (7 on AVX2, ``reduce_range``) with ONE
# scale for the whole [M, K] input, from its min and max. That would make a row's result depend on the
# other rows of the batch. So each row is first divided by its own largest |x|, and two columns of +1 and
# -1 (matched by zero weights) pin the range to [-1, 1] for every input: the rounding is then per row and
# the same whatever else is in the batch; the integer matmul is exact, and each row is scaled back.
_PIN = 2


def _fbgemm_prepare(qw: QuantizedWeight) -> object:
    n, k = qw.shape
    data = torch.cat([qw.data, qw.data.new_zeros(n, _PIN)], dim=1)
    with warnings.catch_warnings():  # quantized tensors are deprecated in torch 2.13, still the only way into fbgemm
        warnings.filterwarnings("ignore", message=".*quantize_per_tensor, torch.quantize_per_channel.*")
        weight = torch._make_per_channel_quantized_tensor(data, qw.scale.double(), torch.zeros(n, dtype=torch.long), 0)
        return torch.ops.quantized.linear_prepack(weight, None)


def _fbgemm_run(x: torch.Tensor, packed: object) -> torch.Tensor:
    peak = x.abs().amax(dim=1, keepdim=True).clamp_min(1e-12)
    pins = torch.tensor([1.0, -1.0], device=x.device).expand(x.shape[0], _PIN)
    y = torch.ops.quantized.linear_dynamic(torch.cat([x.float() / peak, pins], dim=1), packed, True)
    return (y * peak).to(x.dtype)


def _fbgemm_unprepare(packed: object) -> QuantizedWeight:
    weight, _ = torch.ops.quantized.linear_unpack(packed)
    return QuantizedWeight("int8", weight.int_repr()[:, :-_PIN].contiguous(), weight.q_per_channel_scales().float())


@dataclass
class _Int4Packed:
    """torch's CPU int4 layout: codes re-arranged in blocks of output rows; per group (scale, scale*8 + min)."""

    data: torch.Tensor
    scales_and_zeros: torch.Tensor  # [K/32, N, 2] float32
    scale: torch.Tensor  # float16 [N, K/32], kept to give the stored form back exactly
    minimum: torch.Tensor


def _int4pack_prepare(qw: QuantizedWeight) -> _Int4Packed:
    codes = unpack_int4(qw.data).reshape(qw.shape).to(torch.int32)
    data = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
    s, m = qw.scale.float(), qw.minimum.float()  # torch computes (code - 8) * s + z, so z = m + 8 s
    return _Int4Packed(data, torch.stack([s, m + 8 * s], dim=-1).transpose(0, 1).contiguous(), qw.scale, qw.minimum)


def _int4pack_run(x: torch.Tensor, p: _Int4Packed) -> torch.Tensor:
    return torch._weight_int4pack_mm_for_cpu(x.float(), p.data, GROUP_SIZE, p.scales_and_zeros).to(x.dtype)


def _int4pack_unprepare(p: _Int4Packed) -> QuantizedWeight:
    """Undo torch's layout, whatever it is on this CPU and torch version, by asking the packer where codes go.

    The layout depends on the vector width (blocks of 32 or 64 rows, partial
    blocks at the end), so it is read off, not assumed: packing the hex digits
    of each code's index shows, nibble by nibble, which index landed there.
    """
    n, k = p.data.shape[0], 2 * p.data.shape[1]
    index = torch.arange(n * k)
    source = torch.zeros(n * k, dtype=torch.long)  # packed nibble -> the (row, column) index it holds
    for shift in range(0, max(4, (n * k - 1).bit_length()), 4):
        digit = ((index >> shift) & 15).reshape(n, k).to(torch.int32)
        source |= _nibbles(torch.ops.aten._convert_weight_to_int4pack_for_cpu(digit, 1)).long() << shift
    if not torch.equal(source.sort().values, index):
        raise RuntimeError("torch's int4 CPU layout is not a rearrangement of the codes in this version; "
                           "quantize with kernel='reference' to keep the stored form")
    codes = torch.empty(n * k, dtype=torch.uint8)
    codes[source] = _nibbles(p.data)
    return QuantizedWeight("int4", pack_int4(codes.reshape(n, k // GROUP_SIZE, GROUP_SIZE)), p.scale, p.minimum)


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Bytes -> their 4-bit halves, low first, flat."""
    flat = packed.flatten()
    return torch.stack([flat & 15, flat >> 4], dim=-1).flatten()


def _cpp_int8(x: torch.Tensor, qw: QuantizedWeight) -> torch.Tensor:
    return cpu_kernels.int8_linear(x.float().contiguous(), qw.data.contiguous(), qw.scale.contiguous()).to(x.dtype)


def _cpp_int4(x: torch.Tensor, qw: QuantizedWeight) -> torch.Tensor:
    return cpu_kernels.int4_linear(x.float().contiguous(), qw.data.contiguous(), qw.scale.contiguous(),
                                   qw.minimum.contiguous()).to(x.dtype)


def _cpp_run(x: torch.Tensor, qw: QuantizedWeight) -> torch.Tensor:
    return _cpp_int8(x, qw) if qw.fmt == "int8" else _cpp_int4(x, qw)


def _cpp_prepare(qw: QuantizedWeight) -> QuantizedWeight:
    cpu_kernels.load()  # the first layer builds the kernels (a failed build raises with the compiler's words)
    return qw


@dataclass
class _Interleaved:
    """A stored weight in the q8 kernels' layout (:func:`cpu_kernels.interleave`: rows in blocks of 4, read as one stream)."""

    fmt: str
    rows: int
    data: torch.Tensor
    scale: torch.Tensor
    minimum: torch.Tensor | None
    path: int = -1  # the C++ path (cpu_kernels.q8_path_number), fixed when the layer is prepared


def _interleave(qw: QuantizedWeight) -> _Interleaved:
    n, k = qw.shape
    if qw.fmt in ("int8", "q8_0"):  # a q8_0 scale per group is laid out as the groups' codes; int8's per row as is
        scale = cpu_kernels.interleave(qw.scale) if qw.fmt == "q8_0" else qw.scale.contiguous()
        return _Interleaved(qw.fmt, n, cpu_kernels.interleave(qw.data.reshape(n, k // GROUP_SIZE, GROUP_SIZE)),
                            scale, None)
    return _Interleaved("int4", n, *(cpu_kernels.interleave(t) for t in (qw.data, qw.scale, qw.minimum)))


def _deinterleave(w: _Interleaved) -> QuantizedWeight:
    if w.fmt in ("int8", "q8_0"):
        scale = cpu_kernels.deinterleave(w.scale, w.rows).contiguous() if w.fmt == "q8_0" else w.scale
        return QuantizedWeight(w.fmt, cpu_kernels.deinterleave(w.data, w.rows).flatten(1).contiguous(), scale)
    return QuantizedWeight("int4", *(cpu_kernels.deinterleave(t, w.rows).contiguous()
                                     for t in (w.data, w.scale, w.minimum)))


def _cpp_q8_prepare(qw: QuantizedWeight) -> _Interleaved:
    cpu_kernels.load()
    return replace(_interleave(qw), path=cpu_kernels.q8_path_number())


def _triton_prepare(qw: QuantizedWeight) -> QuantizedWeight:
    """The stored form as it is, each tensor contiguous (the Triton kernels read it in place)."""
    return QuantizedWeight(qw.fmt, *(None if t is None else t.contiguous() for t in (qw.data, qw.scale, qw.minimum)))


def _triton_run(x: torch.Tensor, qw: QuantizedWeight) -> torch.Tensor:
    from enginelib.speed import triton_kernels  # only where asked: importing Triton takes a while

    if qw.fmt == "int8":
        return triton_kernels.int8_linear(x, qw.data, qw.scale)
    return triton_kernels.int4_linear(x, qw.data, qw.scale, qw.minimum)


def _cpp_q8_run(x: torch.Tensor, w: _Interleaved) -> torch.Tensor:
    x32 = x.float().contiguous()
    if w.fmt in ("int8", "q8_0"):
        return cpu_kernels.int8q8_linear(x32, w.data, w.scale, w.rows, w.path).to(x.dtype)
    return cpu_kernels.int4q8_linear(x32, w.data, w.scale, w.minimum, w.rows, w.path).to(x.dtype)


KERNELS: dict[str, Kernel] = {k.name: k for k in (
    Kernel("reference", FORMATS, ("cpu", "cuda"), _same, _reference, _same,
           doc="dequantize, then F.linear: the oracle"),
    Kernel("native", ("float16", "bfloat16"), ("cpu", "cuda"), _same, _native_half, _same, exact=False,
           doc="activations cast to the weight's half dtype, F.linear, cast back"),
    Kernel("int8pack", ("int8",), ("cpu", "cuda"), _same, _int8pack, _same,
           doc="torch._weight_int8pack_mm: weight-only int8"),
    Kernel("fbgemm", ("int8",), ("cpu",), _fbgemm_prepare, _fbgemm_run, _fbgemm_unprepare, exact=False,
           doc="fbgemm's dynamic int8 linear: activations rounded to int8 per row, integer GEMM"),
    Kernel("int4pack", ("int4",), ("cpu",), _int4pack_prepare, _int4pack_run, _int4pack_unprepare,
           doc="torch._weight_int4pack_mm_for_cpu: weight-only int4, groups of 32"),
    Kernel("cpp", ("int8", "int4"), ("cpu",), _cpp_prepare, _cpp_run, _same,
           doc="enginelib.speed.cpu_kernels: our C++ loop, codes dequantized in AVX2 registers, float32 accumulation",
           ready=cpu_kernels.build_failure),
    Kernel("cpp_q8", ("int8", "int4", "q8_0"), ("cpu",), _cpp_q8_prepare, _cpp_q8_run, _deinterleave, exact=False,
           doc="our C++ loop with activations rounded to int8 per group of 32 and integer products (llama.cpp's way), "
               "weights interleaved in blocks of 4 rows", ready=cpu_kernels.build_failure),
    Kernel("triton", ("int8", "int4"), ("cuda",), _triton_prepare, _triton_run, _same,
           doc="enginelib.speed.triton_kernels: our Triton kernel, bytes dequantized in registers, tl.dot with "
               "float32 accumulation"),
)}


def kernel_unavailable(name: str, fmt: str, shape: tuple[int, int], device: torch.device,
                       dtype: torch.dtype | None = None) -> str | None:
    """Why kernel ``name`` cannot run ``fmt`` at ``shape`` on ``device`` with activations in ``dtype`` (None: it can;
    no ``dtype``: in some dtype). The dtype matters to Triton's: no bfloat16 on a GPU older than compute capability
    8.0 (a T4), which would otherwise be found only when the first matmul fails."""
    kernel = KERNELS[name]
    if fmt not in kernel.formats:
        return f"kernel {name!r} does not run {fmt} (it runs {', '.join(kernel.formats)})"
    if device.type not in kernel.devices:
        return f"kernel {name!r} runs on {' and '.join(kernel.devices)}, not {device.type}"
    n, _ = shape
    if name == "fbgemm" and not ({"fbgemm", "x86"} & set(torch.backends.quantized.supported_engines)
                                 and hasattr(torch.ops.quantized, "linear_dynamic")):
        return "this torch build has no fbgemm quantized engine"
    if name == "int8pack" and not hasattr(torch, "_weight_int8pack_mm"):
        return "this torch build has no torch._weight_int8pack_mm"
    if name == "int4pack" and (not hasattr(torch, "_weight_int4pack_mm_for_cpu") or n % 32):
        return "torch._weight_int4pack_mm_for_cpu is missing, or the output size is not a multiple of 32"
    if name == "cpp_q8" and shape[1] % GROUP_SIZE:
        return f"kernel 'cpp_q8' rounds activations in groups of {GROUP_SIZE}: the input size {shape[1]} is not a multiple"
    if name in ("cpp", "cpp_q8"):  # only looks (the CPU, the tools): the build waits for Kernel.ready or prepare
        return cpu_kernels.unavailable(device)
    if name == "triton":
        from enginelib.speed import triton_kernels  # imports Triton only if it is installed

        return triton_kernels.unavailable(device, dtype)
    return None


def _cannot_run(name: str, fmt: str, shape: tuple[int, int], device: torch.device,
                dtype: torch.dtype | None = None) -> str | None:
    """:func:`kernel_unavailable`, else the kernel's own build (``Kernel.ready``): for ``auto``, about to time it."""
    ready = KERNELS[name].ready
    return kernel_unavailable(name, fmt, shape, device, dtype) or (ready(device) if ready is not None else None)


# ---------------------------------------------------------------- the layer

class QuantLinear(nn.Module):
    """A linear layer whose weight is stored in a quantized format and multiplied by one kernel."""

    def __init__(self, qw: QuantizedWeight, bias: torch.Tensor | None, kernel: str = "reference",
                 choice: KernelChoice | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = qw.shape
        self.fmt, self.kernel = qw.fmt, KERNELS[kernel]
        # how ``kernel`` was picked (``auto``'s measurements): what :func:`quant.quant_info` reports
        self.choice = KernelChoice(kernel, kernel) if choice is None else choice
        if self.choice.kernel != kernel:
            raise ValueError(f"the choice says kernel {self.choice.kernel!r}, the layer was given {kernel!r}")
        self.nbytes = qw.nbytes  # the stored form's size (a kernel's layout holds about the same)
        self.prepared = self.kernel.prepare(qw)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    def quantized_weight(self) -> QuantizedWeight:
        """The stored form, whatever layout the kernel keeps it in."""
        return self.kernel.unprepare(self.prepared)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.kernel.run(x.reshape(-1, self.in_features), self.prepared)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, fmt={self.fmt}, kernel={self.kernel.name}"


# ---------------------------------------------------------------- choosing kernels by measurement

@dataclass
class KernelTiming:
    """One candidate kernel on one weight shape: its time at M=1 and M=32 rows, its error against the reference."""

    fmt: str
    shape: tuple[int, int]
    kernel: str
    ms_m1: float
    ms_m32: float
    rel_error: float  # ||y - y_reference|| / ||y_reference|| on calibration activations (the layer's inputs)
    chosen: bool = False
    rejected: str | None = None  # why it was not eligible (too inaccurate)

    @property
    def ms_per_token(self) -> float:
        """The score ``auto`` minimizes: time per token alone (decode) plus time per token in a batch of 32."""
        return self.ms_m1 + self.ms_m32 / 32


@dataclass(frozen=True)
class KernelChoice:
    """How one (format, shape)'s kernel was picked, kept by every :class:`QuantLinear` of that key.

    ``requested``: ``"auto"`` or the kernel name asked for. With ``auto``, ``timings`` are the
    candidates measured on this key and ``skipped`` the kernels written for it that could not run
    here, and why (e.g. ``cpp`` without a C++ compiler), so a missing speed-up is explained.
    """

    kernel: str
    requested: str
    timings: tuple[KernelTiming, ...] = ()
    skipped: dict[str, str] = field(default_factory=dict)


def _time_ms(fn: Callable[[], object], device: torch.device, budget_s: float = 0.03) -> float:
    """Best of a few calls (after one warm-up): short, because ``auto`` runs for every shape."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fn()
    sync()
    best, spent, calls = math.inf, 0.0, 0
    while calls < 2 or (spent < budget_s and calls < 20):
        start = time.perf_counter()
        fn()
        sync()
        took = time.perf_counter() - start
        best, spent, calls = min(best, took), spent + took, calls + 1
    return best * 1e3


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got - want|| / ||want||, in float32."""
    want = want.float()
    return ((got.float() - want).norm() / want.norm().clamp_min(1e-30)).item()


def measure_kernels(qw: QuantizedWeight, x: torch.Tensor, failed: dict[str, str] | None = None) -> list[KernelTiming]:
    """Time every kernel that can run ``qw`` on ``x``'s device, at M=1 (decode) and M=32 rows of ``x``,
    and measure its error against the reference on all of ``x``.

    A kernel whose first run raises (a Triton kernel this GPU's compiler refuses, say) is left out with a
    RuntimeWarning, and its error goes into ``failed`` (name -> why) when given: ``auto`` then runs without
    it rather than not at all. The reference is never left out."""
    rows = []
    want = _reference(x, qw)
    for name, kernel in KERNELS.items():
        if _cannot_run(name, qw.fmt, qw.shape, x.device, x.dtype):
            continue
        prepared = kernel.prepare(qw)
        try:  # each row count may compile its own variant (Triton's tiles): all three are part of the try
            error = relative_error(kernel.run(x, prepared), want)
            row = KernelTiming(qw.fmt, qw.shape, name, _time_ms(lambda: kernel.run(x[:1], prepared), x.device),
                               _time_ms(lambda: kernel.run(x[:32], prepared), x.device), error)
        except Exception as exc:  # noqa: BLE001 - any failure of a candidate: auto goes on without it
            if name == "reference":
                raise
            why = f"it failed on {qw.fmt} {list(qw.shape)}: {type(exc).__name__}: {str(exc).strip()[:300]}"
            _left_out(weight_key(qw), name, why)
            warnings.warn(f"kernel {name!r} left out: {why}", RuntimeWarning, stacklevel=2)
            if failed is not None:
                failed[name] = why
            continue
        rows.append(row)
    return rows


def choose(rows: list[KernelTiming], tolerance: float) -> KernelTiming:
    """Mark and return the fastest row whose error is within ``tolerance`` (the reference always is)."""
    for row in rows:
        row.rejected = None if row.rel_error <= tolerance else f"error {row.rel_error:.2g} > tolerance {tolerance:g}"
    best = min((r for r in rows if r.rejected is None or r.kernel == "reference"), key=lambda r: r.ms_per_token)
    best.chosen = True
    return best


def weight_key(qw: QuantizedWeight) -> WeightKey:
    """What a kernel is chosen for: the format and the [N, K] shape."""
    return qw.fmt, qw.shape


def _path_name(key: WeightKey) -> str:
    """What :mod:`enginelib.speed.paths` calls the choice for ``key``: "quant kernel int4 576x1536"."""
    return f"quant kernel {key[0]} {key[1][0]}x{key[1][1]}"


def _left_out(key: WeightKey, name: str, why: str) -> None:
    """Record that ``auto`` chose for ``key`` without candidate ``name`` (it could not run, or failed): on a GPU,
    a Triton kernel missing from the race is the slow path taken silently."""
    paths.fell_back(_path_name(key), f"auto (with {name})", "auto without it", why, explicit=False)


def check_kernel(kernel: str) -> None:
    """Refuse an unknown kernel name with the list of known ones."""
    if kernel != "auto" and kernel not in KERNELS:
        raise ValueError(f"unknown kernel {kernel!r}: use 'auto' or one of {', '.join(KERNELS)}")


def choose_kernels(kernel: str, weights: dict[str, QuantizedWeight], inputs: dict[str, torch.Tensor] | None,
                   device: torch.device, tolerance: float = 1e-2,
                   dtype: torch.dtype | None = None) -> dict[WeightKey, KernelChoice]:
    """A kernel per (format, shape) of ``weights`` (layer path -> stored weight), for activations in ``dtype`` (the
    model's; None: the inputs').

    With ``kernel == "auto"`` each kernel is timed on the first layer of a shape and its error measured
    on ``inputs`` (what each layer really receives; see :func:`quant.quantize`); else ``kernel`` everywhere.
    """
    if dtype is None and inputs:
        dtype = next(iter(inputs.values())).dtype
    if kernel != "auto":
        for qw in weights.values():
            reason = kernel_unavailable(kernel, qw.fmt, qw.shape, device, dtype)
            if reason:
                raise ValueError(f"{reason}: use kernel='auto' or 'reference'")
            paths.ran(_path_name(weight_key(qw)), kernel)
        return {weight_key(qw): KernelChoice(kernel, kernel) for qw in weights.values()}
    rows: dict[WeightKey, list[KernelTiming]] = {}
    failed: dict[WeightKey, dict[str, str]] = {}
    for path, qw in weights.items():
        key, x = weight_key(qw), inputs[path]
        if key not in rows:
            failed[key] = {}
            rows[key] = measure_kernels(qw, x, failed[key])
            continue
        inexact = [row for row in rows[key] if not KERNELS[row.kernel].exact]
        want = _reference(x, qw) if inexact else None
        for row in inexact:  # its worst error over every layer of this shape counts
            k = KERNELS[row.kernel]
            row.rel_error = max(row.rel_error, relative_error(k.run(x, k.prepare(qw)), want))
    choices = {}
    for key, candidates in rows.items():
        skipped = {name: reason for name, k in KERNELS.items() if key[0] in k.formats and device.type in k.devices
                   and (reason := _cannot_run(name, *key, device, dtype))} | failed[key]
        choices[key] = KernelChoice(choose(candidates, tolerance).kernel, "auto", tuple(candidates), skipped)
        for name, why in skipped.items():
            _left_out(key, name, why)
        paths.ran(_path_name(key), choices[key].kernel, requested="auto")
    return choices
