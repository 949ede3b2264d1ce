"""Our own CPU kernels for int8 and int4 weights: read the packed bytes, dequantize in registers, multiply-add.

Why write them: a decode step at batch 1 reads every weight once, so its time
is the time to stream the weights from memory. On an AVX2 CPU without VNNI,
the library kernels that take int8/int4 weights are slower than float32's
packed matmul (they unpack the weight, or round the activations too), so the
smaller weights bought memory but not speed. These kernels do what llama.cpp
does in spirit: one fused loop per block of output rows that loads 8 int8
(or 32 int4) codes, turns them into floats in a vector register, and
multiply-adds them with the activations, never writing a float weight.

- ``int8_linear(x [M, K] float32, q [N, K] int8, scale [N] float32) -> [M, N]``:
  ``y[m, n] = scale[n] * sum_k x[m, k] q[n, k]``.
- ``int4_linear(x, codes [N, K/32, 16] uint8, scale, minimum [N, K/32] float16)``,
  ``w = code * scale + minimum`` (quant.py's layout, GGUF's Q4_1 block):
  per group, ``sum_k x_k (c_k s + m) = s * sum_k x_k c_k + m * sum_k x_k``, so the
  codes are multiplied as small integers turned floats, and the minimum costs one
  multiply-add per group with the group's sum of ``x`` (computed once per call).

The ``q8`` twins (``int8q8_linear``, ``int4q8_linear``) round the activations to int8 per group of 32
and multiply integers, as llama.cpp does, and take their weights *interleaved* (:func:`interleave`):
output rows in blocks of 4, each block's rows side by side group by group, so a tile reads one sequential
stream of bytes (on a 2-core AVX2 machine the LM head's GEMV went from ~11 to ~20 GB/s).
``int8q8_linear`` also takes one float16 scale per group of 32 instead of one per row: GGUF's Q8_0
block, so a file's Q8_0 tensor runs as it was stored (quant.py's ``q8_0`` format). The q8 twins have one
path per instruction set (:data:`Q8_PATHS`; :func:`q8_paths` lists those this CPU's build has, and a call
takes the fastest unless told): AVX2's ``maddubs`` + ``madd``; VNNI's ``vpdpbusd``, which sums four byte
products into an int32 in one instruction (at 256 bits, the same bits as AVX2); and AVX-512 VNNI with a
block's 4 rows in one 512-bit register, a quarter of AVX2's instructions per group of 32.

Each call works on tiles of ``MR`` activation rows by ``NR`` output rows, so a
weight loaded (and converted) once serves up to 4 rows of a decode batch, and
several independent accumulators hide the multiply-add latency. Output rows are
split among threads with ``at::parallel_for`` (``torch.set_num_threads``).
Accumulation is float32: equal to the reference up to rounding. Each output
adds its products in the same order whatever tile it falls in (and the build
uses ``-ffp-contract=off``, so the compiler fuses nothing on its own), so a
row gives the same bits alone or in any batch: batched greedy decoding equals
one request at a time.

The C++ lives in ``csrc/`` next to this file (shipped as package data): ``linear.cpp`` (int8/int4 times
float32), ``q8.cpp`` (the q8 twins, and ``q8_decode_step``: a whole decode step of an int4 model,
:mod:`enginelib.speed.fused_step`), ``attention.cpp`` (:func:`decode_attention`) and ``common.h``. Each
AVX2 path is compiled under ``#ifdef __AVX2__`` and each fused multiply-add under ``#ifdef __FMA__`` (else a
multiply and an add); a plain C++ loop is always compiled too and runs when ``simd=False``, so the tests
check both. The kernels are used only where :func:`unavailable` says so: an x86-64 CPU with AVX2 and FMA, a
C++ compiler and ninja, and (when asked) a CPU device and float32. Elsewhere every caller falls back with
the one sentence :data:`NO_AVX2` (or the missing tool's fix).

:func:`unavailable` only looks (it never compiles); the build happens in :func:`load`, on the first real
call of a kernel (tens of seconds), into ``~/.cache/enginelib/kernels/<key>`` (``$ENGINELIB_CACHE/kernels``),
where the key covers the sources, the flags, the compiler's version, Python's ABI, torch's version and the
CPU's flags: a build is reused until one of them changes. A failed build raises a RuntimeError with the
compiler's last lines.

The kernels are torch operators (``enginelib::int8_linear``, ``enginelib::int4_linear``, ...),
declared in Python with fake implementations, so ``torch.compile`` traces around
them, and implemented in C++, so a call never re-enters Python.
"""
from __future__ import annotations

