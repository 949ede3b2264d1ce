"""Decode without Python overhead: the model step compiled once per batch size, with ``torch.compile``.

An eager decode step makes about seventy calls into PyTorch per layer (chapter 14
counts them), many of them dispatching a kernel. ``torch.compile`` traces the step once,
fuses what it can (norms, RoPE, SwiGLU, residuals) and, on a CPU, can let
inductor freeze the weights (``freeze=True``: constants of the graph, pre-packed
for oneDNN's matmul, no longer passed on every call); on a GPU the fused
kernels replace launches. A traced graph has fixed shapes, so steps are padded
up to a few sizes (*buckets*) of tokens and each size is compiled once, up
front, as vLLM captures its graph sizes. A graph serves a step in which every
token gets logits: decode (one token per sequence) and the verification of
speculative guesses (a sequence's last token and its ``k`` guesses, each row
attending to the keys up to its own position). Everything else (prefills,
chunks, steps bigger than the last bucket) runs eagerly.
On a CPU, once dynamo has traced a bucket, the engine calls the compiled graph
itself: the bucket fixes the shapes that dynamo's guards would check on every call.

Attention is the one part the compiler must not see inside: which blocks a
sequence reads changes every step. Where one of our fused decode kernels runs, it is that kernel: the C++
one on a CPU in float32 (:func:`enginelib.speed.cpu_kernels.decode_attention`), the Triton one on a CUDA GPU
(:func:`enginelib.speed.triton_kernels.decode_attention_op`); each writes the new K/V and reads keys through the
block tables, called by the compiled code itself: the
block tables, the context lengths and the cache's pools are inputs of the graph,
the tables padded to a fixed width and padding rows given no keys, so one graph
serves every step and no Python runs between the layers. Nothing in such a step reads a value on the host, so
with ``mode="reduce-overhead"`` on a GPU one CUDA graph per bucket captures the whole step (vLLM's ``FULL``
CUDA graphs), the cache's pools marked as static inputs that the graph writes in place. A sequence verifying
guesses becomes one row per token, each with the sequence's block table and
its own context length (its position + 1): the C++ kernel writes every row's K/V
before any row attends, so each guess sees the ones before it, causally. (The Triton kernel's programs run in
no set order, so with it verification steps run eagerly.)
Elsewhere attention is an opaque custom operator, ``enginelib::paged_attend``, that is given
everything it reads and writes, as the C++ kernel is: one layer's pools (which it writes the new K/V
into, a mutation it declares), the slots, the block tables padded to the same fixed width, the step's
mask, and the numbers of real rows and table columns on the host. It runs the engine's own gather and
SDPA (:func:`enginelib.step.attention.paged_attention`) over the columns in use. With
``mode="reduce-overhead"`` on a GPU, inductor's graph partition replays CUDA graphs for the pieces
between the attention calls. Nothing is bound or kept between calls, so engines in one process, or in
two threads, share no state through this module.

With ``freeze`` on a CPU where ``load_model`` chose to pack (``model.packing``), the traced model's float32
linears call oneDNN's matmul on a weight packed in the graph (:class:`_OneDNNLinear`); freezing folds that
packing into a constant once, so each step runs the kernel the eager engine's packed linears run, and
inductor's own freezing, which would pack float32 weights for MKL instead, finds no plain matmul to repack.
Where the timing chose plain linears, the frozen graph keeps them too and inductor packs them for MKL.
"""
from __future__ import annotations

import copy
import shutil
import time
from collections import Counter
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, ExitStack, nullcontext
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

import enginelib.env as env
from enginelib.config import CompileConfig
from enginelib.model.device import unpack_linears
from enginelib.model.transformer import Transformer, attention_mask
from enginelib.speed import cpu_kernels, paths
from enginelib.step.attention import AttentionGroup, PagedPools, paged_attention
from enginelib.step.batch import Batch, SequenceWork, to_device

RECOMPILE_LIMIT = "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else "cache_size_limit"
TRACING_RECOMPILE_LIMIT = 1024  # graphs per code object while a bucket traces: every decoder's buckets, all engines


FUSED_KERNELS = ("cpp", "triton")


