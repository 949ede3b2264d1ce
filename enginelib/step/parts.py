"""The speed code's parts a model runner may compute its steps with (Part IV), as the core sees them. The core imports
no speed code, so one factory builds them (:func:`enginelib.speed.factory.make_speed_parts`), and the package's
``__init__``, above both, hands that factory to the runner."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from enginelib.config import EngineConfig
from enginelib.model.transformer import Transformer
from enginelib.step.attention import PagedPools


@dataclass(frozen=True)
class SpeedParts:
    """What a config asks of the speed code, built once per runner; None where it asks for nothing."""

    decode_kernel: Callable[..., torch.Tensor] | None = None  # cpu_decode_kernel: the fused decode attention
    proposer: Any = None  # speculative: anything with propose(token_ids, k) (enginelib.speed.speculative.Proposer)
    rejection_sample: Callable[..., torch.Tensor] | None = None  # verifying its guesses: sampled requests
    accept_greedy: Callable[[list[int], list[int]], list[int]] | None = None  # and greedy ones
    compiled: Any = None  # compile: the step's graphs (speed.compiled.CompiledDecoder); fused_step: FusedDecodeStep
    compile_report: Any = None  # (eager after a fallback), and what compiling took


SpeedFactory = Callable[[Transformer, EngineConfig, PagedPools], SpeedParts]