import functools
import hashlib
import platform
import shutil
import subprocess
import sysconfig
from pathlib import Path

import torch

import enginelib.env as env

CSRC = Path(__file__).parent / "csrc"
SOURCES = ("linear.cpp", "q8.cpp", "attention.cpp")  # compiled, in csrc/
HEADERS = ("common.h", "attention.h")  # included by them: part of the build key too
# -ffp-contract=off: the compiler fuses no multiply-add on its own, so each output is summed in the order
# written whatever tile it falls in (a row alone or in a batch: the same bits). -march=native: the CPU's own
# instructions (AVX2, and FMA and F16C where it has them, which the C++ checks with #ifdef).
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-ffp-contract=off")
LDFLAGS = ("-fopenmp",)

# The one sentence every caller gives on a CPU the kernels do not support (ARM, or x86 without AVX2 or FMA).
NO_AVX2 = ("enginelib's C++ CPU kernels need an x86-64 CPU with AVX2 and FMA, which this one is not; "
           "PyTorch's own kernels do the work here")


# ---------------------------------------------------------------- what this machine offers (no building)

@functools.cache
def _cpu_flags() -> str:
    """The CPU's feature flags line (what ``-march=native`` compiles for). Cached: the CPU does not change
    while the process runs, and every kernel call asks (through :func:`load`'s check)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:  # no /proc (macOS, Windows)
        lines = []
    for line in lines:
        if line.startswith(("flags", "Features")):
            return line
    # then torch's own dispatch level, whose AVX2 level requires FMA too
    capability = torch.backends.cpu.get_cpu_capability()
    return f"capability : {capability} " + ("avx2 fma" if capability.startswith(("AVX2", "AVX512")) else "")


def _supported_cpu() -> bool:
    """x86-64 with AVX2 and FMA: what the kernels' fast paths are written for."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    flags = _cpu_flags().split()
    return "avx2" in flags and "fma" in flags


def compiler() -> str:
    """The C++ compiler torch's extension builder will call (``$CXX``, else ``c++``)."""
    return env.cxx("c++")


def _missing_tool() -> str | None:
    if shutil.which(compiler()) is None:
        return (f"no C++ compiler ({compiler()!r}) was found to build enginelib's CPU kernels: install one "
                f"(apt-get install g++; on macOS xcode-select --install) or set $CXX")
    if shutil.which("ninja") is None:
        return "building enginelib's CPU kernels needs ninja, which was not found: pip install ninja"
    return None


