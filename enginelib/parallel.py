"""Tensor parallelism (chapter 16): one model split across processes, Megatron-style.

Each rank holds a slice of every layer: some attention heads (with their KV
heads, so each rank caches only its own K/V) and some of the MLP's columns.
The first matmul of each half is split by output columns (no communication);
the second, ``o_proj`` and ``down_proj``, by input rows, so each rank holds a
partial sum of the layer's output and one all-reduce per half adds them up.
Embedding, norms and LM head stay whole on every rank, so every rank samples
the same token and runs the same engine, step for step, in lockstep.

Shoeybi et al. 2019, Megatron-LM: https://arxiv.org/abs/1909.08053
"""
from __future__ import annotations

import os
import tempfile
import time
import traceback
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from enginelib.config import SamplingParams
from enginelib.core.llm import LLM
from enginelib.model.device import can_pack, pack_linears
from enginelib.model.tokenizer import Tokenizer
from enginelib.model.transformer import ModelConfig, Transformer


@dataclass(frozen=True)
class Shard:
    """What rank ``rank`` holds of every layer: query heads, KV heads and MLP columns, as [start, stop)."""

    rank: int
    heads: tuple[int, int]
    kv_heads: tuple[int, int]
    columns: tuple[int, int]

    def config(self, cfg: ModelConfig) -> ModelConfig:
        """The shape of this rank's model: its heads and columns only."""
        return replace(cfg, num_heads=self.heads[1] - self.heads[0],
                       num_kv_heads=self.kv_heads[1] - self.kv_heads[0],
                       intermediate_size=self.columns[1] - self.columns[0])


def _split(n: int, parts: int) -> list[tuple[int, int]]:
    """[0, n) in ``parts`` ranges as even as can be (the first ones one longer)."""
    sizes = [n // parts + (i < n % parts) for i in range(parts)]
    starts = [sum(sizes[:i]) for i in range(parts)]
    return [(s, s + size) for s, size in zip(starts, sizes)]


def plan_shards(cfg: ModelConfig, world_size: int) -> list[Shard]:
    """Split KV heads (each with the query heads that share it) and MLP columns over ``world_size`` ranks.

    A KV head and its group of query heads stay together: attention never looks
    across groups, so a rank computes its heads' attention alone. When the KV
    heads do not divide evenly (SmolLM2 has 3), some ranks get one group more;
    vLLM instead requires the query heads to divide and copies KV heads when
    there are fewer than ranks.
    """
    if not 1 <= world_size <= cfg.num_kv_heads:
        raise ValueError(f"world_size must be between 1 and the model's {cfg.num_kv_heads} KV heads "
                         f"(each rank needs at least one), got {world_size}")
    groups = cfg.num_heads // cfg.num_kv_heads
    return [Shard(rank, (kv[0] * groups, kv[1] * groups), kv, cols)
            for rank, (kv, cols) in enumerate(zip(_split(cfg.num_kv_heads, world_size),
                                                  _split(cfg.intermediate_size, world_size)))]


def shard_weights(model: Transformer, shard: Shard) -> dict[str, torch.Tensor]:
    """This rank's tensors: copies of its slices, and the whole model's own tensors for the rest.

    Handed to a spawned process, the shared ones are moved to shared memory, not copied per rank.
    """
    cfg, d = model.cfg, model.cfg.head_dim
    q, kv = cfg.num_heads * d, cfg.num_kv_heads * d
    (h0, h1), (k0, k1), (c0, c1) = shard.heads, shard.kv_heads, shard.columns
    out = {}
    for name, w in model.state_dict().items():
        if name.endswith(("qkv_proj.weight", "qkv_proj.bias")):  # column split: this rank's q, k, v rows
            w = torch.cat([w[h0 * d:h1 * d], w[q + k0 * d:q + k1 * d], w[q + kv + k0 * d:q + kv + k1 * d]])
        elif name.endswith("o_proj.weight"):  # row split: the input features of this rank's heads
            w = w[:, h0 * d:h1 * d].clone()
        elif name.endswith("gate_up_proj.weight"):  # column split: gate and up columns
            half = cfg.intermediate_size
            w = torch.cat([w[c0:c1], w[half + c0:half + c1]])
        elif name.endswith("down_proj.weight"):  # row split
            w = w[:, c0:c1].clone()
        out[name] = w  # the rest (embedding, norms) is the same tensor on every rank
    return out


@dataclass
class CommStats:
    """Time one rank spent inside all-reduces (waiting for the slowest rank included), and how many."""

    seconds: float = 0.0
    calls: int = 0


class RowParallel(nn.Module):
    """A row-split linear: this rank's partial product, then an all-reduce sums the ranks' parts."""

    def __init__(self, linear: nn.Module, stats: CommStats) -> None:
        super().__init__()
        self.linear, self.stats = linear, stats

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)
        start = time.perf_counter()
        dist.all_reduce(y)
        self.stats.seconds += time.perf_counter() - start
        self.stats.calls += 1
        return y


