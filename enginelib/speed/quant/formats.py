"""The stored forms of a quantized weight (:class:`QuantizedWeight`) and rounding a float weight into them.

Kept apart from the kernels that multiply by them (:mod:`enginelib.speed.quant.kernels`) because a format is
data: GGUF files, the kernels and the chapter's hand-written code all agree on these layouts.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

FORMATS = ("int8", "int4", "q8_0", "float16", "bfloat16")
GROUP_SIZE = 32  # int4: weights per (scale, minimum) pair, as GGUF's Q4_1


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
    """Refuse an unknown format with the list of known ones (before any work is done)."""
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



def concat_rows(parts: list[QuantizedWeight]) -> QuantizedWeight:
    """Stored weights of one format stacked along the output rows, as the model fuses q/k/v and gate/up."""
    if len({qw.fmt for qw in parts}) != 1:
        raise ValueError(f"cannot stack {[qw.fmt for qw in parts]}: a fused layer has one format")
    cat = [None if parts[0].__dict__[f] is None else torch.cat([qw.__dict__[f] for qw in parts])
           for f in ("data", "scale", "minimum")]
    return QuantizedWeight(parts[0].fmt, *cat)

