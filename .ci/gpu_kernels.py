"""The Triton kernels against what they replace, on this GPU: gpu_check.sh's kernel micro-benchmark.

    python .ci/gpu_kernels.py _build/gpu/kernels.json            # every shape, float32 and the GPU's half dtype
    python .ci/gpu_kernels.py OUT.json --dtypes float16 --quick  # fewer shapes

- int8 and int4 weight-only linears at SmolLM2-135M's shapes, M = 1 and 32 rows: our Triton kernel, the
  reference (dequantize, then ``F.linear``) and cuBLAS on the float weight (``F.linear``, what the float model runs);
- paged decode attention, batch 1 and 32, 512 and 2048 keys: our Triton kernel and the gather + SDPA the engine
  runs without it (every key copied into a dense tensor per layer per step).

Each Triton result is checked against the reference in float32. A row fails when its Triton kernel cannot run
here (no Triton, an old GPU, Triton disabled by ``GPU_CHECK_DISABLE_TRITON``), raises, or is off by more than
its tolerance: the benchmark never times a stand-in in its place. Exit status 1 when a row failed.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from enginelib.speed.quant import QuantizedWeight, quantize_weight
from enginelib.speed.quant.kernels import KERNELS

# (N, K) of SmolLM2-135M's linears: qkv, o, gate_up, down, the LM head
LINEAR_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576)]
ROWS = (1, 32)
ATTENTION = [(1, 512), (1, 2048), (32, 512), (32, 2048)]  # (sequences, keys each)
HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16  # SmolLM2-135M's attention, the engine's block size
reference = KERNELS["reference"].run  # dequantize, then F.linear: quant's oracle


def tolerance(dtype: torch.dtype) -> float:
    """The relative error a kernel may have against the float32 reference: rounding of its dtype, no more."""
    return 1e-4 if dtype == torch.float32 else 2e-2


@dataclass
class Row:
    """One kernel at one shape: microseconds per call of each implementation, Triton's error, the verdict."""

    kernel: str  # "int8 linear", "int4 linear", "decode attention"
    shape: str
    dtype: str
    us: dict[str, float] = field(default_factory=dict)  # implementation -> median microseconds
    error: float | None = None  # Triton's relative error against the float32 reference
    tolerance: float = 0.0
    ok: bool = False
    why: str = ""  # a failed row: why


def time_us(fn: Callable[[], object], device: torch.device, repeats: int = 30) -> float:
    """Median microseconds of ``fn`` after a warm-up call (which compiles a Triton variant): CUDA events on a GPU."""
    fn()
    if device.type != "cuda":
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e6)
        return statistics.median(times)
    torch.cuda.synchronize(device)
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(repeats)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize(device)
    return statistics.median(start.elapsed_time(end) * 1e3 for start, end in events)


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    want = want.float()
    return ((got.float() - want).norm() / want.norm().clamp_min(1e-30)).item()


def _triton(dtype: torch.dtype, device: torch.device):
    """The Triton kernels' module, or the sentence saying why they cannot run here."""
    from enginelib.speed import triton_kernels

    return triton_kernels.unavailable(device, dtype) or triton_kernels


def _measure(row: Row, device: torch.device, want: torch.Tensor, triton_call: Callable[[], torch.Tensor] | None,
             why_not: str | None, others: dict[str, Callable[[], object]]) -> Row:
    """Time ``others`` and the Triton call; check Triton's output against ``want``; the verdict in ``row``."""
    for name, fn in others.items():
        row.us[name] = time_us(fn, device)
    if why_not:
        row.why = f"Triton cannot run here: {why_not}"
        return row
    try:
        row.error = relative_error(triton_call(), want)
        row.us["triton"] = time_us(triton_call, device)
    except Exception as error:  # noqa: BLE001 - a kernel that fails is the row's verdict, the benchmark goes on
        row.why = f"the Triton kernel raised {type(error).__name__}: {str(error).strip()[:300]}"
        return row
    row.ok = row.error <= row.tolerance
    if not row.ok:
        row.why = f"Triton's result is off: relative error {row.error:.2g} > {row.tolerance:g}"
    return row


