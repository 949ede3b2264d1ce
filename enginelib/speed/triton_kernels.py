"""Triton kernels for the GPU path: a decode step's paged attention, and int8/int4 weight-only matmuls.

Why Triton: a T4 has no FlashAttention-2 and torch's weight-only ops are few on CUDA, so a decode step either
gathers every key into a dense tensor for SDPA (a copy of the whole context per layer per step) or
dequantizes a whole weight before cuBLAS multiplies it (a float copy written and read again). These kernels
read what lies in memory, once: the keys through the block tables, the int8/int4 bytes with their scales.
They are the GPU twins of :mod:`enginelib.speed.cpu_kernels` (same contracts), written in Python-like
Triton, so the chapters can show them whole.

- :func:`decode_attention` (q [S, H, D], the step's k, v [S, KV, D], one layer's pools
  [num_blocks, block_size, KV, D], block_tables [S, width], context_lens [S]): the contract of the C++
  ``torch.ops.enginelib.decode_attention``. One program per (sequence, KV head) serves that head's
  H / KV query heads (grouped-query attention: each key is read once for all of them). It walks the
  sequence's blocks through its table, one block of keys per iteration, with an online softmax (a running
  maximum and sum per head, the output rescaled as the maximum grows), so nothing is gathered or padded.
  The new token's k, v are written to their slot, and the kernel takes them from its arguments for the
  last position instead of reading them back (no write-then-read ordering inside a program).
  A sequence with no keys (0) is a padding row: nothing is written, its output is zeros. Where those
  programs are too few to keep the GPU busy (a batch of 1: 3 programs for SmolLM2's 3 KV heads), each
  sequence's blocks are split into shares, one program each, and a second kernel merges the shares'
  maxima, sums and outputs (flash-decoding's split; :func:`partitions` decides).
- :func:`int8_linear` and :func:`int4_linear`: ``x [M, K] @ W.T`` with W stored as quant's int8
  (int8 [N, K], float32 scale [N]) or int4 (GGUF Q4_1: uint8 [N, K/32, 16], float16 scale and minimum
  [N, K/32], ``w = code * scale + minimum``, byte j of a group holding codes j and j + 16). One program
  per tile of output rows (and of activation rows for M > 16) walks K: it loads the bytes, turns them into
  x's dtype in registers and multiply-adds them on the tensor cores (``tl.dot``, float32 accumulation;
  float32 inputs multiply in IEEE float32, not TF32, to stay within rounding of the reference). For int4
  the byte index ``c`` is the loop's axis: its low nibble is input ``32 (c // 16) + c % 16``, its high
  nibble that plus 16, so the bytes are read in order and two dots (low, high) use the matching columns of
  x. Registered as quant's ``triton`` kernel on CUDA, where ``auto`` times it against the others.

Triton compiles for the GPU; with ``TRITON_INTERPRET=1`` in the environment from before Triton is first
imported until the kernels have run, it runs the same kernels on CPU tensors with numpy (slowly): that is
how tests/test_triton.py checks them on a machine without a GPU, and the only place CI runs them.
:func:`unavailable` says where they cannot run.
This module is imported only by callers that asked for it (factory.py's choice of a decode kernel, quant's
``triton`` kernel): a plain engine never loads Triton.
"""
from __future__ import annotations  # the kernels' ``tl.constexpr`` annotations stay strings: Triton reads them so

import functools
from typing import Any, Callable

import torch

from enginelib.speed import paths

try:
    import triton
    import triton.language as tl
except ImportError as _error:  # no Triton here: unavailable() says so, and no kernel below is ever launched
    triton = tl = None
    _MISSING: str | None = f"Triton is not installed ({_error}): pip install triton"
else:
    _MISSING = None

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def interpreting() -> bool:
    """Whether this module's kernels were made for Triton's CPU interpreter (``TRITON_INTERPRET=1`` when it was
    first imported), where they take CPU tensors: what the kernels are, not what the environment says now."""
    if triton is None:
        return False
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(_decode_attention_kernel, InterpretedFunction)


