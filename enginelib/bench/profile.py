"""Where an engine step's time goes: its phases, and the forward pass by kind of operator (torch.profiler)."""
from __future__ import annotations

import functools
import sys
import time
from contextlib import contextmanager

import torch
from torch.profiler import record_function

from enginelib.core.engine import Engine

PHASES = ("schedule", "prepare", "forward", "sample", "update")
REST = "outputs & rest"  # the step's wall time outside the phases: its outputs (detokenizing, stop checks) and more
OP_KINDS = {"aten::linear": "matmuls", "aten::matmul": "matmuls", "aten::mm": "matmuls",
            "aten::addmm": "matmuls", "aten::index_select": "KV gather", "aten::index_copy_": "KV write",
            "mkldnn::_linear_pointwise": "matmuls"}
PHASE_MODULES = ("enginelib.core.engine", "enginelib.core.runner")  # where the engine marks its phases


def _op_kind(name: str) -> str:
    if "scaled_dot_product" in name:
        return "attention"
    return OP_KINDS.get(name, "other ops")


def profile_steps(engine: Engine, steps: int = 8) -> dict[str, float]:
    """Run ``steps`` engine steps under torch.profiler; seconds per step by where they went.

    The step's phases (schedule, prepare, forward, sample, update) are the
    engine's own ``record_function`` ranges. The forward pass is split further
    into kinds of operators, each outermost operator booked with everything it
    calls (the "KV gather" is every outermost ``index_select``: keys and values
    through block tables, plus, in a step that mixes prefills and decodes, the
    few query rows shuffled into groups; the embedding's, under
    ``aten::embedding``, is an "other op");
    what is left of it is Python and dispatch overhead: time between operators.
    The parts add up to the forward pass. :data:`REST` is the step's wall time
    that no phase covers, mostly making its outputs (detokenizing, stop checks):
    the phases and it add up to the step.

    On a CPU these are CPU times. On a GPU the host only launches kernels and
    returns, and waits for them where it reads results back (in "sample"): CPU
    times would book the kernels' work there. So on a GPU each phase waits for
    its kernels before it ends (``torch.cuda.synchronize`` at the end of every
    range, for the profiled steps only): a phase's time is then its wall time,
    the kernels it launched included. The CUDA activity is recorded too, and
    each kind of operator is booked with the device time of the kernels it
    launched; "forward: python & dispatch" is then the forward's wall time not
    covered by its kernels: the time the GPU waited for the host to launch the
    next one.
    """
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    on_gpu = engine.model.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    if on_gpu:
        torch.cuda.synchronize(engine.model.device)  # earlier work must not land in the first phase
    wall = 0.0
    with _synchronized_phases(engine.model.device if on_gpu else None), profile(activities=activities) as prof:
        for _ in range(steps):
            start = time.perf_counter()
            engine.step()
            wall += time.perf_counter() - start

    def spent(event) -> float:  # microseconds of an operator: on a GPU, the kernels it and its children ran
        return event.device_time_total if on_gpu else event.cpu_time_total

    per_step: dict[str, float] = {}
    for event in prof.events():
        if event.device_type != DeviceType.CPU:
            continue  # the GPU-side copies of the ranges ("gpu_user_annotation"): their kernels are counted below
        if event.name in PHASES:  # wall time of the range: on a GPU it waited for its kernels
            per_step[event.name] = per_step.get(event.name, 0.0) + event.cpu_time_total
        parent = event.cpu_parent
        while parent is not None and parent.name not in PHASES:
            parent = parent.cpu_parent
        if parent is not None and parent.name == "forward" and _is_op(event) and not _under_op(event):
            kind = "forward: " + _op_kind(event.name)
            per_step[kind] = per_step.get(kind, 0.0) + spent(event)
    ops = sum(v for k, v in per_step.items() if k.startswith("forward: "))
    per_step["forward: python & dispatch"] = per_step.get("forward", 0.0) - ops
    per_step[REST] = max(0.0, 1e6 * wall - sum(per_step.get(k, 0.0) for k in PHASES))
    return {k: v / 1e6 / steps for k, v in per_step.items()}  # profiler times are in microseconds


class _SynchronizedRange(record_function):
    """A ``record_function`` range that, on leaving, first waits for the GPU work queued inside it."""

    def __init__(self, name: str, args: str | None = None, *, device: torch.device) -> None:
        super().__init__(name, args)
        self.device = device

    def __exit__(self, exc_type, exc_value, traceback):
        if exc_type is None:
            torch.cuda.synchronize(self.device)
        return super().__exit__(exc_type, exc_value, traceback)


@contextmanager
def _synchronized_phases(device: torch.device | None):
    """While active, the engine's phase ranges (``record_function`` in :data:`PHASE_MODULES`) end with a
    ``torch.cuda.synchronize(device)``; nothing changes when ``device`` is None (a CPU)."""
    if device is None:
        yield
        return
    synchronized = functools.partial(_SynchronizedRange, device=device)
    modules = [sys.modules[name] for name in PHASE_MODULES if name in sys.modules]
    saved = {module: module.record_function for module in modules if hasattr(module, "record_function")}
    try:
        for module in saved:
            module.record_function = synchronized
        yield
    finally:
        for module, original in saved.items():
            module.record_function = original


def _is_op(event) -> bool:
    return event.name.startswith(("aten::", "mkldnn::"))


def _under_op(event) -> bool:
    """Whether an operator was called by another operator (count only the outermost)."""
    parent = event.cpu_parent
    while parent is not None:
        if _is_op(parent):
            return True
        parent = parent.cpu_parent
    return False
