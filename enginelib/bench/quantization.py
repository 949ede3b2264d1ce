"""The ``quant`` section: int8 and int4 weights against the float model (chapter 13)."""
from __future__ import annotations

import time

from enginelib.bench.quality import decode_tokens_per_second, linear_bytes_per_param, perplexity, weight_bytes
from enginelib.model.tokenizer import Tokenizer
from enginelib.model.transformer import Transformer
from enginelib.speed.quant import kernel_unavailable, quant_info, quantize


def quant_effect(model: Transformer, tok: Tokenizer, quick: bool, kernel: str = "auto") -> dict:
    """int8 and int4 against the model as loaded: single-stream decode tok/s ratio and perplexity change.

    Perplexity is on the shipped Shakespeare (its first 256 tokens quick, 2048
    full), decode speed from :func:`quality.decode_tokens_per_second`. ``ppl_delta``
    is relative (0.006 = +0.6%). ``kernels``: what ``quantize`` chose per weight shape.
    """
    ppl_tokens, new = (256, 8) if quick else (2048, 64)

    def figures(m: Transformer) -> dict:
        return {"ppl": perplexity(m, tok, max_tokens=ppl_tokens).perplexity,
                "tok_per_s": decode_tokens_per_second(m, tok, max_tokens=new),
                "bytes_per_param": linear_bytes_per_param(m), "weight_bytes": weight_bytes(m)}

    decode_tokens_per_second(model, tok, max_tokens=2)  # warm-up
    base = figures(model)
    report: dict = {"float": {**base, "dtype": str(model.dtype).removeprefix("torch.")}, "kernel": kernel,
                    "ppl_tokens": ppl_tokens, "decode_tokens": new,
                    "note": "kernels chosen by timing the candidates per weight shape" if kernel == "auto" else
                            f"kernel {kernel!r} everywhere (not timed against the others: run with "
                            "--quant-kernel auto, the full run's default, for the fastest exact kernels)"}
    for fmt in ("int8", "int4"):
        start = time.perf_counter()
        q = quantize(model, fmt, kernel)
        took = time.perf_counter() - start
        decode_tokens_per_second(q, tok, max_tokens=2)  # warm-up
        row = figures(q)
        report[fmt] = {**row, "tok_per_s_ratio": row["tok_per_s"] / base["tok_per_s"],
                       "ppl_delta": row["ppl"] / base["ppl"] - 1, "quantize_s": took,
                       "kernels": {f"{shape[0]}x{shape[1]}": name
                                   for (_, shape), name in sorted(quant_info(q).kernels.items())}}
        del q
    return report


def int4_model(model: Transformer, kernel: str) -> tuple[Transformer, str]:
    """The GGUF's own mix (int4 layers, int8 head), with integer-product kernels (``cpp_q8``, llama.cpp's
    way) where they build, else ``kernel``; and its description."""
    if kernel_unavailable("cpp_q8", "int4", (32, 32), model.device) is None:
        kernel = "cpp_q8"
    small = quantize(model, "int4", kernel, head="int8")
    return small, f"int4 layers, int8 head ({', '.join(sorted(set(quant_info(small).kernels.values())))} kernels)"
