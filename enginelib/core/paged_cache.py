"""The paged KV cache (chapter 5): a pool of fixed-size blocks that sequences take one at a
time, found again through their block tables. Attention reads the keys and values through
those tables. (Part I's contiguous cache is :mod:`enginelib.baselines.kv_cache`.)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from enginelib.core.batch import Batch, to_device
from enginelib.model.transformer import ModelConfig, attention, attention_mask


@dataclass
class AttentionGroup:
    """Sequences attended together, their queries padded to the longest (Q). Built once per step."""

    rows: torch.Tensor    # [S * Q] row in the flat batch of each query (padding repeats the last real one)
    blocks: torch.Tensor  # [S * max_blocks] the sequences' block tables, end to end
    mask: torch.Tensor    # [S, 1, G * Q, max_blocks * block_size] additive (0 = may attend), from attention_mask
    take: torch.Tensor    # which of the S * Q queries are real, not padding
    dest: torch.Tensor    # the flat-batch row of each real one
    whole: bool           # the group is the whole batch, one query per sequence, in order (all decodes)


def _attention_groups(batch: Batch, block_size: int, num_groups: int = 1,
                      dtype: torch.dtype = torch.float32) -> list[AttentionGroup]:
    """Decodes (one query each) in one group, prefills in another, so neither pads to the other.

    Which rows go where follows from the query lengths alone, which the host
    knows: the index lists are made in Python and cross to the device in one
    copy. Only the mask, which needs positions and block tables, is made on the
    device, once per step, in the additive form every layer then reuses.
    ``num_groups`` is the number of query heads per KV head.
    """
    device = batch.token_ids.device
    qlens = batch.query_lens
    starts = [0]
    for n in qlens[:-1]:
        starts.append(starts[-1] + n)
    plans, flat = [], []
    for pick in ([i for i, n in enumerate(qlens) if n == 1], [i for i, n in enumerate(qlens) if n > 1]):
        if not pick:
            continue
        width = max(qlens[i] for i in pick)
        rows = [starts[i] + min(o, qlens[i] - 1) for i in pick for o in range(width)]
        take = [j * width + o for j, i in enumerate(pick) for o in range(qlens[i])]
        dest = [starts[i] + o for i in pick for o in range(qlens[i])]
        plans.append((len(pick), width, len(take), len(pick) == batch.num_tokens))
        flat += pick + rows + take + dest
    pieces = iter(to_device(flat, device).split([n for s, w, r, _ in plans for n in (s, s * w, r, r)]))
    keys = torch.arange(batch.block_tables.shape[1] * block_size, device=device)
    groups = []
    for seqs, width, _, whole in plans:
        pick, rows, take, dest = next(pieces), next(pieces), next(pieces), next(pieces)
        allowed = keys[None, None, :] <= batch.positions[rows].view(seqs, width, 1)  # causal, in its own sequence
        mask = attention_mask(allowed[:, None], num_groups, dtype)
        groups.append(AttentionGroup(rows, batch.block_tables[pick].flatten(), mask, take, dest, whole))
    return groups


def paged_attention(q: torch.Tensor, k_blocks: torch.Tensor, v_blocks: torch.Tensor,
                    group: AttentionGroup) -> torch.Tensor:
    """Attention for one group, reading keys and values through block tables.

    q: [N, H, D] the batch's flat queries; k_blocks, v_blocks: [num_blocks, block_size, KV, D]
    one layer's pool. Returns [n, H, D] for the group's real queries, in ``group.dest`` order.
    ``index_select`` gathers whole rows and is several times faster than ``tensor[index]`` here.
    """
    seqs, width = group.mask.shape[0], group.mask.shape[-1]
    keys = k_blocks.index_select(0, group.blocks).view(seqs, width, *k_blocks.shape[2:])
    values = v_blocks.index_select(0, group.blocks).view(seqs, width, *v_blocks.shape[2:])
    queries = q if group.whole else q.index_select(0, group.rows)
    out = attention(queries.view(seqs, -1, *q.shape[1:]), keys, values, group.mask)  # [S, Q, H, D]
    return out.flatten(0, 1) if group.whole else out.flatten(0, 1).index_select(0, group.take)


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
        # the C++ one on a CPU or the Triton one on a GPU, picked (and checked) by the runner's
        # decode_attention_kernel; None: every step gathers the keys for SDPA
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
            self._groups = _attention_groups(batch, self.block_size, self.num_groups, self.k.dtype)
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
