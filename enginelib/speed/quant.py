"""Smaller weights, same model: int8 and int4 weight-only quantization, float16 and bfloat16 (chapter 11).

A decode step reads every weight once per token, so on a CPU (and at batch 1 on
a GPU) its time is mostly the time to stream the weights from memory. Storing
them in fewer bytes is the main lever. Each format here has two parts:

- the **stored form** (:class:`QuantizedWeight`): the integers and scales, and
  :meth:`QuantizedWeight.dequantize`, which turns them back into floats;
- **kernels** that multiply activations by a stored weight. ``reference``
  dequantizes and calls ``F.linear``: the few lines a chapter writes by hand, and
  the oracle every faster kernel is compared with. The others are library ops
  (torch's weight-only int8/int4 matmuls, fbgemm's int8 GEMM) and our own C++
  loops (``cpp``, ``cpp_q8``, :mod:`enginelib.speed.cpu_kernels`), whose speed depends on the
  device and the shape, so ``kernel="auto"`` *measures* them on
  each distinct weight shape and keeps the fastest that matches the reference
  (fastest: least time per token at batch 1 plus per token at batch 32).

Formats: ``int8`` (per-output-channel symmetric scale, float32), ``int4``
(groups of 32 along the input, a float16 scale and minimum per group, two codes
per byte: the layout of GGUF's Q4_1 block), ``q8_0`` (int8 with a float16
scale per group of 32: GGUF's Q8_0 block), ``float16`` and ``bfloat16`` (the
weight stored in half precision). :func:`load_quantized` reads a GGUF file's
Q4_1 and Q8_0 tensors straight into int4 and q8_0 layers, bytes cut apart,
never a float copy of a layer. All are
*weight* formats: activations keep the model's dtype. Every linear layer is
converted, the LM head included; a tied embedding stays a float lookup table
(a lookup reads one row per token, the head's matmul reads all of them).

What the measurements say depends on the machine, so ``quant_info`` keeps them.
On an AVX2 CPU without VNNI (torch 2.13), torch's weight-only int8/int4 ops are
slower than float32's matmul, and fbgemm's fast int8 GEMM, which also rounds the
activations to 8 bits, errs by several percent on this model's real activations
(outlier channels) and loses its perplexity: ``auto`` rejects it. So the
``cpp`` kernel is our own (:mod:`enginelib.speed.cpu_kernels`, built on first use with
the machine's C++ compiler): one fused loop that reads the int8/int4 bytes,
dequantizes them in vector registers and multiply-adds in float32. Its twin
``cpp_q8`` also rounds the activations, per group of 32, to int8 (one scale per
group, error about 0.5% per layer) and multiplies integers, 32 products per pair of
AVX2 instructions, as llama.cpp does; ``auto`` weighs its error like fbgemm's.
On CUDA the reference, ``native`` half matmuls and ``int8pack`` run (checked on
an H200 with torch 2.11).
"""
from __future__ import annotations

import copy
import math
import os
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from enginelib.model.device import pick_device
from enginelib.model.tokenizer import Tokenizer
from enginelib.model.transformer import Transformer
from enginelib.model.weights import DEFAULT_MODEL, StoredTensor, read_gguf, resolve
from enginelib.speed import cpu_kernels

FORMATS = ("int8", "int4", "q8_0", "float16", "bfloat16")
GROUP_SIZE = 32  # int4: weights per (scale, minimum) pair, as GGUF's Q4_1
DATA_DIR = Path(__file__).parents[1] / "data"


# ---------------------------------------------------------------- the stored form