def fused_kernel(device: torch.device | str, dtype: torch.dtype, asked: bool | str | None = None) -> str | None:
    """The decode kernel a compiled step calls from its graph: "cpp" (ours, a CPU in float32), "triton" (ours, a
    CUDA GPU, or a CPU under Triton's interpreter for tests), or None: the opaque :func:`paged_attend` operator.

    ``asked``: None, the device's kernel where it runs; False, the operator; True, the device's kernel or a
    ``ValueError`` saying why it cannot run; a kernel's name, that kernel or the error."""
    device = torch.device(device)

    def why_not(kernel: str) -> str | None:
        if kernel == "cpp":
            return cpu_kernels.unavailable(device, dtype)
        from enginelib.speed import triton_kernels  # only where Triton is asked for or the device is a GPU
        return triton_kernels.unavailable(device, dtype)

    if asked is False:
        return None
    if isinstance(asked, str) and asked not in FUSED_KERNELS:
        raise ValueError(f"fused_attention names a kernel of {FUSED_KERNELS}, got {asked!r}")
    kernel = asked if isinstance(asked, str) else {"cpu": "cpp", "cuda": "triton"}.get(device.type)
    reason = why_not(kernel) if kernel else f"no fused decode kernel runs on {device.type}"
    if reason and asked is not None:
        raise ValueError(f"fused_attention={asked!r} cannot run here: {reason}")
    return None if reason else kernel


def compile_unavailable(device: torch.device | str) -> str | None:
    """Why ``torch.compile`` cannot build kernels for ``device`` here, or None if it can.

    On a CPU inductor writes C++ and needs a compiler; on a GPU it writes Triton.
    """
    device = torch.device(device)
    if device.type == "cpu":
        cxx = env.cxx("c++") or "c++"  # an empty $CXX too
        if shutil.which(cxx) is None and shutil.which("g++") is None and shutil.which("clang++") is None:
            return ("torch.compile on a CPU needs a C++ compiler and none was found (tried $CXX, c++, g++, clang++): "
                    "install one (Debian/Ubuntu: apt-get install g++; macOS: xcode-select --install) or set $CXX")
        return None
    if device.type == "cuda":
        try:
            import triton  # noqa: F401  (inductor's GPU code generator)
        except ImportError:
            return "torch.compile on a GPU needs Triton: pip install triton (it ships with the CUDA wheels of torch)"
        return None
    return f"compiling is not supported on {device.type} here: use compile=None (eager)"


# --- attention as an opaque operator --------------------------------------------------------

# cudagraph_unsafe: with CUDA graphs (mode="reduce-overhead") inductor cuts the graph around this operator and
# replays the pieces between, since what it reads (block tables, slots) changes every step
_UNSAFE_IN_CUDA_GRAPHS = tuple(t for t in (getattr(torch.Tag, "cudagraph_unsafe", None),) if t is not None)


@torch.library.custom_op("enginelib::paged_attend", mutates_args=("k_pool", "v_pool"), tags=_UNSAFE_IN_CUDA_GRAPHS)
def paged_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                 slot_mapping: torch.Tensor, block_tables: torch.Tensor, mask: torch.Tensor,
                 sizes: torch.Tensor) -> torch.Tensor:
    """One layer's attention of a padded step over the paged pool: rows past the real ones get zeros.

    q: [1, P, H, D]; k, v: [1, P, KV, D]; k_pool, v_pool: the layer's pools [blocks, block_size, KV, D], into
    which the real rows' K/V are written at ``slot_mapping`` [P]; block_tables: [P, width] a table per row
    (a sequence verifying guesses repeats its own), padded to a fixed width; mask: [P, 1, 1, width *
    block_size] additive, each row's keys up to its own position; sizes: int64 on the host, (real rows,
    table columns in use). The last two slice the fixed shapes down to the step's: read on the host,
    they cost no wait on a GPU, and the graph around the call keeps one shape per bucket.
    """
    n, width = sizes.tolist()
    kv, d = k_pool.shape[2:]
    k_pool.view(-1, kv, d).index_copy_(0, slot_mapping[:n], k[0, :n])
    v_pool.view(-1, kv, d).index_copy_(0, slot_mapping[:n], v[0, :n])
    every = torch.arange(n, device=q.device)  # one query per row: the group is the whole of the real rows
    group = AttentionGroup(every, block_tables[:n, :width].flatten(), mask[:n, ..., :width * k_pool.shape[1]],
                            every, every, whole=True)
    out = q.new_zeros(q.shape)
    out[0, :n] = paged_attention(q[0, :n], k_pool, v_pool, group)
    return out


