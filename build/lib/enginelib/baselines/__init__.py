"""Part I's generation loops, kept as the baselines every later chapter is measured against:
naive, with a contiguous KV cache, and static batching."""
from enginelib.baselines.generate import (
    Generation,
    StaticBatchRun,
    check_request,
    generate_cached,
    generate_naive,
    generate_static,
    generate_static_batches,
)
from enginelib.baselines.kv_cache import ContiguousKVCache

__all__ = ["ContiguousKVCache", "Generation", "StaticBatchRun", "check_request", "generate_cached",
           "generate_naive", "generate_static", "generate_static_batches"]
