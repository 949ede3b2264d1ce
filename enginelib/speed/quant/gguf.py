"""A GGUF file's quantized tensors, as stored: Q4_1 and Q8_0 blocks cut apart into int4 and q8_0 weights,
never a float copy of a layer (what llama.cpp reads is what the engine multiplies by)."""
from __future__ import annotations

import os

import torch

from enginelib.model.device import pick_device
from enginelib.model.tokenizer import Tokenizer
from enginelib.model.transformer import Transformer
from enginelib.model.weights import DEFAULT_MODEL, StoredTensor, read_gguf, resolve
from enginelib.speed.quant.convert import calibration_inputs, install, linear_layers
from enginelib.speed.quant.formats import GROUP_SIZE, QuantizedWeight, concat_rows
from enginelib.speed.quant.kernels import KernelChoice, check_kernel, choose_kernels, weight_key

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




GGUF_FORMATS = {"Q4_1": ("int4", from_gguf_q4_1), "Q8_0": ("q8_0", from_gguf_q8_0)}  # GGUF type -> ours, reader


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
    check_kernel(kernel)
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
    for layer, _ in linear_layers(net):
        hf = "lm_head" if layer == "lm_head" else f"model.{layer}"
        parts = {"qkv_proj": "qkv", "gate_up_proj": ("gate", "up")}.get(layer.rpartition(".")[2])
        names = [f"{hf.rpartition('.')[0]}.{n}_proj.weight" for n in parts] if parts else [f"{hf}.weight"]
        weights[layer] = concat_rows([stored.pop(n) for n in names])
    if stored:
        raise ValueError(f"{path.name} holds tensors the model has no place for: {list(stored)[:5]}")
    as_stored = {weight_key(qw): KernelChoice("reference", "reference") for qw in weights.values()}
    install(net, weights, as_stored)  # the model as stored, to calibrate the kernel choice on
    inputs = calibration_inputs(net, None) if kernel == "auto" else None
    install(net, weights, choose_kernels(kernel, weights, inputs, dev, tolerance, net.dtype))
    return net.eval().requires_grad_(False), tokenizer
