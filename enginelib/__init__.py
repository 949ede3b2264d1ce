"""enginelib: the finished code of the book's chapters, a small LLM inference engine."""
from .block_pool import BlockPool
from .checks import NEAR_TIE_MARGIN, Agreement, Divergence, check_greedy
from .compiled import CompileConfig
from .device import default_dtype, pick_device, set_threads
from .engine import Engine, EngineConfig
from .kv_cache import ContiguousKVCache, PagedKVCache
from .kv_manager import KVCacheManager
from .llm import LLM
from .model import ModelConfig, Transformer
from .outputs import CompletionOutput, RequestOutput
from .params import SamplingParams
from .sampling import sample
from .scheduler import Scheduler, SchedulerConfig
from .speculative import SpeculativeConfig
from .tokenizer import Tokenizer
from .weights import DEFAULT_MODEL, fetch, load_model

__all__ = [
    "DEFAULT_MODEL", "LLM", "NEAR_TIE_MARGIN", "Agreement", "BlockPool", "CompileConfig", "CompletionOutput",
    "ContiguousKVCache", "Divergence", "Engine", "EngineConfig", "KVCacheManager", "ModelConfig", "PagedKVCache",
    "RequestOutput", "SamplingParams", "Scheduler", "SchedulerConfig", "SpeculativeConfig", "Tokenizer", "Transformer",
    "check_greedy", "default_dtype", "fetch", "load_model", "pick_device", "sample", "set_threads",
]