@dataclass
class QuantizedWeight:
    """A [N, K] weight in one format: ``data`` plus the scales that turn it back into floats.

    int8: data int8 [N, K], scale float32 [N] (w = q * scale[n]).
    int4: data uint8 [N, K/32, 16], scale and minimum float16 [N, K/32]; in each
    group byte j holds code j (low nibble) and code j+16 (high nibble), and
    w = code * scale + minimum (codes 0..15).
    q8_0: data int8 [N, K], scale float16 [N, K/32] (w = q * scale of its group of 32).
    float16 / bfloat16: data is the weight itself.
    """

    fmt: str
    data: torch.Tensor
    scale: torch.Tensor | None = None
    minimum: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, int]:
        n = self.data.shape[0]
        return (n, self.data.shape[1] * GROUP_SIZE) if self.fmt == "int4" else (n, self.data.shape[1])

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.data, self.scale, self.minimum) if t is not None)

    def rows(self, start: int, stop: int) -> "QuantizedWeight":
        """Output rows ``start:stop`` (every format stores each output row's numbers together)."""
        cut = [None if t is None else t[start:stop] for t in (self.scale, self.minimum)]
        return QuantizedWeight(self.fmt, self.data[start:stop], *cut)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float weight [N, K] this form stands for."""
        if self.fmt == "int8":
            return self.data.to(dtype) * self.scale.to(dtype)[:, None]
        if self.fmt == "int4":
            codes = unpack_int4(self.data).to(dtype)  # [N, G, 32]
            w = codes * self.scale.to(dtype)[..., None] + self.minimum.to(dtype)[..., None]
            return w.reshape(self.shape)
        if self.fmt == "q8_0":
            n, k = self.shape
            return (self.data.to(dtype).reshape(n, k // GROUP_SIZE, GROUP_SIZE)
                    * self.scale.to(dtype)[..., None]).reshape(n, k)
        return self.data.to(dtype)


def check_format(fmt: str) -> None:
    if fmt not in FORMATS:
        raise ValueError(f"unknown quantization format {fmt!r}: use one of {', '.join(FORMATS)}")


def quantize_weight(weight: torch.Tensor, fmt: str) -> QuantizedWeight:
    """Round a float weight [N, K] to ``fmt`` (round to nearest; see :class:`QuantizedWeight`)."""
    check_format(fmt)
    w = weight.detach().float()
    if fmt == "int8":  # symmetric: the largest |w| of each output row maps to 127
        scale = w.abs().amax(dim=1) / 127
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero row: any scale is exact
        data = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
        return QuantizedWeight("int8", data, scale)
    if fmt in ("int4", "q8_0"):
        n, k = w.shape
        if k % GROUP_SIZE:
            raise ValueError(f"{fmt} needs the input size to be a multiple of {GROUP_SIZE}, got {k}: "
                             f"use int8 for this layer")
        groups = w.reshape(n, k // GROUP_SIZE, GROUP_SIZE)
    if fmt == "q8_0":  # symmetric per group: its largest |w| maps to 127, the scale stored in float16
        scale = (groups.abs().amax(dim=-1) / 127).half()
        s = scale.float()[..., None]
        codes = torch.where(s > 0, torch.round(groups / torch.where(s > 0, s, 1)), 0)
        return QuantizedWeight("q8_0", codes.clamp_(-127, 127).to(torch.int8).reshape(n, k), scale)
    if fmt == "int4":
        lo, hi = groups.amin(dim=-1), groups.amax(dim=-1)
        scale, minimum = ((hi - lo) / 15).half(), lo.half()  # stored in float16, so round with those values
        s = scale.float()[..., None]
        codes = torch.where(s > 0, torch.round((groups - minimum.float()[..., None]) / torch.where(s > 0, s, 1)), 0)
        return QuantizedWeight("int4", pack_int4(codes.clamp_(0, 15).to(torch.uint8)), scale, minimum)
    return QuantizedWeight(fmt, w.to(getattr(torch, fmt)).contiguous())


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """Codes [..., 32] in 0..15 -> bytes [..., 16]: byte j = code j | code (j+16) << 4 (GGUF Q4_1)."""
    if codes.shape[-1] != GROUP_SIZE:
        raise ValueError(f"int4 groups hold {GROUP_SIZE} codes, got {codes.shape[-1]}")
    low, high = codes[..., :16].to(torch.uint8), codes[..., 16:].to(torch.uint8)
    return low | (high << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """Bytes [..., 16] -> codes [..., 32], the inverse of :func:`pack_int4`."""
    return torch.cat([packed & 15, packed >> 4], dim=-1)


Q4_1_BLOCK_BYTES = 20  # GGUF's Q4_1 block: float16 scale, float16 minimum, 16 bytes of codes for 32 weights


def from_gguf_q4_1(raw: torch.Tensor, shape: tuple[int, int]) -> QuantizedWeight:
    """A GGUF Q4_1 tensor's bytes (uint8, [N, K/32 * 20]) as an int4 :class:`QuantizedWeight`, with no float detour.

    Each 20-byte block is the scale (float16), the minimum (float16) and the 16
    bytes of codes in the order :func:`pack_int4` uses, so the bytes are only cut apart.
    """
    n, k = shape
    if k % GROUP_SIZE or raw.dtype != torch.uint8 or raw.numel() != n * k // GROUP_SIZE * Q4_1_BLOCK_BYTES:
        raise ValueError(f"a Q4_1 tensor of shape {shape} is {n * k // GROUP_SIZE * Q4_1_BLOCK_BYTES} bytes of uint8 "
                         f"with K a multiple of {GROUP_SIZE}; got {raw.numel()} {raw.dtype}")
    blocks = raw.reshape(n, k // GROUP_SIZE, Q4_1_BLOCK_BYTES)
    halves = blocks[..., :4].contiguous().view(torch.float16)  # [N, G, 2]: scale, minimum
    return QuantizedWeight("int4", blocks[..., 4:].contiguous(), halves[..., 0].contiguous(),
                           halves[..., 1].contiguous())


Q8_0_BLOCK_BYTES = 34  # GGUF's Q8_0 block: float16 scale, 32 int8 codes


def from_gguf_q8_0(raw: torch.Tensor, shape: tuple[int, int]) -> QuantizedWeight:
    """A GGUF Q8_0 tensor's bytes (uint8, [N, K/32 * 34]) as a q8_0 :class:`QuantizedWeight`, with no float detour."""
    n, k = shape
    if k % GROUP_SIZE or raw.dtype != torch.uint8 or raw.numel() != n * k // GROUP_SIZE * Q8_0_BLOCK_BYTES:
        raise ValueError(f"a Q8_0 tensor of shape {shape} is {n * k // GROUP_SIZE * Q8_0_BLOCK_BYTES} bytes of uint8 "
                         f"with K a multiple of {GROUP_SIZE}; got {raw.numel()} {raw.dtype}")
    blocks = raw.reshape(n, k // GROUP_SIZE, Q8_0_BLOCK_BYTES)
    scale = blocks[..., :2].contiguous().view(torch.float16)[..., 0]
    return QuantizedWeight("q8_0", blocks[..., 2:].contiguous().view(torch.int8).reshape(n, k), scale.contiguous())


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
    """

    name: str
    formats: tuple[str, ...]
    devices: tuple[str, ...]
    prepare: Callable[[QuantizedWeight], object]
    run: Callable[[torch.Tensor, object], torch.Tensor]
    unprepare: Callable[[object], QuantizedWeight]
    exact: bool = True
    doc: str = ""


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


@dataclass
class _Interleaved:
    """A stored weight in the q8 kernels' layout (:func:`cpu_kernels.interleave`: rows in blocks of 4, read as one stream)."""

    fmt: str
    rows: int
    data: torch.Tensor
    scale: torch.Tensor
    minimum: torch.Tensor | None


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


def _cpp_q8_run(x: torch.Tensor, w: _Interleaved) -> torch.Tensor:
    x32 = x.float().contiguous()
    if w.fmt in ("int8", "q8_0"):
        return cpu_kernels.int8q8_linear(x32, w.data, w.scale, w.rows).to(x.dtype)
    return cpu_kernels.int4q8_linear(x32, w.data, w.scale, w.minimum, w.rows).to(x.dtype)


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
    Kernel("cpp", ("int8", "int4"), ("cpu",), _same, _cpp_run, _same,
           doc="enginelib.speed.cpu_kernels: our C++ loop, codes dequantized in AVX2 registers, float32 accumulation"),
    Kernel("cpp_q8", ("int8", "int4", "q8_0"), ("cpu",), _interleave, _cpp_q8_run, _deinterleave, exact=False,
           doc="our C++ loop with activations rounded to int8 per group of 32 and integer products (llama.cpp's way), "
               "weights interleaved in blocks of 4 rows"),
)}


