"""Where the model runs: device, dtype and CPU threads, chosen in one place."""
from __future__ import annotations

import contextlib
import copy
import os

import torch
import torch.nn.functional as F
from torch import nn

import enginelib.env as env


def pick_device(device: str | torch.device | None = None) -> torch.device:
    """CUDA when present, else CPU; an explicit choice always wins."""
    if device is not None:
        return torch.device(device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


_NO_RANGE = contextlib.nullcontext()


def record_function(name: str) -> contextlib.AbstractContextManager:
    """``torch.profiler.record_function(name)`` while a profiler records, else nothing: the engine names 5 phases
    a step, and a range costs ~4 us even with no profiler on (0.6% of a 3.7 ms single-stream step on a Xeon)."""
    return torch.profiler.record_function(name) if torch.autograd._profiler_enabled() else _NO_RANGE


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """Each row's likeliest token, the first of ties: [B, V] -> int64 [B]. Float32 rows on a CPU go through numpy's
    argmax, a plain SIMD scan: over SmolLM2's 49,152 logits it took 9-23 us where torch's ``max(dim=-1)`` took 40-47
    and ``argmax`` 77-86 (a 2-core Xeon, warm and cold caches), in a decode step of ~2.6 ms."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and not logits.requires_grad:
        return torch.from_numpy(logits.numpy().argmax(axis=-1))
    return logits.max(dim=-1).indices  # the first of ties too (on a CPU, faster than torch's argmax, above)


DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def default_dtype(device: torch.device | str | None = None) -> torch.dtype:
    """float32 on every device, unless ``$ENGINELIB_DTYPE`` (float32|float16|bfloat16) says otherwise.

    A 135M model in float32 fits a T4 easily and keeps greedy tokens exactly
    equal across batch shapes, which the chapters check; float16 does not keep
    every argmax (see :mod:`enginelib.model.checks`) and is the quantization chapter's
    subject. The variable runs the tests or any chapter in another dtype, also on
    a CPU, so the code a GPU would run in float16 is exercised everywhere.
    ``device`` is accepted so that a per-device choice can come back without
    changing callers; today the answer is the same on every device.
    """
    name = env.dtype_name("float32")
    if name not in DTYPES:
        raise ValueError(f"ENGINELIB_DTYPE={name!r} is not a dtype enginelib runs in: "
                         f"set it to one of {', '.join(DTYPES)} (or unset it for float32)")
    return DTYPES[name]


def free_gpu_memory(device: torch.device | str) -> int:
    """Bytes of GPU memory a new allocation can still use on ``device``.

    ``torch.cuda.mem_get_info`` counts what PyTorch's caching allocator has
    reserved as used, even the part no tensor holds any more (a freed KV pool,
    a model's temporaries). Taken alone, it shrinks with every later Engine in
    one process. That reserved-but-unallocated memory is free to PyTorch, so it
    is added back: ``free + memory_reserved - memory_allocated``.
    """
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


def set_threads(threads: int | None = None) -> int:
    """Set torch's CPU thread count and return it.

    Two busy processes on a shared 2-core machine can slow a decode step 10x,
    so we default to a modest count: ``$ENGINELIB_THREADS``, else at most 4.
    """
    if threads is None:
        threads = env.threads(min(4, os.cpu_count() or 1))
    if threads < 1:
        raise ValueError(f"threads must be at least 1, got {threads}")
    torch.set_num_threads(threads)
    return threads


class PackedLinear(nn.Linear):
    """A Linear whose weight is also kept pre-arranged ("packed") for oneDNN's CPU matmul.

    Decode multiplies a few rows by big weight matrices; oneDNN's kernels on a
    packed copy ran these shapes up to 2x faster than the default BLAS call on one CPU and slower on
    another, so load_model packs only where a timing says it pays (:mod:`enginelib.model.packing`).
    The original ``weight`` stays (for inspection, and for any input the packed
    copy does not serve: another device or dtype). Pack after the weights are final.
    """

    def __init__(self, linear: nn.Linear) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "cpu" or x.dtype != torch.float32 or self.weight.device.type != "cpu":
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def can_pack(model: nn.Module) -> bool:
    """Packing is possible for float32 weights on a CPU whose torch build has oneDNN (whether it pays: packing.py)."""
    weight = next(model.parameters())
    return (weight.device.type == "cpu" and weight.dtype == torch.float32
            and torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


def unpack_linears(model: nn.Module) -> nn.Module:
    """A copy of ``model`` with plain ``nn.Linear`` where it has :class:`PackedLinear`, sharing every weight.

    For ``torch.compile``: it cannot trace oneDNN's packed tensors, and on a CPU
    inductor packs the weights itself. Only the module objects are new.
    """
    if not any(isinstance(m, PackedLinear) for m in model.modules()):
        return model
    shared = [*model.parameters(), *model.buffers(), *(m.packed for m in model.modules() if isinstance(m, PackedLinear))]
    plain = copy.deepcopy(model, {id(t): t for t in shared})
    for module in list(plain.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, PackedLinear):
                linear = nn.Linear(child.in_features, child.out_features, bias=False, device="meta")
                linear.weight, linear.bias = child.weight, child.bias
                setattr(module, name, linear)
    return plain


def pack_linears(model: nn.Module) -> int:
    """Swap every ``nn.Linear`` in ``model`` for a :class:`PackedLinear`; return how many."""
    swapped = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is nn.Linear:
                setattr(module, name, PackedLinear(child))
                swapped += 1
    return swapped


class HostBuffer:
    """A CPU step's numbers written into one int64 tensor kept from step to step, and cut into views kept by their
    sizes, as vLLM keeps persistent input buffers: made afresh each step, the tensor and its views took ~45 us more
    (a 2-core Xeon, the caches cold after the step's weights). The views are overwritten by the next write: they
    serve one step's batch, used before the next is built."""

    KEEP = 64  # sets of views kept (a decode's sizes change every block_size tokens)

    def __init__(self, size: int = 4096) -> None:
        self.tensor = torch.empty(size, dtype=torch.long)
        self.array = self.tensor.numpy()  # numpy writes a list of ints in place, without torch's dispatcher
        self.views: dict[tuple[int, ...], tuple[torch.Tensor, ...]] = {}

    def write(self, values: list[int], sizes: tuple[int, ...]) -> tuple[torch.Tensor, ...]:
        """``values`` (``sum(sizes)`` of them) as consecutive views of ``sizes``, as ``tensor.split(sizes)``."""
        if len(values) > len(self.array):
            self.__init__(2 * len(values))
        if sizes not in self.views:
            if len(self.views) >= self.KEEP:
                self.views.clear()
            self.views[sizes] = self.tensor[:len(values)].split(sizes)
        self.array[:len(values)] = values
        return self.views[sizes]


def to_device(values: list[int], device: torch.device | str) -> torch.Tensor:
    """One int64 tensor on ``device`` in one copy that does not block the host (pinned memory on a GPU: the only kind an
    asynchronous copy runs from). Split it into views there rather than copying pieces one by one."""
    device = torch.device(device)
    host = torch.tensor(values, dtype=torch.long, pin_memory=device.type == "cuda")
    return host.to(device, non_blocking=True)