def build_shard(cfg: ModelConfig, shard: Shard, weights: dict[str, torch.Tensor],
                stats: CommStats) -> Transformer:
    """A rank's model: the shard's shape, its weights, and an all-reduce after o_proj and down_proj."""
    with torch.device("meta"):
        model = Transformer(shard.config(cfg))
    model.load_state_dict(weights, assign=True, strict=False)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    if can_pack(model):
        pack_linears(model)
    for layer in model.layers:
        layer.self_attn.o_proj = RowParallel(layer.self_attn.o_proj, stats)
        layer.mlp.down_proj = RowParallel(layer.mlp.down_proj, stats)
    return model


@dataclass
class RankReport:
    """What one rank sends back: rank 0's outputs, every rank's timings."""

    rank: int
    token_ids: list[list[int]]
    texts: list[str]
    seconds: float        # the whole generate call
    comm: CommStats
    error: str | None = None


def _worker(rank: int, world_size: int, store: str, cfg: ModelConfig, shard: Shard,
            weights: dict[str, torch.Tensor], tokenizer: Tokenizer, prompts: list[list[int]],
            params: SamplingParams, engine_args: dict, threads: int, results) -> None:
    torch.set_num_threads(threads)
    stats = CommStats()
    try:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size)
        # the engine, unchanged: each rank runs its own, in lockstep with the others
        llm = LLM.from_model(build_shard(cfg, shard, weights, stats), tokenizer, **engine_args)
        dist.barrier()
        start = time.perf_counter()
        outputs = llm.generate(prompts, params)
        seconds = time.perf_counter() - start
        ids = [list(o.outputs[0].token_ids) for o in outputs] if rank == 0 else []
        texts = [o.outputs[0].text for o in outputs] if rank == 0 else []
        results.put(RankReport(rank, ids, texts, seconds, stats))
    except Exception:  # noqa: BLE001 -- the parent waits for every rank: send the failure instead of hanging it
        results.put(RankReport(rank, [], [], 0.0, stats, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def generate(model: Transformer, tokenizer: Tokenizer, prompts: list[list[int]], params: SamplingParams,
             world_size: int = 2, timeout: float = 300.0, **engine_args) -> list[RankReport]:
    """Run ``prompts`` through ``world_size`` processes, each holding one shard of ``model``.

    Every rank runs the same engine with the same requests; the pool's size is
    fixed up front (``num_blocks``, enough for every request at once unless
    given), so that all ranks schedule identically whatever their shard's size.
    Returns each rank's report, rank 0 first (its token ids are the result).
    """
    if model.device.type != "cpu":
        raise ValueError(f"parallel.generate runs its ranks on the CPU over gloo; the model is on {model.device}: "
                         "pass a CPU copy (load_model(device='cpu')). GPUs would take NCCL and one GPU per rank.")
    shards = plan_shards(model.cfg, world_size)
    block = engine_args.get("block_size", 16)
    engine_args.setdefault("num_blocks", sum(-(-(len(p) + params.max_tokens) // block) + 1 for p in prompts))
    threads = max(1, torch.get_num_threads() // world_size)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_worker, daemon=True,
                             args=(s.rank, world_size, store, model.cfg, s, shard_weights(model, s), tokenizer,
                                   prompts, params, engine_args, threads, results)) for s in shards]
        for p in procs:
            p.start()
        try:
            reports = sorted((results.get(timeout=timeout) for _ in procs), key=lambda r: r.rank)
        finally:
            for p in procs:
                p.join(timeout=10)
                if p.is_alive():
                    p.kill()
    failed = [r for r in reports if r.error]
    if failed:
        raise RuntimeError(f"rank {failed[0].rank} failed:\n{failed[0].error}")
    return reports
