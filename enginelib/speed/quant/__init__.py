"""Smaller weights, same model: int8 and int4 weight-only quantization, float16 and bfloat16 (chapter 13).

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

What the measurements say depends on the machine, so the layers keep them (:func:`quant_info`).
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
an H200 with torch 2.11), and our ``triton`` kernel for int8 and int4
(:mod:`enginelib.speed.triton_kernels`: the bytes dequantized in registers, where Triton is installed).

The package, by job: :mod:`.formats` (the stored forms), :mod:`.kernels` (the kernels, the layer, choosing
by measurement), :mod:`.convert` (:func:`quantize`, :func:`quant_info`), :mod:`.gguf` (:func:`load_quantized`).
Measuring a model's quality and size (perplexity, greedy agreement, bytes) is the benchmark's job:
:mod:`enginelib.bench.quality`.
"""
from enginelib.speed.quant.convert import (
    QuantInfo,
    bfloat16_unavailable,
    calibration_inputs,
    layer_inputs,
    linear_layers,
    quant_info,
    quantize,
)
from enginelib.speed.quant.formats import (
    FORMATS,
    GROUP_SIZE,
    QuantizedWeight,
    check_format,
    concat_rows,
    pack_int4,
    quantize_weight,
    unpack_int4,
)
from enginelib.speed.quant.gguf import (
    GGUF_FORMATS,
    Q4_1_BLOCK_BYTES,
    Q8_0_BLOCK_BYTES,
    from_gguf_q4_1,
    from_gguf_q8_0,
    load_quantized,
)
from enginelib.speed.quant.kernels import (
    KERNELS,
    Kernel,
    KernelChoice,
    KernelTiming,
    QuantLinear,
    check_kernel,
    choose,
    choose_kernels,
    kernel_unavailable,
    measure_kernels,
    relative_error,
    weight_key,
)

__all__ = [
    "FORMATS", "GGUF_FORMATS", "GROUP_SIZE", "KERNELS", "Kernel", "KernelChoice", "KernelTiming", "Q4_1_BLOCK_BYTES",
    "Q8_0_BLOCK_BYTES", "QuantInfo", "QuantLinear", "QuantizedWeight", "bfloat16_unavailable", "calibration_inputs",
    "check_format",
    "check_kernel", "choose", "choose_kernels", "concat_rows", "from_gguf_q4_1", "from_gguf_q8_0",
    "kernel_unavailable", "layer_inputs", "linear_layers", "load_quantized", "measure_kernels", "pack_int4",
    "quant_info", "quantize", "quantize_weight", "relative_error", "unpack_int4", "weight_key",
]
