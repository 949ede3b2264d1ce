"""Attention through block tables (chapter 5): which queries attend together in a step, and the gather + SDPA that
reads their keys and values from a paged pool. Below both the core's paged cache and the speed code's compiled step,
which both attend this way."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from enginelib.model.transformer import attention, attention_mask
from enginelib.step.batch import Batch, to_device


class PagedPools(Protocol):
    """The pools a step reads and writes K/V in: the core's PagedKVCache, or a draft's contiguous cache as blocks."""

    k: torch.Tensor  # [layers, num_blocks, block_size, KV, D]
    v: torch.Tensor
    num_blocks: int
    block_size: int


@dataclass
class AttentionGroup:
    """Sequences attended together, their queries padded to the longest (Q). Built once per step."""

    rows: torch.Tensor    # [S * Q] row in the flat batch of each query (padding repeats the last real one)
    blocks: torch.Tensor  # [S * max_blocks] the sequences' block tables, end to end
    mask: torch.Tensor    # [S, 1, G * Q, max_blocks * block_size] additive (0 = may attend), from attention_mask
    take: torch.Tensor    # which of the S * Q queries are real, not padding
    dest: torch.Tensor    # the flat-batch row of each real one
    whole: bool           # the group is the whole batch, one query per sequence, in order (all decodes)


def attention_groups(batch: Batch, block_size: int, num_groups: int = 1,
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
