"""Converting a float model: :func:`quantize` makes a new model of :class:`QuantLinear` layers, and
:func:`quant_info` reads back what was chosen from those layers (nothing is added to a model object)."""
from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch
from torch import nn

from enginelib.model.transformer import Transformer
from enginelib.speed.quant.formats import QuantizedWeight, check_format, quantize_weight
from enginelib.speed.quant.kernels import (
    KernelChoice,
    KernelTiming,
    QuantLinear,
    WeightKey,
    check_kernel,
    choose_kernels,
    weight_key,
)


@dataclass
class QuantInfo:
    """What a quantized model holds: its formats, the kernel per (format, weight shape), and the
    measurements behind them (``auto``), gathered from its layers by :func:`quant_info`."""

    fmt: str  # the layers' format ("+"-joined if several)
    head_fmt: str
    kernel: str  # what was asked for: "auto" or a kernel name
    kernels: dict[WeightKey, str] = field(default_factory=dict)
    timings: list[KernelTiming] = field(default_factory=list)
    # ``auto``: kernels written for these formats on this device that could not run, and why
    # (e.g. ``cpp`` when no C++ compiler is installed), so a missing speed-up is explained
    skipped: dict[str, str] = field(default_factory=dict)


def quant_info(model: nn.Module) -> QuantInfo | None:
    """What :func:`quantize` or :func:`quant.load_quantized` chose for ``model`` (None: no quantized layer).

    Read from the :class:`QuantLinear` layers themselves, which know their format, kernel and how it was
    chosen: it holds for any copy of the model, and nothing is stored on the model object.
    """
    layers = [(path, m) for path, m in model.named_modules() if isinstance(m, QuantLinear)]
    if not layers:
        return None
    body = sorted({m.fmt for path, m in layers if path != "lm_head"})
    head = dict(layers).get("lm_head")
    fmt = "+".join(body) if body else head.fmt
    info = QuantInfo(fmt, head.fmt if head is not None else fmt,
                     "+".join(sorted({m.choice.requested for _, m in layers})))
    for _, m in layers:
        key = (m.fmt, (m.out_features, m.in_features))
        if key in info.kernels:
            continue
        info.kernels[key] = m.kernel.name
        info.timings += m.choice.timings
        for name, reason in m.choice.skipped.items():
            info.skipped.setdefault(name, reason)
    return info


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


def linear_layers(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    """Every float ``nn.Linear`` of ``model`` with its path (the LM head included): what quantizing converts."""
    return [(f"{prefix}.{name}".lstrip("."), child) for prefix, parent in model.named_modules()
            for name, child in parent.named_children() if isinstance(child, nn.Linear)]


def replace_layer(model: nn.Module, path: str, layer: nn.Module) -> None:
    """Put ``layer`` at ``path`` in ``model`` (a module tree this package built, never the caller's)."""
    parent, _, name = path.rpartition(".")
    setattr(model.get_submodule(parent), name, layer)


def calibration_inputs(model: Transformer, calibration: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """Each linear layer's input on ``calibration`` token ids (default: 32 random ids, seeded)."""
    if calibration is None:
        calibration = torch.randint(0, model.cfg.vocab_size, (1, 32), generator=torch.Generator().manual_seed(0))
    return layer_inputs(model, calibration.reshape(1, -1))


def install(net: nn.Module, weights: dict[str, QuantizedWeight], choices: dict[WeightKey, KernelChoice]) -> None:
    """Replace each layer of ``weights`` (path -> stored weight) by a :class:`QuantLinear` with its key's kernel."""
    for path, qw in weights.items():
        choice = choices[weight_key(qw)]
        replace_layer(net, path, QuantLinear(qw, net.get_submodule(path).bias, choice.kernel, choice))


def _clone_structure(model: nn.Module) -> nn.Module:
    """A new module tree sharing the original's tensors (no weight is copied)."""
    memo = {id(t): t for t in (*model.parameters(), *model.buffers())}
    memo.update({id(m.packed): m.packed for m in model.modules() if hasattr(m, "packed")})
    return copy.deepcopy(model, memo)


def bfloat16_unavailable(device: torch.device) -> str | None:
    """Why ``device`` cannot run bfloat16 weights at full speed (None: it can; a CPU always can).

    A GPU computes in bfloat16 natively from compute capability 8.0 (Ampere) on. Older ones (a T4 is
    7.5) only emulate it: it runs, slowly, and nothing says so. Plain
    ``torch.cuda.is_bf16_supported()`` counts that emulation as support; ``including_emulation=False``
    does not (a torch without the keyword: the compute capability decides, as it does inside).
    """
    if device.type != "cuda":
        return None
    with torch.cuda.device(device):  # is_bf16_supported asks about the current device
        try:
            native = torch.cuda.is_bf16_supported(including_emulation=False)
        except TypeError:  # a torch before the keyword
            native = bool(torch.version.hip) or torch.cuda.get_device_capability(device) >= (8, 0)
    if native:
        return None
    major, minor = torch.cuda.get_device_capability(device)
    return (f"{torch.cuda.get_device_name(device)} (compute capability {major}.{minor}) has no native bfloat16: "
            "torch would only emulate it, slowly; use float16 on this GPU "
            "(bfloat16 needs compute capability 8.0 or newer)")


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
    measurements, are in ``quant_info(new)``.
    """
    head = head or fmt
    for f in (fmt, head):
        check_format(f)
    check_kernel(kernel)
    if any(isinstance(m, QuantLinear) for m in model.modules()):
        raise ValueError("this model is already quantized: quantize the float model instead")
    device = model.device
    if "bfloat16" in (fmt, head) and (why := bfloat16_unavailable(device)):
        raise ValueError(why)
    weights = {path: quantize_weight(linear.weight, head if path == "lm_head" else fmt)
               for path, linear in linear_layers(model)}
    inputs = calibration_inputs(model, calibration) if kernel == "auto" else None
    choices = choose_kernels(kernel, weights, inputs, device, tolerance, model.dtype)
    new = _clone_structure(model)
    install(new, weights, choices)  # a tied head becomes its own layer; the embedding stays a float table
    return new.eval().requires_grad_(False)