@paged_attend.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
      slot_mapping: torch.Tensor, block_tables: torch.Tensor, mask: torch.Tensor, sizes: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(q)


@dataclass
class _OpaqueCache:
    """What the traced model sees as its cache where no fused kernel runs: the step's slots, tables,
    mask and sizes and the pools, all inputs of the graph, and a call of :func:`paged_attend` per layer."""

    slot_mapping: torch.Tensor  # [P], the padding rows' never written
    block_tables: torch.Tensor  # [P, width], a table per row, padded
    mask: torch.Tensor          # [P, 1, 1, width * block_size], built once per step in the graph
    sizes: torch.Tensor         # host int64: (real rows, table columns in use)
    k: torch.Tensor             # the cache's pools, [layers, blocks, block_size, KV, D]
    v: torch.Tensor

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return torch.ops.enginelib.paged_attend(q, k, v, self.k[layer], self.v[layer], self.slot_mapping,
                                                self.block_tables, self.mask, self.sizes)


def row_mask(positions: torch.Tensor, num_keys: int, num_groups: int, dtype: torch.dtype) -> torch.Tensor:
    """The additive mask [P, 1, 1, num_keys] of rows that each attend to the keys up to their own position, as
    the engine's decode group builds it (:func:`enginelib.step.attention.attention_groups`)."""
    keys = torch.arange(num_keys, device=positions.device)
    return attention_mask((keys[None, :] <= positions[:, None])[:, None, None], num_groups, dtype)


def token_tables(batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """A block table [N, width] and a context length [N] per token of a step in which every token gets logits: a decode
    row is its sequence's; a sequence verifying guesses repeats its table for each of its tokens, each with the keys up
    to its own position. The repeats come from the host's query lengths, and so does the output's size: a
    ``repeat_interleave`` not told it would make the host wait for the device to count it."""
    if batch.num_tokens == batch.num_seqs:
        return batch.block_tables, batch.context_lens
    repeats = to_device(batch.query_lens, batch.block_tables.device)  # one copy that does not block
    return batch.block_tables.repeat_interleave(repeats, dim=0, output_size=batch.num_tokens), batch.positions + 1


@dataclass
class _GraphCache:
    """What the traced model sees as its cache where a fused decode kernel runs: the step's tables and the
    pools, all inputs of the graph, and a call of the kernel per layer (it writes the new K/V)."""

    block_tables: torch.Tensor  # [B, width], padded
    context_lens: torch.Tensor  # [B], 0 for the padding rows
    k: torch.Tensor             # the cache's pools, [layers, blocks, block_size, KV, D]
    v: torch.Tensor
    kernel: str                 # "cpp" or "triton" (:func:`fused_kernel`)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        op = (torch.ops.enginelib.decode_attention if self.kernel == "cpp"
              else torch.ops.enginelib.triton_decode_attention)
        return op(q[0].contiguous(), k[0].contiguous(), v[0].contiguous(), self.k[layer], self.v[layer],
                  self.block_tables, self.context_lens)[None]


# --- the compiled decoder --------------------------------------------------------------------

@dataclass
class CompileReport:
    """What compiling cost: seconds per bucket (trace + code generation + a first run)."""

    device: str
    mode: str | None
    seconds: dict[int, float]

    @property
    def total_seconds(self) -> float:
        return sum(self.seconds.values())