def kernel_unavailable(name: str, fmt: str, shape: tuple[int, int], device: torch.device) -> str | None:
    """Why kernel ``name`` cannot run ``fmt`` at ``shape`` on ``device`` (None: it can)."""
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
    if name in ("cpp", "cpp_q8"):  # builds the kernels the first time it is asked (then cached on disk)
        return cpu_kernels.build_failure(device)
    return None


# ---------------------------------------------------------------- the layer

class QuantLinear(nn.Module):
    """A linear layer whose weight is stored in a quantized format and multiplied by one kernel."""

    def __init__(self, qw: QuantizedWeight, bias: torch.Tensor | None, kernel: str = "reference") -> None:
        super().__init__()
        self.out_features, self.in_features = qw.shape
        self.fmt, self.kernel = qw.fmt, KERNELS[kernel]
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
    rel_error: float  # ||y - y_reference|| / ||y_reference|| on a fixed random input
    chosen: bool = False
    rejected: str | None = None  # why it was not eligible (too inaccurate)

    @property
    def ms_per_token(self) -> float:
        """The score ``auto`` minimizes: time per token alone (decode) plus time per token in a batch of 32."""
        return self.ms_m1 + self.ms_m32 / 32


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


def measure_kernels(qw: QuantizedWeight, x: torch.Tensor) -> list[KernelTiming]:
    """Time every kernel that can run ``qw`` on ``x``'s device, at M=1 (decode) and M=32 rows of ``x``,
    and measure its error against the reference on all of ``x``."""
    rows = []
    want = _reference(x, qw)
    for name, kernel in KERNELS.items():
        if kernel_unavailable(name, qw.fmt, qw.shape, x.device):
            continue
        prepared = kernel.prepare(qw)
        rows.append(KernelTiming(qw.fmt, qw.shape, name, _time_ms(lambda: kernel.run(x[:1], prepared), x.device),
                                 _time_ms(lambda: kernel.run(x[:32], prepared), x.device),
                                 relative_error(kernel.run(x, prepared), want)))
    return rows