def linear_rows(device: torch.device, dtype: torch.dtype, shapes=LINEAR_SHAPES, rows=ROWS) -> list[Row]:
    """int8 and int4 weight-only linears: Triton against the reference and cuBLAS on the float weight."""
    out = []
    generator = torch.Generator().manual_seed(0)
    kernels = _triton(dtype, device)
    why_not = kernels if isinstance(kernels, str) else None
    for n, k in shapes:
        weight = torch.randn(n, k, generator=generator) * 0.05
        for fmt in ("int8", "int4"):
            stored = quantize_weight(weight, fmt)
            qw = QuantizedWeight(fmt, *(None if t is None else t.to(device) for t in
                                        (stored.data, stored.scale, stored.minimum)))
            dense = qw.dequantize(dtype)  # what an unquantized model holds
            for m in rows:
                x = torch.randn(m, k, generator=generator).to(device, dtype)
                want = reference(x.float(), qw)
                call = None
                if why_not is None:
                    call = ((lambda: kernels.int8_linear(x, qw.data, qw.scale)) if fmt == "int8" else
                            (lambda: kernels.int4_linear(x, qw.data, qw.scale, qw.minimum)))
                row = Row(f"{fmt} linear", f"M={m}, {n}x{k}", str(dtype).removeprefix("torch."),
                          tolerance=tolerance(dtype))
                others = {"reference": lambda: reference(x, qw), "cuBLAS float": lambda: F.linear(x, dense)}
                out.append(_measure(row, device, want, call, why_not, others))
    return out


def _gather_sdpa(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, tables: torch.Tensor,
                 keys: int) -> torch.Tensor:
    """The engine's way without the kernel: copy every sequence's keys and values out of the pool, then SDPA."""
    seqs, groups = q.shape[0], q.shape[1] // k_pool.shape[2]
    k, v = (pool.index_select(0, tables.flatten()).view(seqs, -1, KV_HEADS, HEAD_DIM)[:, :keys].transpose(1, 2)
            .repeat_interleave(groups, dim=1) for pool in (k_pool, v_pool))
    return F.scaled_dot_product_attention(q[:, :, None], k, v)[:, :, 0]


def attention_rows(device: torch.device, dtype: torch.dtype, sizes=ATTENTION) -> list[Row]:
    """Paged decode attention: Triton against the gather + SDPA (both read the same pool through the same tables)."""
    out = []
    generator = torch.Generator().manual_seed(1)
    kernels = _triton(dtype, device)
    why_not = kernels if isinstance(kernels, str) else None
    for seqs, keys in sizes:
        per_seq = -(-keys // BLOCK)
        k_pool, v_pool = (torch.randn(seqs * per_seq, BLOCK, KV_HEADS, HEAD_DIM, generator=generator).to(device, dtype)
                          for _ in range(2))
        tables = torch.randperm(seqs * per_seq, generator=generator).view(seqs, per_seq).to(device)
        lens = torch.full((seqs,), keys, dtype=torch.int64, device=device)
        q = torch.randn(seqs, HEADS, HEAD_DIM, generator=generator).to(device, dtype)
        last = tables[:, (keys - 1) // BLOCK] * BLOCK + (keys - 1) % BLOCK
        k_new, v_new = (pool.flatten(0, 1)[last].clone() for pool in (k_pool, v_pool))  # rewrites what is there
        want = _gather_sdpa(q.float(), k_pool.float(), v_pool.float(), tables, keys)
        call = None
        if why_not is None:
            call = lambda: kernels.decode_attention(q, k_new, v_new, k_pool, v_pool, tables, lens)  # noqa: E731
        row = Row("decode attention", f"{seqs} x {keys} keys", str(dtype).removeprefix("torch."),
                  tolerance=tolerance(dtype))
        out.append(_measure(row, device, want, call, why_not,
                            {"gather + SDPA": lambda: _gather_sdpa(q, k_pool, v_pool, tables, keys)}))
    return out


def run(device: torch.device, dtypes: list[torch.dtype], quick: bool = False) -> list[Row]:
    """Every row, each dtype in turn (``quick``: the first linear shape and the smallest attention only)."""
    rows = []
    for dtype in dtypes:
        rows += linear_rows(device, dtype, LINEAR_SHAPES[:1] if quick else LINEAR_SHAPES, ROWS[:1] if quick else ROWS)
        rows += attention_rows(device, dtype, ATTENTION[:1] if quick else ATTENTION)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path, help="the JSON file of rows")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtypes", default=None, help="comma-separated (default: float32 and the GPU's half dtype)")
    ap.add_argument("--quick", action="store_true", help="one shape of each kernel")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if args.dtypes:
        names = args.dtypes.split(",")
    else:
        half = "bfloat16" if device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 0) else "float16"
        names = ["float32", half]
    rows = run(device, [getattr(torch, name) for name in names], args.quick)
    args.out.write_text(json.dumps([asdict(r) for r in rows], indent=1))
    for r in rows:
        times = ", ".join(f"{name} {us:.1f}" for name, us in r.us.items())
        print(f"{'ok    ' if r.ok else 'FAILED'} {r.kernel:>16} {r.dtype:>8} {r.shape:>22}: {times} us"
              + ("" if r.ok else f": {r.why}"), flush=True)
    return 0 if all(r.ok for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
