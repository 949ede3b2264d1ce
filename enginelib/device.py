"""Where the model runs: device, dtype and CPU threads, chosen in one place."""
from __future__ import annotations

import os

import torch


def pick_device(device: str | torch.device | None = None) -> torch.device:
    """CUDA when present, else CPU; an explicit choice always wins."""
    if device is not None:
        return torch.device(device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def default_dtype(device: torch.device) -> torch.dtype:
    """float16 on a GPU (a T4 has no fast bfloat16), float32 on a CPU."""
    return torch.float16 if device.type == "cuda" else torch.float32


def set_threads(threads: int | None = None) -> int:
    """Set torch's CPU thread count and return it.

    Two busy processes on a shared 2-core machine can slow a decode step 10x,
    so we default to a modest count: ``$ENGINELIB_THREADS``, else at most 4.
    """
    if threads is None:
        threads = int(os.environ.get("ENGINELIB_THREADS", min(4, os.cpu_count() or 1)))
    if threads < 1:
        raise ValueError(f"threads must be at least 1, got {threads}")
    torch.set_num_threads(threads)
    return threads