def choose(rows: list[KernelTiming], tolerance: float) -> KernelTiming:
    """Mark and return the fastest row whose error is within ``tolerance`` (the reference always is)."""
    for row in rows:
        row.rejected = None if row.rel_error <= tolerance else f"error {row.rel_error:.2g} > tolerance {tolerance:g}"
    best = min((r for r in rows if r.rejected is None or r.kernel == "reference"), key=lambda r: r.ms_per_token)
    best.chosen = True
    return best


@torch.inference_mode()
def layer_inputs(model: Transformer, token_ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """What each linear layer of ``model`` receives when the model reads ``token_ids`` [1, T]: rows [T, K]."""
    seen: dict[str, torch.Tensor] = {}
    hooks = [module.register_forward_pre_hook(
                 lambda _, args, name=name: seen.setdefault(name, args[0].reshape(-1, args[0].shape[-1]).clone()))
             for name, module in model.named_modules() if isinstance(module, (nn.Linear, QuantLinear))]
    try:
        model(token_ids.to(model.device))
    finally:
        for hook in hooks:
            hook.remove()
    return seen


# ---------------------------------------------------------------- converting a model

@dataclass
class QuantInfo:
    """What :func:`quantize` did: the kernel per (format, weight shape), and the measurements behind it."""

    fmt: str
    head_fmt: str
    kernel: str
    kernels: dict[tuple[str, tuple[int, int]], str] = field(default_factory=dict)
    timings: list[KernelTiming] = field(default_factory=list)
    # ``auto``: kernels written for these formats on this device that could not run, and why
    # (e.g. ``cpp`` when no C++ compiler is installed), so a missing speed-up is explained
    skipped: dict[str, str] = field(default_factory=dict)


def _linears(model: nn.Module) -> list[tuple[str, nn.Module, str, nn.Linear]]:
    return [(f"{prefix}.{name}".lstrip("."), parent, name, child) for prefix, parent in model.named_modules()
            for name, child in parent.named_children() if isinstance(child, nn.Linear)]


def _clone_structure(model: nn.Module) -> nn.Module:
    """A new module tree sharing the original's tensors (no weight is copied)."""
    memo = {id(t): t for t in (*model.parameters(), *model.buffers())}
    memo.update({id(m.packed): m.packed for m in model.modules() if hasattr(m, "packed")})
    return copy.deepcopy(model, memo)


def quantize(model: Transformer, fmt: str, kernel: str = "auto", *, head: str | None = None,
             tolerance: float = 1e-2, calibration: torch.Tensor | None = None) -> Transformer:
    """A NEW model whose linear layers (LM head included) hold ``fmt`` weights; ``model`` is left as it was.

    A new model, not an in-place conversion, because the chapter compares the
    formats with the float model side by side (perplexity, greedy agreement).
    The new model shares every tensor it keeps in float (embedding, norms) with
    the original, so it costs only its quantized weights. Quantize on the device
    the model will run on: kernels lay weights out for it.

    ``head``: the LM head's format (default ``fmt``). The shipped GGUF keeps its
    tied embedding in Q8_0 beside Q4_1 layers, as llama.cpp's files usually do:
    ``quantize(model, "int4", head="int8")`` is that mix.

    ``kernel``: ``"auto"`` runs the float model once on ``calibration`` token ids
    (default: 32 random ids, seeded) to get the inputs every linear layer really
    sees (their outlier channels matter: a kernel that rounds activations looks
    fine on random inputs and is not on these). For each distinct (format, shape)
    it times every kernel that runs here on those rows (M=1 and M=32), measures
    each kernel's relative error against the reference (an exact kernel's on the
    first layer of that shape, one that also rounds activations on every layer
    of that shape, where outliers differ), and keeps the fastest (least :attr:`KernelTiming.ms_per_token`) whose
    worst error is within ``tolerance``. ``"reference"`` or another name in
    :data:`KERNELS` uses that kernel everywhere. What was chosen, and the
    measurements, are in ``new.quant_info``.
    """
    head = head or fmt
    for f in (fmt, head):
        check_format(f)
    _check_kernel(kernel)
    if any(isinstance(m, QuantLinear) for m in model.modules()):
        raise ValueError("this model is already quantized: quantize the float model instead")
    device = model.device
    if "bfloat16" in (fmt, head) and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise ValueError(f"{torch.cuda.get_device_name(device)} has no bfloat16 support: use float16")
    weights = {path: quantize_weight(linear.weight, head if path == "lm_head" else fmt)
               for path, _, _, linear in _linears(model)}
    inputs = _calibration_inputs(model, calibration) if kernel == "auto" else None
    info = choose_kernels(QuantInfo(fmt, head, kernel), weights, inputs, device, tolerance)
    new = _clone_structure(model)
    for path, _, _, linear in _linears(model):  # a tied head becomes its own layer; the embedding stays a float table
        _put(new, path, QuantLinear(weights[path], linear.bias, info.kernels[_key(weights[path])]))
    new.quant_info = info
    return new.eval().requires_grad_(False)


def _check_kernel(kernel: str) -> None:
    if kernel != "auto" and kernel not in KERNELS:
        raise ValueError(f"unknown kernel {kernel!r}: use 'auto' or one of {', '.join(KERNELS)}")


def _key(qw: QuantizedWeight) -> tuple[str, tuple[int, int]]:
    return qw.fmt, qw.shape


def _put(model: nn.Module, path: str, layer: nn.Module) -> None:
    parent, _, name = path.rpartition(".")
    setattr(model.get_submodule(parent), name, layer)


def _calibration_inputs(model: Transformer, calibration: torch.Tensor | None) -> dict[str, torch.Tensor]:
    if calibration is None:
        calibration = torch.randint(0, model.cfg.vocab_size, (1, 32), generator=torch.Generator().manual_seed(0))
    return layer_inputs(model, calibration.reshape(1, -1))


def choose_kernels(info: QuantInfo, weights: dict[str, QuantizedWeight], inputs: dict[str, torch.Tensor] | None,
                   device: torch.device, tolerance: float = 1e-2) -> QuantInfo:
    """Fill ``info.kernels``: a kernel per (format, shape) of ``weights`` (layer path -> stored weight).

    With ``info.kernel == "auto"`` each kernel is timed on the first layer of a shape and its error measured
    on ``inputs`` (what each layer really receives; see :func:`quantize`); else ``info.kernel`` everywhere.
    """
    if info.kernel != "auto":
        for qw in weights.values():
            reason = kernel_unavailable(info.kernel, qw.fmt, qw.shape, device)
            if reason:
                raise ValueError(f"{reason}: use kernel='auto' or 'reference'")
            info.kernels[_key(qw)] = info.kernel
        return info
    rows: dict[tuple[str, tuple[int, int]], list[KernelTiming]] = {}
    for path, qw in weights.items():
        key, x = _key(qw), inputs[path]
        if key not in rows:
            rows[key] = measure_kernels(qw, x)
            continue
        inexact = [row for row in rows[key] if not KERNELS[row.kernel].exact]
        want = _reference(x, qw) if inexact else None
        for row in inexact:  # its worst error over every layer of this shape counts
            k = KERNELS[row.kernel]
            row.rel_error = max(row.rel_error, relative_error(k.run(x, k.prepare(qw)), want))
    for key, candidates in rows.items():
        info.kernels[key] = choose(candidates, tolerance).kernel
        info.timings += candidates
        for name, k in KERNELS.items():
            if key[0] in k.formats and device.type in k.devices and name not in info.skipped:
                reason = kernel_unavailable(name, *key, device)
                if reason:
                    info.skipped[name] = reason
    return info


# ---------------------------------------------------------------- a GGUF file's quantized tensors, as stored

GGUF_FORMATS = {"Q4_1": ("int4", from_gguf_q4_1), "Q8_0": ("q8_0", from_gguf_q8_0)}


def concat_rows(parts: list[QuantizedWeight]) -> QuantizedWeight:
    """Stored weights of one format stacked along the output rows, as the model fuses q/k/v and gate/up."""
    if len({qw.fmt for qw in parts}) != 1:
        raise ValueError(f"cannot stack {[qw.fmt for qw in parts]}: a fused layer has one format")
    cat = [None if parts[0].__dict__[f] is None else torch.cat([qw.__dict__[f] for qw in parts])
           for f in ("data", "scale", "minimum")]
    return QuantizedWeight(parts[0].fmt, *cat)


def _install(net: Transformer, weights: dict[str, QuantizedWeight], kernel: Callable[[QuantizedWeight], str]) -> None:
    for layer, qw in weights.items():
        _put(net, layer, QuantLinear(qw, net.get_submodule(layer).bias, kernel(qw)))


def load_quantized(model: str | os.PathLike = DEFAULT_MODEL, kernel: str = "auto", *,
                   device: str | torch.device | None = None, progress: bool = True,
                   tolerance: float = 1e-2) -> tuple[Transformer, Tokenizer]:
    """A GGUF file's model with its linear layers in the formats the file stores them in, and its tokenizer.

    Each Q4_1 matrix becomes an int4 layer and each Q8_0 one a q8_0 layer by
    cutting the file's blocks apart (:func:`from_gguf_q4_1`, :func:`from_gguf_q8_0`):
    no float copy of a layer is ever made, and the layers hold exactly the
    weights the file holds (``load_model`` dequantizes those same numbers to
    float32). The shipped file is Q4_1 with a Q8_0 tied embedding: int4 layers and
    a q8_0 LM head, the mix llama.cpp runs. The embedding lookup stays a float
    table, dequantized from the same bytes, as in :func:`quantize`; so do norms
    and biases. ``kernel`` as in :func:`quantize`: ``auto`` calibrates on the model
    itself, run with the reference kernel. A file whose layers are of other types
    (F16, Q4_K, ...) is refused: load it with ``load_model`` and :func:`quantize` it.
    """
    _check_kernel(kernel)
    path = resolve(model)
    if path.is_dir() or path.suffix != ".gguf":
        raise ValueError(f"{path} is not a .gguf file: load_quantized keeps a GGUF's quantized tensors as stored; "
                         "for another checkpoint use load_model() and quantize()")
    dev = pick_device(device)
    cfg, tensors, tokenizer = read_gguf(path, progress, device=dev, stored=tuple(GGUF_FORMATS))
    stored: dict[str, QuantizedWeight] = {}
    for name, t in list(tensors.items()):
        if isinstance(t, StoredTensor):
            stored[name] = GGUF_FORMATS[t.kind][1](t.data, t.shape)
            tensors[name] = torch.empty(t.shape, device="meta")  # the float model's layout, no memory
        elif t.dim() == 2 and name != "model.embed_tokens.weight":
            raise ValueError(f"{name} is not Q4_1 or Q8_0 in {path.name}: only {' and '.join(GGUF_FORMATS)} "
                             "tensors load straight into our formats; use load_model() and quantize() for this file")
    net = Transformer.from_state_dict(cfg, tensors, consume=True)  # norms, biases, embedding: real; linears: meta
    weights = {}
    for layer, _, _, _ in _linears(net):
        hf = "lm_head" if layer == "lm_head" else f"model.{layer}"
        parts = {"qkv_proj": "qkv", "gate_up_proj": ("gate", "up")}.get(layer.rpartition(".")[2])
        names = [f"{hf.rpartition('.')[0]}.{n}_proj.weight" for n in parts] if parts else [f"{hf}.weight"]
        weights[layer] = concat_rows([stored.pop(n) for n in names])
    if stored:
        raise ValueError(f"{path.name} holds tensors the model has no place for: {list(stored)[:5]}")
    info = QuantInfo("+".join(sorted({qw.fmt for layer, qw in weights.items() if layer != "lm_head"})),
                     weights["lm_head"].fmt, kernel)
    _install(net, weights, lambda qw: "reference")  # the model as stored, to calibrate the kernel choice on
    choose_kernels(info, weights, _calibration_inputs(net, None) if kernel == "auto" else None, dev, tolerance)
    _install(net, weights, lambda qw: info.kernels[_key(qw)])
    net.quant_info = info
    return net.eval().requires_grad_(False), tokenizer


# ---------------------------------------------------------------- quality and size

def shakespeare() -> str:
    """The public-domain text the repository ships for perplexity (see ``enginelib/data/README.md``)."""
    return (DATA_DIR / "shakespeare.txt").read_text(encoding="utf-8")


@dataclass
class Perplexity:
    """exp(mean negative log-likelihood) of the next token, over ``tokens`` scored tokens."""

    perplexity: float
    nll: float
    tokens: int


@torch.inference_mode()
def perplexity(model: Transformer, tokenizer, text: str | None = None, *, window: int = 256,
               max_tokens: int | None = None) -> Perplexity:
    """How surprised the model is by ``text`` (default: :func:`shakespeare`).

    The token ids are cut into non-overlapping windows of ``window`` tokens; each
    window runs without a cache, and every token after a window's first is scored
    on the tokens before it in that window. ``max_tokens`` keeps only the first
    that many token ids (a quick estimate). Same text and windows: comparable numbers.
    """
    if window < 2:
        raise ValueError(f"window must be at least 2 tokens (one to read, one to predict), got {window}")
    ids = tokenizer.encode(shakespeare() if text is None else text)[:max_tokens]
    if len(ids) < 2:
        raise ValueError("the text is shorter than 2 tokens: give a longer text or a larger max_tokens")
    total, count = 0.0, 0
    for start in range(0, len(ids) - 1, window):
        chunk = torch.tensor([ids[start:start + window]], device=model.device)
        if chunk.shape[1] < 2:
            break
        logits = model(chunk)[0, :-1].float()
        total += F.cross_entropy(logits, chunk[0, 1:], reduction="sum").item()
        count += chunk.shape[1] - 1
    return Perplexity(math.exp(total / count), total / count, count)


@dataclass
class GreedyAgreement:
    """Greedy tokens equal to the reference model's, counted up to each prompt's first divergence.

    ``matched[i]``: how many of prompt i's greedy tokens equal the reference's
    before the first that differs (all of them if none does); ``lengths[i]``: how
    many tokens the reference generated. ``agreement`` = sum(matched) / sum(lengths):
    1.0 means the same text for every prompt. Once two texts differ they go their
    own ways, so tokens after the first divergence are not compared.
    """

    matched: list[int]
    lengths: list[int]

    @property
    def agreement(self) -> float:
        return sum(self.matched) / max(1, sum(self.lengths))

    @property
    def identical(self) -> int:
        return sum(m == n for m, n in zip(self.matched, self.lengths))


def greedy_agreement(reference_model: Transformer, model: Transformer, tokenizer, prompts: list[str | list[int]],
                     max_tokens: int = 32) -> GreedyAgreement:
    """Greedy-decode each prompt with both models (Part I's cached generator); see :class:`GreedyAgreement`."""
    from enginelib.baselines.generate import generate_cached
    from enginelib.config import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    matched, lengths = [], []
    for prompt in prompts:
        ids = tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        want = generate_cached(reference_model, ids, params, tokenizer.eos_token_id).token_ids
        got = generate_cached(model, ids, params, tokenizer.eos_token_id).token_ids
        same = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), min(len(want), len(got)))
        matched.append(same)
        lengths.append(len(want))
    return GreedyAgreement(matched, lengths)


