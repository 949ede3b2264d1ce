"""enginelib: the finished code of the book's chapters, a small LLM inference engine."""
from __future__ import annotations

from enginelib.baselines.kv_cache import ContiguousKVCache
from enginelib.config import CompileConfig, EngineConfig, SamplingParams, SchedulerConfig, SpeculativeConfig
from enginelib.core.block_pool import BlockPool
from enginelib.core.engine import Engine
from enginelib.core.kv_manager import KVCacheManager
from enginelib.core.llm import LLM
from enginelib.core.outputs import CompletionOutput, RequestOutput
from enginelib.core.paged_cache import PagedKVCache
from enginelib.core.runner import ModelRunner
from enginelib.core.scheduler import Scheduler
from enginelib.model.checks import NEAR_TIE_MARGIN, Agreement, Divergence, check_greedy
from enginelib.model.device import default_dtype, pick_device, set_threads
from enginelib.model.sampling import sample
from enginelib.model.tokenizer import Tokenizer
from enginelib.model.transformer import ModelConfig, Transformer
from enginelib.model.weights import DEFAULT_MODEL, fetch, load_model
from enginelib.step.parts import SpeedParts
from enginelib.structured_output import StructuredOutput

__all__ = [
    "DEFAULT_MODEL", "LLM", "NEAR_TIE_MARGIN", "Agreement", "BlockPool", "CompileConfig", "CompletionOutput",
    "ContiguousKVCache", "Divergence", "Engine", "EngineConfig", "KVCacheManager", "ModelConfig", "PagedKVCache",
    "RequestOutput", "SamplingParams", "Scheduler", "SchedulerConfig", "SpeculativeConfig", "StructuredOutput", "Tokenizer",
    "Transformer", "check_greedy", "default_dtype", "fetch", "load_model", "pick_device", "sample", "set_threads",
]


def _speed_parts(model: Transformer, config: EngineConfig, cache: PagedKVCache) -> SpeedParts:
    """The speed code's one factory, handed to the model runner here, above both (the core imports none of the speed
    code), and imported when a config first asks for a part of it: a plain engine loads none."""
    from enginelib.speed.factory import make_speed_parts
    return make_speed_parts(model, config, cache)


ModelRunner.speed_factory = staticmethod(_speed_parts)  # a function of its own, not a method of the runner
