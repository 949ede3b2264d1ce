"""A snapshot of the engine after a step: what the timelines and block maps of Part II draw."""
from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from enginelib.core.block_pool import BlockPool
from enginelib.core.request import Request, RequestStatus
from enginelib.core.scheduler import SchedulerOutput


@dataclass(frozen=True)
class StepRecord:
    """A snapshot after one step: enough to draw the block map and the timeline."""

    step: int
    time: float
    scheduled: dict[str, int]           # request id -> tokens computed this step
    prefill: frozenset[str]             # which of them were prefills (or chunks of one)
    preempted: tuple[str, ...]
    states: dict[str, str]              # requests alive this step (and those that just ended) -> status
    block_tables: dict[str, list[int]]  # running requests -> their blocks
    num_cached: dict[str, int]          # running requests -> tokens in the cache
    num_blocks: int
    block_size: int
    ref_counts: tuple[int, ...] = ()    # per block: how many requests hold it (prefix caching shares blocks)
    block_hashes: dict[int, str] = field(default_factory=dict)  # cached blocks -> short hash (chapter 9)


def snapshot(step: int, plan: SchedulerOutput, live: Iterable[Request], ended: Iterable[str],
             running: Iterable[Request], pool: BlockPool) -> StepRecord:
    """The record of step ``step``: ``live`` are the unfinished requests, ``ended`` those that just finished."""
    running = list(running)
    states = {r.request_id: r.status.value for r in live} | {rid: RequestStatus.FINISHED.value for rid in ended}
    return StepRecord(
        step=step, time=time.perf_counter(),
        scheduled={w.request.request_id: w.num_tokens for w in plan.scheduled},
        prefill=frozenset(w.request.request_id for w in plan.scheduled if w.is_prefill),
        preempted=tuple(r.request_id for r in plan.preempted),
        states=states,
        block_tables={r.request_id: list(r.block_table) for r in running},
        num_cached={r.request_id: r.num_computed_tokens for r in running},
        num_blocks=pool.num_blocks, block_size=pool.block_size,
        ref_counts=tuple(pool.ref_counts),
        block_hashes={b: f"{h & 0xFFFFFFFF:08x}" for b, h in enumerate(pool.block_hashes) if h is not None})