def _options(config: CompileConfig, device: torch.device) -> dict:
    """Inductor's options for ``config`` on ``device``: ``mode``'s own, and the graph cut at attention for CUDA graphs.

    Given as options rather than ``mode=`` because torch.compile takes one or the other.
    """
    options = dict(torch._inductor.list_mode_options(config.mode)) if config.mode else {}
    # the checks of each operator's output shape cost ~1 ms a step at batch 1; the graph is traced from this model
    options |= {"size_asserts": False, "alignment_asserts": False}
    if device.type == "cpu" and config.cpp_wrapper:
        options["cpp_wrapper"] = True
    if cpu_kernels.unavailable(device) is None:  # our operators' build in the graphs' cache keys
        options["unsafe_marked_cacheable_functions"] = cpu_kernels.graph_cache_keys()
    if options.get("triton.cudagraphs") and hasattr(torch._inductor.config, "graph_partition"):
        options["graph_partition"] = True  # replay graphs between the attention calls, not skip the whole step
    return options


@torch.library.custom_op("enginelib::onednn_packed_weight", mutates_args=())
def onednn_packed_weight(weight: torch.Tensor, rows: int) -> torch.Tensor:
    """``weight`` [out, in] reordered for oneDNN's matmul of ``rows`` rows (the eager :class:`PackedLinear`'s).

    In a frozen graph the weight is a constant, so freezing runs this once and keeps the result.
    """
    return torch.ops.mkldnn._reorder_linear_weight(weight, rows)


@onednn_packed_weight.register_fake
def _(weight: torch.Tensor, rows: int) -> torch.Tensor:
    return torch.empty_like(weight)  # the packed tensor keeps the weight's logical shape


class _OneDNNLinear(nn.Linear):
    """A float32 Linear whose traced matmul is oneDNN's, on a weight packed in the graph, for frozen graphs.

    On x86 inductor's freezing packs a plain float32 linear for MKL's ``_mkl_linear`` (oneDNN's
    ``_linear_pointwise`` only for 16-bit weights). On the 2-core AMD CPU the book is tested on, oneDNN's
    runs the decode shapes 1.3-2x faster (32 x 576 by 1536 x 576: 268 against 393 us; the LM head: 10.9
    against 23.2 ms), and a frozen batch-32 step went from 118 to 58 ms. Here the traced graph already
    calls ``_linear_pointwise``, the op the eager engine calls, on :func:`onednn_packed_weight` of a
    constant, which freezing folds: nothing is left for inductor to repack. Unfrozen, the packing would
    run every step, so only frozen graphs get these.
    """

    def __init__(self, linear: nn.Linear) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        packed = torch.ops.enginelib.onednn_packed_weight(self.weight, x.numel() // x.shape[-1])
        return torch.ops.mkldnn._linear_pointwise(x, packed, self.bias, "none", [], "")


def onednn_linears(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose plain float32 CPU linears are :class:`_OneDNNLinear`, sharing every weight
    (``model`` itself where oneDNN's linear is missing or no linear qualifies)."""
    def qualifies(m: nn.Module) -> bool:
        return type(m) is nn.Linear and m.weight.dtype == torch.float32 and m.weight.device.type == "cpu"

    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
            and any(qualifies(m) for m in model.modules())):
        return model
    tensors = [*model.parameters(), *model.buffers(),
               *(t for m in model.modules() for t in vars(m).values() if isinstance(t, torch.Tensor))]
    copied = copy.deepcopy(model, {id(t): t for t in tensors})  # new modules, the same tensors
    for module in list(copied.modules()):
        for name, child in list(module.named_children()):
            if qualifies(child):
                setattr(module, name, _OneDNNLinear(child))
    return copied


def requested_path(config: CompileConfig) -> str:
    """A compile config as :mod:`enginelib.speed.paths` records what was asked for: "torch.compile (mode=default)"."""
    return f"torch.compile (mode={config.mode or 'default'})"


def fell_back_to_eager(config: CompileConfig, why: str) -> None:
    """Record that an engine runs eagerly although ``config`` asked for compiled decode, because of ``why`` (the
    runner's ``CompileConfig(fallback=True)``): under ``$ENGINELIB_STRICT_PATHS=1`` this raises instead."""
    paths.fell_back("compiled decode", requested_path(config), "eager", why)


def _cudagraph_skips() -> int:
    """How many graphs inductor has built without the CUDA graphs asked for, in this process (its own counter)."""
    from torch._dynamo.utils import counters

    return counters["inductor"]["cudagraph_skips"]


@dataclass
class _Built:
    """One graph inductor built: its function, the tensors dynamo traced it with, what its first call returned."""

    fn: Callable[..., Sequence[torch.Tensor]]
    example_inputs: list[torch.Tensor]
    first_outputs: Sequence[torch.Tensor] | None = None


class _KeepBuilt:
    """torch.compile's backend: inductor (``compile_fx`` with our options), keeping each graph it builds, so that
    once a bucket is traced the engine can call its graph itself (:meth:`CompiledDecoder._direct_call`)."""

    compiler_name = "inductor"

    def __init__(self, options: dict) -> None:
        self.options = options
        self.built: list[_Built] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor], **kwargs) -> Callable:
        from torch._inductor.compile_fx import compile_fx
        patches = {**self.options, **kwargs.get("config_patches", {})}
        built = _Built(compile_fx(gm, example_inputs, config_patches=patches), list(example_inputs))
        self.built.append(built)

        def first_call_recorded(*args):
            outputs = built.fn(*args)
            if built.first_outputs is None:
                built.first_outputs = outputs
            return outputs
        return first_call_recorded


