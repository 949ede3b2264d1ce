"""The paged KV cache (chapter 5): a pool of fixed-size blocks that sequences take one at a
time, found again through their block tables. Attention reads the keys and values through
those tables (:mod:`enginelib.step.attention`, which the speed code's compiled step uses too).
(Part I's contiguous cache is :mod:`enginelib.baselines.kv_cache`.)
"""
from __future__ import annotations

from typing import Callable

import torch

from enginelib.model.transformer import ModelConfig
from enginelib.step.attention import AttentionGroup, attention_groups, paged_attention
from enginelib.step.batch import Batch


class PagedKVCache:
    """K/V for every layer in fixed-size blocks: ``[layers, num_blocks, block_size, KV, D]``.

    A sequence's tokens live in whichever blocks its block table lists, so
    memory is taken a block at a time as sequences grow, not reserved up front.
    ``bind(batch)`` prepares one step; the model, given the batch's flat tokens
    and positions (``model(batch.token_ids, cache.bind(batch), positions=batch.positions)``),
    then calls ``attend`` per layer. The scheduler, not the cache, counts what each sequence holds.
    """

    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int, *,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                 decode_kernel: Callable[..., torch.Tensor] | None = None) -> None:
        shape = (cfg.num_layers, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        # steps of one query per sequence attend in this fused kernel, which writes the new K/V and reads the
        # keys where they lie (no gather, no mask): ``(q, k, v, k_pool, v_pool, block_tables, context_lens)``,
        # the C++ one on a CPU or the Triton one on a GPU, picked (and checked) by the speed code's
        # decode_attention_kernel (the runner's speed parts); None: every step gathers the keys for SDPA
        self.decode_kernel = decode_kernel
        self._fused = False
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.num_blocks, self.block_size = num_blocks, block_size
        self.num_groups = cfg.num_heads // cfg.num_kv_heads
        self.batch: Batch | None = None
        self._groups: list[AttentionGroup] = []

    @staticmethod
    def blocks_in_budget(cfg: ModelConfig, block_size: int, dtype: torch.dtype, memory_bytes: int) -> int:
        """How many blocks fit in ``memory_bytes`` of K/V storage."""
        return memory_bytes // (block_size * cfg.kv_bytes_per_token(dtype))

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def bind(self, batch: Batch) -> "PagedKVCache":
        batch.check_pool(self.num_blocks)  # on the host, once for the step's layers (a fused kernel trusts the tables)
        self.batch = batch
        self._fused = self.decode_kernel is not None and batch.num_tokens == batch.num_seqs
        if self._fused:
            self._groups = []
        else:
            self._groups = attention_groups(batch, self.block_size, self.num_groups, self.k.dtype)
        return self

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store this step's K/V ([1, N, KV, D]) in their slots: one vectorized copy each."""
        slots = self.batch.slot_mapping
        self.k[layer].view(-1, *k.shape[2:]).index_copy_(0, slots, k[0])
        self.v[layer].view(-1, *v.shape[2:]).index_copy_(0, slots, v[0])

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Write this step's K/V into their slots, then attend through the blocks."""
        if self._fused:  # the kernel writes the new K/V too
            b = self.batch
            return self.decode_kernel(q[0].contiguous(), k[0].contiguous(), v[0].contiguous(), self.k[layer],
                                      self.v[layer], b.block_tables, b.context_lens)[None]
        self.write(layer, k, v)
        if len(self._groups) == 1 and self._groups[0].whole:
            return paged_attention(q[0], self.k[layer], self.v[layer], self._groups[0])[None]
        out = torch.empty_like(q[0])
        for group in self._groups:
            out.index_copy_(0, group.dest, paged_attention(q[0], self.k[layer], self.v[layer], group))
        return out[None]
