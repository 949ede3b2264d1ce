"""KV-cache memory: the slots a paged cache wastes against reserve-max-len, and what one budget holds."""
from __future__ import annotations

from enginelib.bench.workloads import Workload
from enginelib.core.block_pool import BlockPool


def kv_waste(wl: Workload, block_size: int, max_len: int, outputs: list[list[int]]) -> dict:
    """Share of reserved KV slots holding no token: paged (a block at a time) vs reserve-max-len."""
    lengths = [len(r.prompt_ids) + len(o) - 1 for r, o in zip(wl.requests, outputs)]
    paged_slots = sum(-(-n // block_size) * block_size for n in lengths)
    return {"paged": 1 - sum(lengths) / paged_slots, "contiguous": 1 - sum(lengths) / (max_len * len(lengths)),
            "max_len": max_len, "block_size": block_size}


def concurrency(wl: Workload, outputs: list[list[int]], block_size: int, max_len: int,
                budget_tokens: int) -> dict:
    """How many of the workload's requests one KV budget holds at once, paged vs contiguous."""
    pool = BlockPool(budget_tokens // block_size, block_size)
    held = 0
    for r, o in zip(wl.requests * 1000, outputs * 1000):  # as many as fit, cycling through the workload
        need = pool.blocks_for(len(r.prompt_ids) + len(o) - 1)
        if not pool.can_allocate(need):
            break
        pool.allocate(need)
        held += 1
    return {"paged": held, "contiguous": budget_tokens // max_len, "budget_tokens": budget_tokens}
