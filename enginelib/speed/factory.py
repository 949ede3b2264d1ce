"""The one factory through which a model runner gets the speed code a config asks for (:class:`SpeedParts`): the core
imports nothing of the speed code, so the package's ``__init__`` hands :func:`make_speed_parts` to the runner. Each
part's module is imported only when a config asks for that part."""
from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from enginelib.config import EngineConfig
from enginelib.model.transformer import Transformer
from enginelib.step.attention import PagedPools
from enginelib.step.parts import SpeedParts

if TYPE_CHECKING:
    from enginelib.speed.compiled import CompiledDecoder, CompileReport


def make_speed_parts(model: Transformer, config: EngineConfig, cache: PagedPools) -> SpeedParts:
    """The parts ``config`` asks for, for a runner of ``model`` over ``cache``, built now, so that what cannot be built
    raises before the first step: the fused decode attention, a proposer and what verifies its guesses, the compiled
    decode step or the fused one."""
    decode_kernel = decode_attention_kernel(model.device, model.dtype) if config.cpu_decode_kernel else None
    proposer = rejection_sample = accept_greedy = None
    if config.speculative is not None:
        from enginelib.speed import speculative
        proposer = speculative.make_proposer(config.speculative, model, config.scheduler.max_num_seqs)
        rejection_sample, accept_greedy = speculative.rejection_sample, speculative.accept_greedy
    if config.fused_step:  # decode steps in one C++ call, the model as the GGUF stores it (it raises if it cannot)
        if config.compile is not None:
            raise ValueError("fused_step and compile are two ways to run decode steps: ask for one of them")
        from enginelib.speed.fused_step import FusedDecodeStep
        return SpeedParts(decode_kernel, proposer, rejection_sample, accept_greedy, FusedDecodeStep(model), None)
    compiled, report = compile_decoder(model, config, cache) if config.compile is not None else (None, None)
    return SpeedParts(decode_kernel, proposer, rejection_sample, accept_greedy, compiled, report)


def compile_decoder(model: Transformer, config: EngineConfig,
                    cache: PagedPools) -> tuple[CompiledDecoder | None, CompileReport | None]:
    """Build the compiled decode step for every bucket now, or say why the engine stays eager (None, None)."""
    from enginelib.speed import compiled
    compile_config = config.compile
    reason = compiled.compile_unavailable(model.device)
    # stacklevel 6: the warnings point at the line that built the Engine (through the runner and this factory)
    if reason and compile_config.fallback:
        compiled.fell_back_to_eager(compile_config, reason)  # recorded (paths); raises under ENGINELIB_STRICT_PATHS=1
        warnings.warn(f"{reason}; the engine runs eagerly", RuntimeWarning, stacklevel=6)
        return None, None
    decoder = compiled.CompiledDecoder(model, compile_config)  # raises ValueError with the reason if it cannot
    try:
        return decoder, decoder.compile(cache)
    except torch._dynamo.exc.BackendCompilerFailed as e:  # e.g. the C++ compiler rejected inductor's code
        inner = e.inner_exception
        message = f"torch.compile failed: {type(inner).__name__}: {str(inner).strip()[:300]}"
        if not compile_config.fallback:
            raise ValueError(f"{message} (CompileConfig(fallback=True) runs eagerly instead)") from e
        warnings.warn(f"{message}; the engine runs eagerly", RuntimeWarning, stacklevel=6)
        return None, None


def decode_attention_kernel(device: torch.device | str, dtype: torch.dtype) -> Callable[..., torch.Tensor]:
    """The fused decode attention for ``EngineConfig(cpu_decode_kernel=True)``, picked here only: our C++ kernel on a
    float32 CPU (built now, so a failed build raises before the first step), Triton's on a CUDA GPU (bfloat16 from
    compute capability 8.0). It writes the step's K/V and returns the attention; elsewhere: ValueError."""
    kind = torch.device(device).type
    if kind == "cpu":
        from enginelib.speed import cpu_kernels
        reason = cpu_kernels.unavailable(device, dtype)
        if reason is None:
            cpu_kernels.load()
            return torch.ops.enginelib.decode_attention
    elif kind == "cuda":
        from enginelib.speed import triton_kernels
        reason = triton_kernels.unavailable(device, dtype)
        if reason is None:
            return triton_kernels.decode_attention
    else:
        reason = f"the fused decode attention runs on a CPU (C++) or a CUDA GPU (Triton), not {kind}"
    raise ValueError(f"cpu_decode_kernel cannot be used here: {reason}")