def _tensor_bytes(model: nn.Module) -> int:
    seen, total = set(), 0
    for t in (*model.parameters(), *model.buffers()):
        if id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


def weight_bytes(model: nn.Module) -> int:
    """Bytes of every weight the model holds: float tensors once each (a tied head counts once) plus stored quantized forms."""
    return _tensor_bytes(model) + sum(m.nbytes for m in model.modules() if isinstance(m, QuantLinear))


def linear_bytes_per_param(model: nn.Module) -> float:
    """Bytes per weight of the linear layers (LM head included), scales and minimums counted."""
    size = numel = 0
    for _, _, _, linear in _linears(model):
        size += linear.weight.numel() * linear.weight.element_size()
        numel += linear.weight.numel()
    for m in model.modules():
        if isinstance(m, QuantLinear):
            size, numel = size + m.nbytes, numel + m.in_features * m.out_features
    return size / numel


@dataclass
class FormatRow:
    """One row of chapter 11's table."""

    fmt: str
    bytes_per_param: float
    weight_bytes: int
    perplexity: float
    kernels: str  # which kernel ran each weight shape


def format_row(name: str, model: Transformer, tokenizer, text: str | None = None, *, window: int = 256,
               max_tokens: int | None = None) -> FormatRow:
    """Measure one model for the table: its size, and its perplexity on ``text`` (default: the shipped Shakespeare)."""
    info = getattr(model, "quant_info", None)
    kernels = "float" if info is None else ", ".join(sorted(set(info.kernels.values())))
    ppl = perplexity(model, tokenizer, text, window=window, max_tokens=max_tokens)
    return FormatRow(name, linear_bytes_per_param(model), weight_bytes(model), ppl.perplexity, kernels)


@torch.inference_mode()
def decode_tokens_per_second(model: Transformer, tokenizer, prompt: str = "Once upon a time",
                             max_tokens: int = 32) -> float:
    """Single-stream greedy decode speed: tokens after the first, divided by the time they took."""
    from enginelib.baselines.generate import generate_cached
    from enginelib.config import SamplingParams

    gen = generate_cached(model, tokenizer.encode(prompt), SamplingParams(temperature=0, max_tokens=max_tokens,
                                                                         ignore_eos=True))
    times = gen.token_times
    return (len(times) - 1) / (times[-1] - times[0])