def unavailable(device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> str | None:
    """Why these kernels cannot run on ``device`` in ``dtype`` (None: they can). Only looks, compiles nothing.

    CUDA (compute capability 7.0 or more; bfloat16 from 8.0, which a T4 lacks), or a CPU under Triton's
    interpreter. The one check every caller asks (the runner's decode-kernel choice, quant's registry)."""
    if _MISSING is not None:
        return _MISSING
    device = torch.device("cuda" if device is None else device)
    if dtype is not None and dtype not in DTYPES:
        return f"the Triton kernels run float32, float16 or bfloat16, not {str(dtype).removeprefix('torch.')}"
    if device.type == "cpu":
        return None if interpreting() else ("the Triton kernels run on a CUDA GPU (on a CPU only under Triton's "
                                            "interpreter, TRITON_INTERPRET=1, for tests)")
    if device.type != "cuda":
        return f"the Triton kernels run on a CUDA GPU, not {device.type}"
    if not torch.cuda.is_available():
        return "the Triton kernels need a CUDA GPU, and torch sees none"
    major, _ = torch.cuda.get_device_capability(device)
    if major < 7:
        return f"Triton needs a GPU of compute capability 7.0 or more; this one is {major}.x"
    if dtype == torch.bfloat16 and major < 8:
        return "this GPU has no bfloat16 matmul (compute capability below 8.0, e.g. a T4): use float16 or float32"
    return None


def _require(device: torch.device, dtype: torch.dtype) -> None:
    reason = unavailable(device, dtype)
    if reason:
        raise RuntimeError(reason)


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _jit(fn: Callable[..., None]) -> Any:
    """``triton.jit`` where Triton is installed; else the function itself (never launched: unavailable())."""
    return fn if triton is None else triton.jit(fn)


def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


# ---------------------------------------------------------------- paged decode attention

@_jit
def _decode_attention_kernel(q_ptr, k_new_ptr, v_new_ptr, k_pool_ptr, v_pool_ptr, tables_ptr, lens_ptr, out_ptr,
                             m_ptr, l_ptr, acc_ptr,
                             sq_s, sq_h, skn_s, skn_h, sp_blk, sp_tok, sp_head, st_s, so_s, so_h, scale,
                             blocks_per_part, GROUPS: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr,
                             D_PAD: tl.constexpr, BLOCK: tl.constexpr, BLOCK_PAD: tl.constexpr,
                             SPLIT: tl.constexpr):
    s = tl.program_id(0)   # the sequence
    kvh = tl.program_id(1)  # its KV head, shared by query heads kvh * GROUPS ... + GROUPS - 1
    part = tl.program_id(2)  # its share of the blocks: blocks_per_part of them (all of them unless SPLIT)
    length = tl.load(lens_ptr + s).to(tl.int32)
    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D_PAD)
    t = tl.arange(0, BLOCK_PAD)
    g_ok = g < GROUPS
    d_ok = d < D
    last = length - 1
    # the step's new key and value: written to the slot of position length - 1 (not for a padding row)
    k_new = tl.load(k_new_ptr + s * skn_s + kvh * skn_h + d, mask=d_ok, other=0.0)
    v_new = tl.load(v_new_ptr + s * skn_s + kvh * skn_h + d, mask=d_ok, other=0.0)
    last_block = tl.load(tables_ptr + s * st_s + tl.maximum(last, 0) // BLOCK).to(tl.int64)
    slot = last_block * sp_blk + (tl.maximum(last, 0) % BLOCK) * sp_tok + kvh * sp_head + d
    tl.store(k_pool_ptr + slot, k_new, mask=d_ok & (length > 0) & (part == 0))
    tl.store(v_pool_ptr + slot, v_new, mask=d_ok & (length > 0) & (part == 0))
    # the group's queries, pre-scaled by 1/sqrt(D), in float32
    heads = kvh * GROUPS + g
    q = tl.load(q_ptr + s * sq_s + heads[:, None] * sq_h + d[None, :], mask=g_ok[:, None] & d_ok[None, :],
                other=0.0).to(tl.float32) * scale
    k_last = k_new.to(tl.float32)
    v_last = v_new.to(tl.float32)
    m = tl.full([G_PAD], float("-inf"), tl.float32)  # running maximum score per head
    total = tl.zeros([G_PAD], tl.float32)            # running sum of exp(score - m)
    acc = tl.zeros([G_PAD, D_PAD], tl.float32)       # running sum of exp(score - m) * value
    first = part * blocks_per_part
    for j in range(first, tl.minimum(tl.cdiv(length, BLOCK), first + blocks_per_part)):  # through the table
        block = tl.load(tables_ptr + s * st_s + j).to(tl.int64)
        pos = j * BLOCK + t
        t_ok = (t < BLOCK) & (pos < length)
        where = block * sp_blk + t[:, None] * sp_tok + kvh * sp_head + d[None, :]
        tile_ok = t_ok[:, None] & d_ok[None, :]
        is_last = (pos == last)[:, None]
        k = tl.load(k_pool_ptr + where, mask=tile_ok, other=0.0).to(tl.float32)
        v = tl.load(v_pool_ptr + where, mask=tile_ok, other=0.0).to(tl.float32)
        k = tl.where(is_last, k_last[None, :], k)
        v = tl.where(is_last, v_last[None, :], v)
        scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2)  # [G, T]
        scores = tl.where(t_ok[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        shrink = tl.exp(m - m_new)  # the old terms, rescaled to the new maximum (0 on the first block)
        p = tl.exp(scores - m_new[:, None])
        total = total * shrink + tl.sum(p, axis=1)
        acc = acc * shrink[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m = m_new
    if SPLIT:  # this share's running maximum, sum and output, for _combine_parts_kernel
        row = ((s * tl.num_programs(1) + kvh) * tl.num_programs(2) + part) * G_PAD + g
        tl.store(m_ptr + row, m)
        tl.store(l_ptr + row, total)
        tl.store(acc_ptr + row[:, None] * D_PAD + d[None, :], acc)
    else:
        out = acc / tl.where(total > 0, total, 1.0)[:, None]  # a padding row: 0 / 1 = zeros
        tl.store(out_ptr + s * so_s + heads[:, None] * so_h + d[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=g_ok[:, None] & d_ok[None, :])


@_jit
def _combine_parts_kernel(m_ptr, l_ptr, acc_ptr, out_ptr, parts, so_s, so_h, GROUPS: tl.constexpr,
                          G_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, P_PAD: tl.constexpr):
    """Merge the shares of one (sequence, KV head): each share's terms rescaled to the overall maximum."""
    s = tl.program_id(0)
    kvh = tl.program_id(1)
    p = tl.arange(0, P_PAD)
    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D_PAD)
    p_ok = p < parts
    rows = ((s * tl.num_programs(1) + kvh) * parts + p)[:, None] * G_PAD + g[None, :]  # [P, G]
    m = tl.load(m_ptr + rows, mask=p_ok[:, None], other=float("-inf"))
    total = tl.load(l_ptr + rows, mask=p_ok[:, None], other=0.0)
    acc = tl.load(acc_ptr + rows[:, :, None] * D_PAD + d[None, None, :], mask=p_ok[:, None, None], other=0.0)
    top = tl.max(m, axis=0)                          # [G]
    top = tl.where(top == float("-inf"), 0.0, top)   # no keys anywhere (a padding row): every weight 0
    weight = tl.exp(m - top[None, :])                # [P, G]; an empty share (-inf) weighs 0
    total = tl.sum(weight * total, axis=0)
    out = tl.sum(weight[:, :, None] * acc, axis=0) / tl.where(total > 0, total, 1.0)[:, None]
    heads = kvh * GROUPS + g
    tl.store(out_ptr + s * so_s + heads[:, None] * so_h + d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=(g < GROUPS)[:, None] & (d < D)[None, :])


MIN_BLOCKS_PER_PART = 4  # a share of a sequence's keys is worth a program from this many blocks on
MAX_PARTS = 64


def partitions(seqs: int, kv_heads: int, width: int, device: torch.device) -> int:
    """Into how many shares to split each sequence's blocks: 1 when ``seqs * kv_heads`` programs already
    keep every multiprocessor busy (twice over), else enough shares for that, of at least
    :data:`MIN_BLOCKS_PER_PART` of the table's ``width`` blocks each (flash-decoding's split: at batch 1 a
    long context would otherwise be read by 3 programs on a GPU of 40 to 132 multiprocessors)."""
    want = 2 * _multiprocessors(device)
    if seqs * kv_heads >= want:
        return 1
    return max(1, min(-(-want // (seqs * kv_heads)), width // MIN_BLOCKS_PER_PART, MAX_PARTS))


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                     block_tables: torch.Tensor, context_lens: torch.Tensor, parts: int | None = None) -> torch.Tensor:
    """A decode step's attention over one layer's paged pool, one new token per sequence (cpu_kernels'
    contract): writes ``k``, ``v`` [S, KV, D] at each sequence's last position, then returns [S, H, D],
    ``softmax(q K^T / sqrt(D)) V`` over its first ``context_lens[s]`` keys, read through ``block_tables``
    [S, width] (int32 or int64). ``context_lens[s] == 0``: a padding row, left alone, zeros out.
    ``parts``: shares each sequence's blocks are split into, each its own program, then merged by a second
    kernel (default: :func:`partitions`; 1: one program per sequence and KV head, one launch).

    The tables are trusted: an engine's step checks them once, on the host, in
    :meth:`enginelib.step.batch.Batch.check_pool` (reading them here would make every step wait for the GPU)."""
    _check(q.dim() == 3 and k.dim() == v.dim() == 3 and k_pool.dim() == 4 and k.shape == v.shape
           == (q.shape[0], k_pool.shape[2], q.shape[2]) and k_pool.shape == v_pool.shape
           and k_pool.shape[3] == q.shape[2] and q.shape[1] % k_pool.shape[2] == 0,
           "decode_attention takes q [S, H, D], k and v [S, KV, D], pools [blocks, block_size, KV, D], H a "
           "multiple of KV")
    _check(len({t.dtype for t in (q, k, v, k_pool, v_pool)}) == 1 and q.dtype in DTYPES,
           "q, k, v and the pools must share one dtype: float32, float16 or bfloat16")
    _check(block_tables.dim() == 2 and block_tables.shape[0] == context_lens.numel() == q.shape[0]
           and block_tables.dtype in (torch.int32, torch.int64) and context_lens.dtype in (torch.int32, torch.int64),
           "block_tables must be int32/int64 [S, width] and context_lens [S]")
    _check(all(t.device == q.device for t in (k, v, k_pool, v_pool, block_tables, context_lens)),
           "every tensor must be on q's device")
    _check(all(t.stride(-1) == 1 for t in (k_pool, v_pool)) and k_pool.stride() == v_pool.stride(),
           "the pools must have contiguous heads and the same strides")
    _require(q.device, q.dtype)
    paths.ran("decode attention", "triton")  # the engine's fused decode asked for: seen running (a set lookup)
    seqs, heads, dim = q.shape
    kv, block = k_pool.shape[2], k_pool.shape[1]
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    tables, lens = block_tables.contiguous(), context_lens.contiguous()
    out = torch.empty_like(q)
    if seqs == 0:
        return out
    groups, width = heads // kv, tables.shape[1]
    parts = partitions(seqs, kv, width, q.device) if parts is None else parts
    _check(1 <= parts <= MAX_PARTS, f"parts must be 1 to {MAX_PARTS}, got {parts}")
    per_part = max(1, -(-width // parts))
    parts = -(-width // per_part) if width else 1  # no empty share at the end
    sizes = {"GROUPS": groups, "G_PAD": _pow2(groups), "D": dim, "D_PAD": _pow2(dim)}
    if parts > 1:  # float32 scratch for each share's maximum, sum and output
        m = torch.empty(seqs, kv, parts, sizes["G_PAD"], device=q.device, dtype=torch.float32)
        total, acc = torch.empty_like(m), m.new_empty(*m.shape, sizes["D_PAD"])
    else:
        m = total = acc = out  # not touched
    _decode_attention_kernel[(seqs, kv, parts)](
        q, k, v, k_pool, v_pool, tables, lens, out, m, total, acc, q.stride(0), q.stride(1), k.stride(0),
        k.stride(1), k_pool.stride(0), k_pool.stride(1), k_pool.stride(2), tables.stride(0), out.stride(0),
        out.stride(1), dim ** -0.5, per_part if parts > 1 else max(width, 1), BLOCK=block, BLOCK_PAD=_pow2(block),
        SPLIT=parts > 1, **sizes)
    if parts > 1:
        _combine_parts_kernel[(seqs, kv)](m, total, acc, out, parts, out.stride(0), out.stride(1),
                                          P_PAD=_pow2(parts), **sizes)
    return out



@torch.library.custom_op("enginelib::triton_decode_attention", mutates_args=("k_pool", "v_pool"))
def decode_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                        block_tables: torch.Tensor, context_lens: torch.Tensor) -> torch.Tensor:
    """:func:`decode_attention` as an operator a compiled step can hold (the C++ kernel's twin): it declares the pools
    it writes and reads nothing on the host, so a CUDA graph captures it with the rest of the step."""
    return decode_attention(q, k, v, k_pool, v_pool, block_tables, context_lens)


@decode_attention_op.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
      block_tables: torch.Tensor, context_lens: torch.Tensor) -> torch.Tensor:
    return torch.empty(q.shape, dtype=q.dtype, device=q.device)

# ---------------------------------------------------------------- weight-only matmuls

@_jit
def _output_tile(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """This program's rows and columns of the output (N across program ids' axis 0), and which of them exist."""
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    return rm, rn, rm < M, rn < N


@_jit
def _int8_linear_kernel(x_ptr, q_ptr, scale_ptr, out_ptr, M, N, K, sx_m, sq_n, so_m,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr):
    rm, rn, m_ok, n_ok = _output_tile(M, N, BLOCK_M, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        k_ok = kk < K
        x = tl.load(x_ptr + rm[:, None] * sx_m + kk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(q_ptr + rn[None, :] * sq_n + kk[:, None], mask=n_ok[None, :] & k_ok[:, None], other=0)
        w = w.to(x.dtype)  # int8 codes are exact in any float type
        if IEEE:
            acc = tl.dot(x, w, acc, input_precision="ieee")
        else:
            acc = tl.dot(x, w, acc)
    acc = acc * tl.load(scale_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rm[:, None] * so_m + rn[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


@_jit
def _int4_linear_kernel(x_ptr, codes_ptr, scale_ptr, min_ptr, out_ptr, M, N, C, G, sx_m, sc_n, so_m,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr, IEEE: tl.constexpr):
    rm, rn, m_ok, n_ok = _output_tile(M, N, BLOCK_M, BLOCK_N)
    rc = tl.arange(0, BLOCK_C)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for c0 in range(0, C, BLOCK_C):  # C = K / 2 bytes per output row
        c = c0 + rc
        c_ok = c < C
        group = c // 16
        k_low = group * 32 + c % 16  # the input the byte's low nibble multiplies; the high one: +16
        x_ok = m_ok[:, None] & c_ok[None, :]
        x_low = tl.load(x_ptr + rm[:, None] * sx_m + k_low[None, :], mask=x_ok, other=0.0)
        x_high = tl.load(x_ptr + rm[:, None] * sx_m + (k_low + 16)[None, :], mask=x_ok, other=0.0)
        w_ok = c_ok[:, None] & n_ok[None, :]
        byte = tl.load(codes_ptr + rn[None, :] * sc_n + c[:, None], mask=w_ok, other=0)  # [BLOCK_C, BLOCK_N]
        scale = tl.load(scale_ptr + rn[None, :] * G + group[:, None], mask=w_ok, other=0.0).to(tl.float32)
        minimum = tl.load(min_ptr + rn[None, :] * G + group[:, None], mask=w_ok, other=0.0).to(tl.float32)
        w_low = ((byte & 15).to(tl.float32) * scale + minimum).to(x_low.dtype)
        w_high = ((byte >> 4).to(tl.float32) * scale + minimum).to(x_low.dtype)
        if IEEE:
            acc = tl.dot(x_low, w_low, acc, input_precision="ieee")
            acc = tl.dot(x_high, w_high, acc, input_precision="ieee")
        else:
            acc = tl.dot(x_low, w_low, acc)
            acc = tl.dot(x_high, w_high, acc)
    tl.store(out_ptr + rm[:, None] * so_m + rn[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


def _tiles(m: int, n: int, device: torch.device) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_N): rows of x per program (16 at decode sizes: ``tl.dot``'s smallest), and output rows
    per program, the widest of 64, 32, 16 that still gives every multiprocessor two programs (a decode step's
    matmul reads memory; a GPU reads it at full speed only with enough programs in flight)."""
    block_m = 16 if m <= 16 else 32  # more rows (a prefill) take more programs, not bigger tiles
    want = 2 * _multiprocessors(device)
    block_n = next((b for b in (64, 32) if -(-n // b) >= want), 16)
    return block_m, block_n


SHARED_BYTES = 40 * 1024  # shared memory the dot operands' pipeline may take: under a T4's 48 KiB per block


def _k_tiling(block_m: int, block_n: int, dots: int, itemsize: int) -> tuple[int, int]:
    """(BLOCK_K, num_stages): the inputs per step (64, or 32 where two stages of 64 would not fit) and the
    software-pipeline stages (tiles loading while the previous one multiplies), up to 3, as many as fit in
    :data:`SHARED_BYTES` with ``dots`` pairs of [block_m, BLOCK_K] and [BLOCK_K, block_n] operands each."""
    block_k = 64 if 2 * dots * (block_m + block_n) * 64 * itemsize <= SHARED_BYTES else 32
    return block_k, max(1, min(3, SHARED_BYTES // (dots * (block_m + block_n) * block_k * itemsize)))


def _prepare_x(x: torch.Tensor, k: int) -> torch.Tensor:
    _check(x.dim() == 2 and x.shape[1] == k, f"x must be [M, {k}], got {list(x.shape)}")
    _require(x.device, x.dtype)
    return x.contiguous()


def int8_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x [M, K] @ (q [N, K] int8 * scale [N, 1]).T`` -> [M, N] in x's dtype (float32 accumulation)."""
    _check(q.dtype == torch.int8 and q.dim() == 2 and scale.numel() == q.shape[0] and q.stride(1) == 1,
           "the weight must be int8 [N, K] (rows contiguous) with scales [N]")
    x = _prepare_x(x, q.shape[1])
    (m, k), n = x.shape, q.shape[0]
    out = x.new_empty(m, n)
    block_m, block_n = _tiles(m, n, x.device)
    block_k, stages = _k_tiling(block_m, block_n, 1, x.element_size())
    _int8_linear_kernel[(-(-n // block_n), -(-m // block_m))](
        x, q, scale.contiguous(), out, m, n, k, x.stride(0), q.stride(0), out.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, IEEE=x.dtype == torch.float32, num_warps=4,
        num_stages=stages)
    return out


def int4_linear(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor) -> torch.Tensor:
    """``x [M, K]`` times the int4 weight (codes uint8 [N, K/32, 16], scale and minimum [N, K/32]) -> [M, N]."""
    _check(codes.dtype == torch.uint8 and codes.dim() == 3 and codes.shape[2] == 16
           and scale.shape == minimum.shape == codes.shape[:2],
           "the weight must be uint8 codes [N, K/32, 16] with scales and minimums [N, K/32]")
    n, groups = codes.shape[:2]
    x = _prepare_x(x, groups * 32)
    codes, scale, minimum = codes.contiguous(), scale.contiguous(), minimum.contiguous()
    m = x.shape[0]
    out = x.new_empty(m, n)
    block_m, block_n = _tiles(m, n, x.device)
    block_c, stages = _k_tiling(block_m, block_n, 2, x.element_size())  # a byte per two inputs: C steps of K's
    _int4_linear_kernel[(-(-n // block_n), -(-m // block_m))](
        x, codes, scale, minimum, out, m, n, groups * 16, groups, x.stride(0), groups * 16, out.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_C=block_c, IEEE=x.dtype == torch.float32, num_warps=4,
        num_stages=stages)
    return out