class CompiledDecoder:
    """Runs steps in which every token gets logits (decode, verification of guesses) through one compiled
    graph per bucket of tokens.

    ``__call__(batch, cache)`` returns the logits of the batch's rows, [N, vocab],
    the rows the eager step would compute. ``compile()`` builds every bucket up
    front and reports what it cost.
    """

    def __init__(self, model: Transformer, config: CompileConfig | None = None, *,
                 fused_attention: bool | str | None = None, what: str = "compiled decode") -> None:
        """``fused_attention``: None, our fused decode kernel wherever one runs (:func:`fused_kernel`: C++ on a CPU
        in float32, Triton on a CUDA GPU), else the opaque :func:`paged_attend`; False asks for the operator
        anywhere; "triton" asks for the Triton kernel (on a CPU, the GPU's whole-step path under Triton's
        interpreter, for tests). ``what``: the name its paths are recorded under (:mod:`enginelib.speed.paths`),
        e.g. "compiled draft"."""
        self.config = config = config or CompileConfig()
        self.what = what
        reason = compile_unavailable(model.device)
        if reason:
            raise ValueError(reason)
        self.freeze = model.device.type == "cpu" and config.freeze
        self.model = unpack_linears(model)  # same weights; eager steps keep the packed linears
        packing = getattr(model, "packing", None)  # load_model's verdict: does oneDNN's packed matmul pay here?
        if self.freeze and (packing is None or packing.pack):
            self.model = onednn_linears(self.model)  # else inductor's freezing packs the plain linears for MKL
        options = _options(config, model.device)
        # where a fused kernel runs, attention reads the paged cache in it (no gather, no mask, no SDPA call)
        self.kernel = fused_kernel(model.device, model.dtype, fused_attention)
        if self.kernel == "cpp":
            cpu_kernels.load()  # the traced step calls the operator itself: built and registered first
        forward = self._forward_fused if self.fused_attention else self._forward
        # on a CPU, inductor through a backend that keeps what it builds, so that traced buckets can be called
        # directly (CUDA, untested that way here, keeps torch.compile's own inductor backend)
        self._backend = _KeepBuilt(options) if model.device.type == "cpu" else None
        self._step = (torch.compile(forward, dynamic=False, backend=self._backend) if self._backend
                      else torch.compile(forward, dynamic=False, options=options))
        self.cuda_graphs = model.device.type == "cuda" and bool(options.get("triton.cudagraphs"))
        # per bucket, once traced (CPU): its graph called directly, without dynamo's frame hook and guards
        self.direct: dict[int, Callable[[tuple[torch.Tensor, ...]], torch.Tensor]] = {}
        self.report: CompileReport | None = None
        self.calls: Counter[int] = Counter()  # steps run per bucket

    def _forward(self, token_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                 block_tables: torch.Tensor, sizes: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        cfg = self.model.cfg
        mask = row_mask(positions, block_tables.shape[1] * k.shape[2], cfg.num_heads // cfg.num_kv_heads, k.dtype)
        return self.model(token_ids, _OpaqueCache(slot_mapping, block_tables, mask, sizes, k, v), positions=positions)[0]

    def _forward_fused(self, token_ids: torch.Tensor, positions: torch.Tensor, block_tables: torch.Tensor,
                       context_lens: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        cache = _GraphCache(block_tables, context_lens, k, v, self.kernel)
        return self.model(token_ids, cache, positions=positions)[0]

    @property
    def fused_attention(self) -> bool:
        """Whether attention runs in one of our fused decode kernels inside the graph (else :func:`paged_attend`)."""
        return self.kernel is not None

    def table_width(self, cache: PagedPools) -> int:
        """The fixed width the block tables are padded to: the blocks of the longest possible sequence."""
        return min(cache.num_blocks, -(-self.model.cfg.context_length // cache.block_size))

    def bucket(self, num_tokens: int) -> int | None:
        """The smallest compiled size that holds ``num_tokens`` rows (None: run eagerly)."""
        return next((b for b in self.config.batch_sizes if b >= num_tokens), None)

    def serves(self, batch: Batch) -> bool:
        """A step whose every token is sampled (decode, or verification of guesses) that fits a bucket. With the Triton
        kernel, decode only: its programs run in no set order, so a guess's row could read the keys of the guess before
        it before that row's program has written them (the C++ kernel writes every row's first); verification runs
        eagerly there."""
        if self.kernel == "triton" and batch.num_tokens != batch.num_seqs:
            return False
        return batch.num_tokens == len(batch.logits_indices) and self.bucket(batch.num_tokens) is not None

    def _tracing(self, size: int) -> AbstractContextManager:
        """The settings a bucket's first call traces under, for that call only (patching the config costs
        ~0.2 ms, too much for every step, and a process-wide change would reach other code).

        Dynamo keeps compiled graphs per code object, so every decoder's buckets count against one recompile
        limit (8 by default): it is raised while tracing, when dynamo consults it. With ``freeze``, inductor's
        freezing is on: dynamo decides when it traces whether the weights become constants of the graph or
        inputs passed on every call, so torch.compile's ``options`` (applied later, in inductor) come too late."""
        if self.calls[size] > 1:
            return nullcontext()
        settings = ExitStack()
        settings.enter_context(torch._dynamo.config.patch({RECOMPILE_LIMIT: TRACING_RECOMPILE_LIMIT}))
        if self.freeze:
            settings.enter_context(torch._inductor.config.patch(freezing=True))
        return settings

    @property
    def requested(self) -> str:
        """What the config asks for, as :mod:`enginelib.speed.paths` records it."""
        return requested_path(self.config)

    def _run(self, size: int, args: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """The bucket's graph on ``args``: directly once it is traced, else through dynamo (tracing it).

        A bucket's first call (the one that traces and builds it) records the path it took, or its failure:
        a caller that then runs eagerly (the runner's ``fallback``, a chapter's ``except``) is seen doing so."""
        direct = self.direct.get(size)
        if direct is not None:
            return direct(args)
        built = len(self._backend.built) if self._backend else 0
        first = self.calls[size] <= 1
        skips = _cudagraph_skips() if first and self.cuda_graphs else 0
        try:
            with self._tracing(size):
                out = self._step(*args)
        except Exception as error:  # recorded, and raised on: the caller decides whether to run eagerly
            if first:
                paths.fell_back(self.what, self.requested, "not compiled (eager where the caller falls back)",
                                f"{type(error).__name__}: {str(error).strip()[:300]}")
            raise
        if first:
            self._record_paths(_cudagraph_skips() - skips if self.cuda_graphs else 0)
        if self._backend and len(self._backend.built) == built + 1:  # this call traced the bucket, in one graph
            self.direct[size] = self._direct_call(self._backend.built[-1], args, out)
        return out

    def _record_paths(self, cudagraph_skips: int) -> None:
        """Record the compiled path a bucket's first call took: its attention, and on a GPU with CUDA graphs
        (``mode="reduce-overhead"``) whether inductor replays them or skipped them, which it only logs."""
        kernels = {"cpp": "our C++ decode kernel", "triton": "our Triton decode kernel"}
        attention = kernels.get(self.kernel, "the paged_attend operator")
        paths.ran(self.what, f"{self.requested}, attention in {attention}" + (", frozen" if self.freeze else ""),
                  requested=self.requested)
        if not self.cuda_graphs:
            return
        if cudagraph_skips:
            paths.fell_back("CUDA graphs", f"mode={self.config.mode}", "no CUDA graphs",
                            "inductor skipped CUDA graphs for this step's graph (TORCH_LOGS=cudagraphs says why)")
        else:
            paths.ran("CUDA graphs", "inductor's CUDA graphs, " + ("the whole step in one graph" if self.fused_attention
                                                                   else "replayed between the attention calls"),
                      requested=f"mode={self.config.mode}")

    @staticmethod
    def _direct_call(built: _Built, args: tuple[torch.Tensor, ...], out: torch.Tensor) -> Callable | None:
        """How to call ``built`` with a step's ``args`` and get what dynamo's call returned, or None when
        the trace was not the whole function (the graph's one output is not what the call returned).

        Dynamo calls a graph with the tensors it found while tracing: the step's arguments, then the model's
        weights and buffers (its constants, the same tensors every step). Its frame hook and guards cost
        about 0.5 ms a step at batch 1 on a 2-core CPU (int4, C++ wrapper: 5.5 against 5.0 ms), a tenth of the
        step; the shapes are fixed per bucket, so the guards have nothing to check that the engine does not
        already ensure."""
        outputs = built.first_outputs
        if outputs is None or len(outputs) != 1 or outputs[0] is not out:
            return None
        where = {id(a): i for i, a in enumerate(args)}
        plan = [where.get(id(x), x) for x in built.example_inputs]  # an argument's index, or a constant tensor
        fn = built.fn

        def call(step_args: tuple[torch.Tensor, ...]) -> torch.Tensor:
            return fn(*[step_args[p] if isinstance(p, int) else p for p in plan])[0]
        return call

    @torch.inference_mode()
    def __call__(self, batch: Batch, cache: PagedPools) -> torch.Tensor:
        size = self.bucket(batch.num_tokens)
        self.calls[size] += 1
        pad = size - batch.num_tokens
        token_ids, positions = batch.token_ids, batch.positions
        if pad:
            token_ids, positions = F.pad(token_ids, (0, pad)), F.pad(positions, (0, pad))
        batch.check_pool(cache.num_blocks)  # on the host, once for the step's 30 attention calls (the kernel trusts them)
        rows, lens = token_tables(batch)  # a table per token, padded to the fixed width: the graph's shapes are fixed
        tables = rows.new_zeros(size, self.table_width(cache))
        tables[:batch.num_tokens, :rows.shape[1]] = rows
        if self.cuda_graphs:  # a new step: the graphs may overwrite the last step's outputs
            torch.compiler.cudagraph_mark_step_begin()
            for pool in (cache.k, cache.v):  # the same tensors every step, written in place: the graphs keep them
                torch._dynamo.mark_static_address(pool)
        if self.fused_attention:
            logits = self._run(size, (token_ids, positions, tables, F.pad(lens, (0, pad)), cache.k, cache.v))
        else:
            sizes = torch.tensor([batch.num_tokens, rows.shape[1]])  # on the host: read with no wait on a GPU
            logits = self._run(size, (token_ids, positions, F.pad(batch.slot_mapping, (0, pad)), tables, sizes,
                                      cache.k, cache.v))
        # a CUDA graph's output lives in its memory pool, which the next replay reuses: keep a copy
        return logits[:batch.num_tokens].clone() if self.cuda_graphs else logits[:batch.num_tokens]

    def compile(self, cache: PagedPools) -> CompileReport:
        """Trace and build every bucket now, on a throwaway batch that writes only block 0, then clear it."""
        seconds = {}
        try:
            for size in self.config.batch_sizes:
                batch = Batch.build([SequenceWork([0], 0, [0])] * size, cache.block_size, self.model.device)
                start = time.perf_counter()
                self(batch, cache)
                if self.model.device.type == "cuda":
                    torch.cuda.synchronize(self.model.device)
                seconds[size] = time.perf_counter() - start
        finally:
            self.calls.clear()
            cache.k[:, 0].zero_()
            cache.v[:, 0].zero_()
        self.report = CompileReport(str(self.model.device), self.config.mode, seconds)
        return self.report
