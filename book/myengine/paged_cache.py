"""Chapter 5: a step's batch (the slot mapping, the block tables) and the paged K/V cache the model attends through."""
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class SequenceWork:
    """One sequence's part of a step: its new tokens, the position of the first, where its K/V live."""
    token_ids: list[int]
    start: int
    block_table: list[int]


@dataclass
class Batch:
    """Every sequence's new tokens end to end: what one forward pass of the model computes."""
    token_ids: torch.Tensor       # [tokens]
    positions: torch.Tensor       # [tokens]
    slot_mapping: torch.Tensor    # [tokens]: the flat slot each new token's K/V is written to
    block_tables: torch.Tensor    # [seqs, width], short tables padded with block 0
    query_lens: list[int]         # new tokens per sequence
    logits_indices: torch.Tensor  # [seqs]: each sequence's last token, the one that samples

    @classmethod
    def build(cls, seqs: list[SequenceWork], block_size: int, device="cpu") -> "Batch":
        tokens, positions, slots, last = [], [], [], []
        for s in seqs:
            pos = range(s.start, s.start + len(s.token_ids))
            tokens += s.token_ids
            positions += pos
            slots += [s.block_table[p // block_size] * block_size + p % block_size for p in pos]
            last.append(len(tokens) - 1)
        width = max(len(s.block_table) for s in seqs)
        tables = [s.block_table + [0] * (width - len(s.block_table)) for s in seqs]
        as_tensor = lambda x: torch.tensor(x, dtype=torch.long, device=device)  # noqa: E731
        return cls(as_tensor(tokens), as_tensor(positions), as_tensor(slots), as_tensor(tables),
                   [len(s.token_ids) for s in seqs], as_tensor(last))

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)


def attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Each token is a batch row: q [tokens, heads, dim] over its own keys, values [tokens, width, kv_heads, dim]."""
    group = q.shape[1] // keys.shape[2]  # query heads per K/V head (grouped-query attention)
    keys, values = (x.repeat_interleave(group, dim=2).transpose(1, 2) for x in (keys, values))
    out = F.scaled_dot_product_attention(q[:, :, None], keys, values, attn_mask=mask[:, None, None, :])
    return out[:, :, 0]


class MiniPagedKVCache:
    """K/V in fixed-size blocks: written through the slot mapping, read through block tables."""

    def __init__(self, cfg, num_blocks: int, block_size: int, *, device="cpu", dtype=torch.float32) -> None:
        shape = (cfg.num_layers, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.block_size = block_size

    def bind(self, batch: Batch) -> "MiniPagedKVCache":
        """Prepare a step: the slots each new token reads, and which of them it may see."""
        self.batch, dev = batch, batch.positions.device
        offsets = torch.arange(self.block_size, device=dev)
        table_slots = (batch.block_tables[:, :, None] * self.block_size + offsets).flatten(1)  # [seqs, width]
        seq_of_token = torch.arange(batch.num_seqs, device=dev).repeat_interleave(
            torch.tensor(batch.query_lens, device=dev))
        self.read_slots = table_slots[seq_of_token]                                       # [tokens, width]
        slot_positions = torch.arange(self.read_slots.shape[1], device=dev)
        self.mask = slot_positions[None, :] <= batch.positions[:, None]                  # [tokens, width]
        return self

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [1, tokens, heads, dim]; k, v: [1, tokens, kv_heads, dim], the new tokens of every sequence."""
        k_slots = self.k[layer].flatten(0, 1)  # a view of the pool: [num_blocks * block_size, kv_heads, dim]
        v_slots = self.v[layer].flatten(0, 1)
        k_slots[self.batch.slot_mapping] = k[0]  # 1. write through the slot mapping
        v_slots[self.batch.slot_mapping] = v[0]
        keys, values = k_slots[self.read_slots], v_slots[self.read_slots]  # 2. gather: [tokens, width, kv, dim]
        return attention(q[0], keys, values, self.mask)[None]  # 3. each token over its own sequence's slots
