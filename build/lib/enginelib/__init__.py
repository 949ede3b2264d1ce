"""enginelib: the finished code of the book's chapters, a small LLM inference engine."""
from enginelib.baselines.kv_cache import ContiguousKVCache
from enginelib.config import CompileConfig, EngineConfig, SamplingParams, SchedulerConfig, SpeculativeConfig
from enginelib.core.block_pool import BlockPool
from enginelib.core.engine import Engine
from enginelib.core.kv_manager import KVCacheManager
from enginelib.core.llm import LLM
from enginelib.core.outputs import CompletionOutput, RequestOutput
from enginelib.core.paged_cache import PagedKVCache
from enginelib.core.scheduler import Scheduler
from enginelib.model.checks import NEAR_TIE_MARGIN, Agreement, Divergence, check_greedy
from enginelib.model.device import default_dtype, pick_device, set_threads
from enginelib.model.sampling import sample
from enginelib.model.tokenizer import Tokenizer
from enginelib.model.transformer import ModelConfig, Transformer
from enginelib.model.weights import DEFAULT_MODEL, fetch, load_model

__all__ = [
    "DEFAULT_MODEL", "LLM", "NEAR_TIE_MARGIN", "Agreement", "BlockPool", "CompileConfig", "CompletionOutput",
    "ContiguousKVCache", "Divergence", "Engine", "EngineConfig", "KVCacheManager", "ModelConfig", "PagedKVCache",
    "RequestOutput", "SamplingParams", "Scheduler", "SchedulerConfig", "SpeculativeConfig", "Tokenizer", "Transformer",
    "check_greedy", "default_dtype", "fetch", "load_model", "pick_device", "sample", "set_threads",
]