def unavailable(device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> str | None:
    """Why the kernels cannot run here, for ``device`` and ``dtype`` when given (None: they can).

    The one place that decides whether a step may use them (the decode attention, the quantized linears):
    every caller asks here. It only looks at static facts (the device, the dtype, the CPU's flags, the
    tools on $PATH) and never builds, so asking is cheap and safe anywhere; :func:`load` builds.
    """
    device_type = None if device is None else torch.device(device).type
    if device_type not in (None, "cpu") or dtype not in (None, torch.float32):
        got = ([] if dtype is None else [str(dtype).removeprefix("torch.")]) + ([] if device_type is None else
                                                                              [f"on {device_type}"])
        return f"enginelib's C++ kernels run float32 on a CPU, not {' '.join(got)}"
    if not _supported_cpu():
        return NO_AVX2
    return _missing_tool()  # not remembered: installing the tool fixes it without a restart


# ---------------------------------------------------------------- the build

def compiler_version() -> str:
    """The first line of ``$CXX --version`` (a new compiler builds anew). Runs the compiler: only
    :func:`build_dir` calls it, on the way to a build."""
    try:
        out = subprocess.run([compiler(), "--version"], check=True, capture_output=True, text=True,
                             timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        return f"unknown ({exc})"
    return (out.splitlines() or ["unknown"])[0]


def python_abi() -> str:
    """Python's ABI tag (``cpython-311-x86_64-linux-gnu``): the built library links against it."""
    return str(sysconfig.get_config_var("SOABI"))


def build_key(sources: bytes, compiler_version: str, abi: str, torch_version: str, cpu_flags: str) -> str:
    """16 hex digits naming a build: a change to any of these makes a new one."""
    key = b"\n".join([sources, " ".join(CFLAGS + LDFLAGS).encode(), compiler_version.encode(), abi.encode(),
                      torch_version.encode(), cpu_flags.encode()])
    return hashlib.sha256(key).hexdigest()[:16]


def _sources() -> bytes:
    return b"".join(name.encode() + b"\0" + (CSRC / name).read_bytes() for name in SOURCES + HEADERS)


def build_dir() -> Path:
    """Where the build lives: a new folder whenever the sources, flags, compiler, Python, torch or CPU change."""
    from enginelib.model.weights import cache_dir

    key = build_key(_sources(), compiler_version(), python_abi(), torch.__version__, _cpu_flags())
    return cache_dir() / "kernels" / key


@functools.cache
def _build(directory: Path) -> str | None:
    """Build (or reuse) the library in ``directory`` and load its operators; the failure's message, or None.

    Cached per directory, so a process builds and loads a library once and remembers a failure instead of
    rebuilding at every call. That is the only state this module keeps, and it is the loader's state
    anyway: a loaded library cannot be unloaded, so the cache only mirrors what the process already holds.
    """
    from torch.utils.cpp_extension import load as build

    directory.mkdir(parents=True, exist_ok=True)
    try:
        # is_python_module=False: the library registers torch operators and is loaded with
        # torch.ops.load_library (no Python module, so no pybind11 to compile)
        build(name=f"enginelib_cpu_kernels_{directory.name}", sources=[str(CSRC / name) for name in SOURCES],
              extra_cflags=list(CFLAGS), extra_ldflags=list(LDFLAGS), build_directory=str(directory),
              is_python_module=False, verbose=False)
    except (RuntimeError, OSError, ImportError, subprocess.CalledProcessError) as exc:
        tail = "\n".join(str(exc).strip().splitlines()[-8:])
        return f"building enginelib's CPU kernels failed (in {directory}); the compiler's last lines:\n{tail}"
    return None


@functools.cache
def _load() -> None:
    reason = unavailable() or _build(build_dir())
    if reason:
        raise RuntimeError(reason)


OPERATORS = ("int8_linear", "int4_linear", "int8q8_linear", "int4q8_linear", "decode_attention")


def graph_cache_key(build: str, schemas: list[str]) -> str:
    """What names our operators in inductor's caches: the build (sources, flags, compiler, torch, CPU) and the
    operators' schemas (declared below, in Python)."""
    return build + "-" + hashlib.sha256("\n".join(schemas).encode()).hexdigest()[:16]


def graph_cache_keys() -> dict[str, str]:
    """Inductor's option that puts this build in the key of the graphs it compiles (``compiled`` passes it),
    so a graph compiled against another build (its code kept on disk by inductor's caches) is not reused: its
    calls would pass the arguments of the old schemas (a stale cache once failed chapter 13 that way, after
    ``simd=`` left a schema). A cached graph's key hashes inductor's options but not a custom operator's schema
    or code; one option is a dictionary of function names and keys (``unsafe_marked_cacheable_functions``, for
    functions inductor would not cache otherwise; it caches our operators anyway), which this fills."""
    schemas = [str(getattr(torch.ops.enginelib, name).default._schema) for name in OPERATORS]
    key = graph_cache_key(build_dir().name, schemas)
    return {f"torch.ops.enginelib.{name}": key for name in OPERATORS}


# assume_constant_result: torch.compile runs it while tracing and leaves it out of the graph (traced, its file
# reads and subprocess would break the graph at every quantized linear), so the operators are registered
# before the compiled code calls them.
@torch.compiler.assume_constant_result
def load() -> None:
    """Build the kernels on the first call (tens of seconds; then loaded from the disk cache) and register
    their operators. Raises RuntimeError where they cannot run (:func:`unavailable`) or the build failed.

    Cached once it succeeded (``_load``, functools.cache): every kernel call comes through here, and a
    dictionary lookup is all it then costs. An exception is not cached, so a machine that cannot run them
    says why at every call; ``_load.cache_clear()`` makes the next call look again (the tests do)."""
    _load()


def build_failure(device: torch.device | str | None = None) -> str | None:
    """:func:`unavailable`, else build now and say why the build failed (None: the kernels are ready).

    For a caller about to run the kernels that would rather do without them than raise (quant's ``auto``
    times them and skips them with this reason)."""
    reason = unavailable(device)
    if reason:
        return reason
    try:
        load()
    except RuntimeError as exc:
        return str(exc)
    return None


def has_simd() -> bool:
    """Whether the build has the AVX2 path (else ``simd=True`` runs the plain loop too)."""
    load()
    return bool(torch.ops.enginelib.has_simd())


# ---------------------------------------------------------------- operators, traceable by torch.compile

# Declared here, implemented in C++ (TORCH_LIBRARY_IMPL above, registered when the build loads): a call goes
# straight from torch's dispatcher to the kernel, with no Python in between (a Python custom op costs tens
# of microseconds a call, and a decode step makes 121 of them).
torch.library.define("enginelib::int8_linear", "(Tensor x, Tensor q, Tensor scale, bool simd=True) -> Tensor")
torch.library.define("enginelib::int4_linear",
                     "(Tensor x, Tensor codes, Tensor scale, Tensor minimum, bool simd=True) -> Tensor")
# the q8 kernels (activations rounded to int8 too) take their weights interleaved (see interleave) and the row count
# and a path (-1: the fastest this build has; Q8_PATHS' index to force one)
torch.library.define("enginelib::int8q8_linear", "(Tensor x, Tensor q, Tensor scale, int rows, int path=-1) -> Tensor")
torch.library.define("enginelib::int4q8_linear",
                     "(Tensor x, Tensor codes, Tensor scale, Tensor minimum, int rows, int path=-1) -> Tensor")
torch.library.define("enginelib::decode_attention", "(Tensor q, Tensor k, Tensor v, Tensor(a!) k_pool, Tensor(b!) v_pool, "
                     "Tensor block_tables, Tensor context_lens, bool simd=True) -> Tensor")


@torch.library.register_fake("enginelib::int8_linear")
def _(x, q, scale, simd=True):
    return x.new_empty(x.shape[0], q.shape[0])


@torch.library.register_fake("enginelib::int4_linear")
def _(x, codes, scale, minimum, simd=True):
    return x.new_empty(x.shape[0], codes.shape[0])


@torch.library.register_fake("enginelib::int8q8_linear")
def _(x, q, scale, rows, path=-1):
    return x.new_empty(x.shape[0], rows)


@torch.library.register_fake("enginelib::int4q8_linear")
def _(x, codes, scale, minimum, rows, path=-1):
    return x.new_empty(x.shape[0], rows)


@torch.library.register_fake("enginelib::decode_attention")
def _(q, k, v, k_pool, v_pool, block_tables, context_lens, simd=True):
    return torch.empty_like(q)


def check_tables(block_tables: torch.Tensor, context_lens: torch.Tensor, num_blocks: int, block_size: int) -> None:
    """What the kernel trusts, for a direct call with tensors: every sequence has 0 (padding) to (its table's)
    keys, and the blocks holding them are in the pool. Checked in Python, where an error is an exception (one
    thrown in C++ must cross torch's dispatcher, which crashed a process on one machine). It reads the tensors,
    so an engine's step checks its Batch on the host instead (:meth:`enginelib.step.batch.Batch.check_pool`)."""
    width = block_tables.shape[1]
    bad = ((context_lens < 0) | (context_lens > width * block_size)).nonzero()
    if len(bad):
        s = int(bad[0])
        raise RuntimeError(f"sequence {s} has {int(context_lens[s])} keys; its table holds {width * block_size}")
    columns = torch.arange(width, device=block_tables.device)
    used = block_tables[columns < ((context_lens + block_size - 1) // block_size)[:, None]]
    outside = used[(used < 0) | (used >= num_blocks)]
    if len(outside):
        raise RuntimeError(f"block {int(outside[0])} is outside the pool of {num_blocks}")


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                     block_tables: torch.Tensor, context_lens: torch.Tensor, simd: bool = True) -> torch.Tensor:
    """A decode step's attention over one layer's paged pool, with one new token per sequence.

    q: [S, H, D], k, v: [S, KV, D] float32, the new token's; k_pool, v_pool:
    [num_blocks, block_size, KV, D]; block_tables: [S, max_blocks] int64;
    context_lens: [S], the keys each sequence has with its new one (0: a padding
    row, left alone, zeros out). Writes k, v at each sequence's last position,
    then returns [S, H, D]: the paged-attention kernel of a decode step, with no
    keys gathered or copied. (An engine's step, eager or compiled, calls the operator itself,
    after one :meth:`~enginelib.step.batch.Batch.check_pool` on the host for all its layers.)
    """
    load()
    _check(q.dim() == 3 and k.dim() == v.dim() == 3 and k_pool.dim() == 4 and k.shape == v.shape
           == (q.shape[0], k_pool.shape[2], q.shape[2]) and k_pool.shape == v_pool.shape
           and k_pool.is_contiguous() and v_pool.is_contiguous()
           and all(t.dtype == torch.float32 and t.device.type == "cpu" for t in (q, k, v, k_pool, v_pool)),
           "decode_attention takes float32 CPU q [S, H, D], k and v [S, KV, D], contiguous pools "
           "[blocks, block_size, KV, D]")
    _check(block_tables.dtype == context_lens.dtype == torch.int64 and block_tables.dim() == 2
           and block_tables.shape[0] == context_lens.numel() == q.shape[0],
           "block_tables must be int64 [S, max_blocks] and context_lens int64 [S]")
    check_tables(block_tables, context_lens, k_pool.shape[0], k_pool.shape[1])
    return torch.ops.enginelib.decode_attention(q.contiguous(), k.contiguous(), v.contiguous(), k_pool, v_pool,
                                                block_tables.contiguous(), context_lens.contiguous(), simd)


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise RuntimeError(message)


def _ready(x: torch.Tensor, k: int, weight_ok: bool, weight_shape: str) -> torch.Tensor:
    """Build the kernels if needed, and check the arguments here, in Python. The C++ checks them too,
    but an error thrown there must cross torch's dispatcher, and on one machine (torch 2.11, the host's
    g++) that crossing crashed the process instead of raising."""
    load()
    _check(weight_ok, f"the weight must be {weight_shape}")
    _check(x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2,
           "x must be a contiguous float32 CPU matrix [M, K]")
    _check(x.shape[1] == k, f"x has {x.shape[1]} columns, the weight {k}")
    return x.contiguous()


def _int8_ok(q: torch.Tensor, scale: torch.Tensor) -> bool:
    return q.dtype == torch.int8 and q.dim() == 2 and scale.dtype == torch.float32 and scale.numel() == q.shape[0]


def _int4_ok(codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor) -> bool:
    return (codes.dtype == torch.uint8 and codes.dim() == 3 and codes.shape[2] == 16
            and all(t.dtype == torch.float16 and t.shape == codes.shape[:2] for t in (scale, minimum)))


INT8 = "int8 [N, K] with float32 scales [N]"
INT4 = "uint8 codes [N, K/32, 16] with float16 scales and minimums [N, K/32]"


def int8_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, simd: bool = True) -> torch.Tensor:
    """``x [M, K] float32 @ (q [N, K] int8 * scale [N, 1]).T`` -> [M, N] float32."""
    x = _ready(x, q.shape[-1], _int8_ok(q, scale), INT8)
    return torch.ops.enginelib.int8_linear(x, q, scale, simd)


def int4_linear(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor,
                simd: bool = True) -> torch.Tensor:
    """``x [M, K] float32`` times the int4 weight (codes [N, K/32, 16], float16 scale and minimum [N, K/32])."""
    x = _ready(x, codes.shape[1] * 32 if codes.dim() == 3 else -1, _int4_ok(codes, scale, minimum), INT4)
    return torch.ops.enginelib.int4_linear(x, codes, scale, minimum, simd)


ROWS = 4  # output rows per block in the q8 kernels' weight layout


def interleave(t: torch.Tensor) -> torch.Tensor:
    """A weight's per-row tensor [N, G, ...] (G groups of 32 inputs) in the q8 kernels' layout, [ceil(N/4), G, 4, ...]:
    output rows in blocks of 4, and in a block group by group, the 4 rows' group side by side, so a tile of 4
    outputs reads its bytes in one sequential stream. The last block is filled up with zero rows."""
    blocks = -(-t.shape[0] // ROWS)
    padded = torch.cat([t, t.new_zeros(blocks * ROWS - t.shape[0], *t.shape[1:])])
    return padded.reshape(blocks, ROWS, *t.shape[1:]).transpose(1, 2).contiguous()


def deinterleave(t: torch.Tensor, rows: int) -> torch.Tensor:
    """The inverse of :func:`interleave`: [blocks, G, 4, ...] -> [rows, G, ...]."""
    return t.transpose(1, 2).reshape(-1, *t.shape[1:2], *t.shape[3:])[:rows]


def _interleaved_ok(w: torch.Tensor, rows: int, dtype: torch.dtype, size: int) -> bool:
    return (w.dtype == dtype and w.dim() == 4 and w.shape[0] == -(-rows // ROWS) and w.shape[2] == ROWS
            and w.shape[3] == size)


# The q8 kernels' paths (q8.cpp's Q8Path), slowest first: the plain loop, AVX2 (maddubs + madd), the same
# tiles with VNNI's vpdpbusd (AVX-VNNI or AVX-512 VNNI at 256 bits: the same bits as AVX2), AVX-512 VNNI
# with a block's 4 rows in one 512-bit register. -march=native builds those this CPU has.
Q8_PATHS = ("plain", "avx2", "avx2_vnni", "avx512_vnni")


@functools.cache
def q8_paths() -> tuple[str, ...]:
    """The q8 kernels' paths this build has, slowest first: a call takes the last unless it names one."""
    load()
    return tuple(torch.ops.enginelib.q8_paths())


def q8_path_number(path: str | int | None = None) -> int:
    """The C++ path number of ``path`` (a name of :data:`Q8_PATHS`), else of ``$ENGINELIB_Q8_PATH`` (the benchmark
    and the tests force a path for a whole model so), else -1: the fastest built. A model's layers ask once, when
    they are prepared, and pass the number: a compiled step then reads no environment. A number passes as is."""
    if isinstance(path, int):
        return path
    path = path or env.q8_path()
    if path is None:
        return -1
    _check(path in q8_paths(), f"the q8 kernels' path {path!r} is not built on this CPU (built: "
                               f"{', '.join(q8_paths())}; known: {', '.join(Q8_PATHS)})")
    return Q8_PATHS.index(path)


def int8q8_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, rows: int,
                  path: str | int | None = None) -> torch.Tensor:
    """:func:`int8_linear` with ``x`` rounded to int8 per group of 32 and integer products; ``q`` is the
    int8 weight [rows, K] interleaved (``interleave(q.reshape(rows, K // 32, 32))``), ``scale`` float32
    [rows], or float16 [rows, K/32] interleaved (one scale per group of 32: GGUF's Q8_0). ``path``: one of
    :func:`q8_paths` (default: :func:`q8_path_number`'s)."""
    per_row = scale.dtype == torch.float32 and scale.numel() == rows
    per_group = scale.dtype == torch.float16 and q.dim() == 4 and scale.shape == q.shape[:3]
    blocks = -(-rows // ROWS)
    x = _ready(x, q.shape[1] * 32 if q.dim() == 4 else -1, _interleaved_ok(q, rows, torch.int8, 32) and
               (per_row or per_group), f"int8 [{blocks}, K/32, {ROWS}, 32] (cpu_kernels.interleave) with float32 "
               f"scales [{rows}] or float16 scales [{blocks}, K/32, {ROWS}]")
    return torch.ops.enginelib.int8q8_linear(x, q, scale, rows, q8_path_number(path))


def int4q8_linear(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, rows: int,
                  path: str | int | None = None) -> torch.Tensor:
    """:func:`int4_linear` with ``x`` rounded to int8 per group of 32 and integer products; the codes, scales
    and minimums interleaved (:func:`interleave`). ``path``: one of :func:`q8_paths` (default: :func:`q8_path_number`'s)."""
    ok = (_interleaved_ok(codes, rows, torch.uint8, 16)
          and all(t.dtype == torch.float16 and t.shape == codes.shape[:3] for t in (scale, minimum)))
    x = _ready(x, codes.shape[1] * 32 if codes.dim() == 4 else -1, ok, f"uint8 codes [{-(-rows // ROWS)}, K/32, "
               f"{ROWS}, 16] with float16 scales and minimums [{-(-rows // ROWS)}, K/32, {ROWS}] (cpu_kernels.interleave)")
    return torch.ops.enginelib.int4q8_linear(x, codes, scale, minimum, rows, q8_path_number(path))
