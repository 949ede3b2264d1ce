"""Where an engine step's time goes: its phases, and the forward pass by kind of operator (torch.profiler)."""
from __future__ import annotations

import torch

from enginelib.core.engine import Engine

PHASES = ("schedule", "prepare", "forward", "sample", "update")
OP_KINDS = {"aten::linear": "matmuls", "aten::matmul": "matmuls", "aten::mm": "matmuls",
            "aten::addmm": "matmuls", "aten::index_select": "KV gather", "aten::index_copy_": "KV write",
            "mkldnn::_linear_pointwise": "matmuls"}


def _op_kind(name: str) -> str:
    if "scaled_dot_product" in name:
        return "attention"
    return OP_KINDS.get(name, "other ops")


def profile_steps(engine: Engine, steps: int = 8) -> dict[str, float]:
    """Run ``steps`` engine steps under torch.profiler; seconds per step by where they went.

    The step's phases (schedule, prepare, forward, sample, update) are the
    engine's own ``record_function`` ranges. The forward pass is split further
    into kinds of operators by their self time (the "KV gather" is every
    ``index_select``: keys and values through block tables, plus, in a step
    that mixes prefills and decodes, the few query rows shuffled into groups);
    what is left of it is Python and dispatch overhead: time between operators.

    On a CPU these are CPU times. On a GPU the host only launches kernels and
    waits for them where it reads results back (in "sample"), so CPU times would
    book the kernels' work there. There the CUDA activity is recorded too, and
    each phase and operator kind is booked with the device time of the kernels
    it launched; the host's own time per phase is kept as "host: <phase>", and
    "forward: python & dispatch" is then the forward's host time less its kernels'.
    """
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    on_gpu = engine.model.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            engine.step()
        if on_gpu:
            torch.cuda.synchronize()

    def spent(event) -> float:  # microseconds booked to an event: on a GPU, the kernels it and its children ran
        return event.device_time_total if on_gpu else event.cpu_time_total

    per_step: dict[str, float] = {}
    for event in prof.events():
        if event.device_type != DeviceType.CPU:
            continue  # the GPU-side copies of the ranges ("gpu_user_annotation"): their kernels are counted above
        if event.name in PHASES:
            per_step[event.name] = per_step.get(event.name, 0.0) + spent(event)
            if on_gpu:
                key = "host: " + event.name
                per_step[key] = per_step.get(key, 0.0) + event.cpu_time_total
        parent = event.cpu_parent
        while parent is not None and parent.name not in PHASES:
            parent = parent.cpu_parent
        if parent is not None and parent.name == "forward" and _is_op(event) and not _under_op(event):
            kind = "forward: " + _op_kind(event.name)
            per_step[kind] = per_step.get(kind, 0.0) + spent(event)
    ops = sum(v for k, v in per_step.items() if k.startswith("forward: "))
    forward = per_step.get("host: forward", 0.0) if on_gpu else per_step.get("forward", 0.0)
    per_step["forward: python & dispatch"] = forward - ops
    return {k: v / 1e6 / steps for k, v in per_step.items()}  # profiler times are in microseconds


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
