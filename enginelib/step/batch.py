"""The Batch, the one seam between scheduling (requests, blocks) and compute (tensors): a step's plan as one flat batch,
the new tokens of every sequence end to end, where each goes in the cache (slot mapping), what each sequence may attend
to (block tables, context lengths), and which rows need logits. It lies below the core and the speed code: both build
on it."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from enginelib.model.device import HostBuffer, to_device  # noqa: F401 (the core, the speed code import them here)


@dataclass(frozen=True)
class SequenceWork:
    """One sequence's share of a step, in plain numbers (no Request)."""
    token_ids: list[int]    # the tokens to compute this step
    start: int              # position of the first of them (= tokens already cached)
    block_table: list[int]  # its blocks, in order
    sample: bool = True     # its last token needs logits (not a prefill chunk with more to come)
    num_draft: int = 0      # its last tokens are this many guesses to verify: they and the token before get logits
    prompt_rows: tuple[int, ...] = ()  # more of its tokens (offsets in token_ids) that get logits: prompt logprobs


@dataclass
class Batch:
    token_ids: torch.Tensor     # [N] new tokens of all sequences, end to end
    positions: torch.Tensor     # [N] their positions in their own sequences
    slot_mapping: torch.Tensor  # [N] flat cache slot for each: block * block_size + offset
    block_tables: torch.Tensor  # [S, max_blocks] (padded with block 0, never read past context_lens)
    context_lens: torch.Tensor  # [S] tokens each sequence has in the cache after this step
    query_lens: list[int]       # [S] new tokens per sequence
    logits_indices: torch.Tensor  # [R] row of the last new token of each sequence that samples: only these get logits
    #                               (a sequence verifying k guesses gets k + 1 rows, see enginelib.speed.speculative)
    num_prompt_rows: int = 0  # the last rows of logits_indices are SequenceWork.prompt_rows (prompt logprobs)
    blocks_read: tuple[int, int] = (0, -1)  # the lowest and highest block the sequences' keys lie in, from the host's
    #                                         lists: check_pool needs no look at the device's tables (no sync)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @classmethod
    def build(cls, seqs: list[SequenceWork], block_size: int, device: torch.device | str = "cpu",
              host: HostBuffer | None = None) -> "Batch":
        """Lay the work end to end, on the host: it crosses to ``device`` in one copy (or fills ``host``'s buffer)."""
        tokens, positions, slots, ends, extra = [], [], [], [], []
        lowest, highest = 0, -1
        for s in seqs:
            pos = range(s.start, s.start + len(s.token_ids))
            if len(s.block_table) * block_size < pos.stop:
                raise ValueError(f"{len(s.block_table)} blocks cannot hold {pos.stop} tokens")
            if s.start < 0:
                raise ValueError(f"a sequence cannot start at position {s.start}")
            read = s.block_table[:-(-pos.stop // block_size)]  # the blocks its keys lie in
            if read:
                lowest, highest = min(lowest, min(read)), max(highest, max(read))
            tokens += s.token_ids
            positions += pos
            slots += [s.block_table[p // block_size] * block_size + p % block_size for p in pos]
            if s.sample:
                ends += range(len(tokens) - 1 - s.num_draft, len(tokens))
            extra += [len(tokens) - len(s.token_ids) + r for r in s.prompt_rows]
        width = max(len(s.block_table) for s in seqs)
        tables = [b for s in seqs for b in s.block_table + [0] * (width - len(s.block_table))]
        context_lens = [s.start + len(s.token_ids) for s in seqs]
        n, num_seqs, flat = len(tokens), len(seqs), tokens + positions + slots + tables + context_lens + ends + extra
        sizes = (n, n, n, num_seqs * width, num_seqs, len(ends) + len(extra))
        token_ids, pos, slot_mapping, block_tables, lens, logits_indices = \
            host.write(flat, sizes) if host else to_device(flat, device).split(sizes)
        return cls(token_ids, pos, slot_mapping, block_tables.view(num_seqs, width), lens,
                   [len(s.token_ids) for s in seqs], logits_indices, len(extra), (lowest, highest))

    def check_pool(self, num_blocks: int) -> None:
        """Every block a sequence's keys lie in is in a pool of ``num_blocks``: what a kernel reading K/V through the
        tables trusts (the context lengths Batch.build checked). Checked on the host, from the numbers build kept:
        a look at the tables on a GPU would make every step wait for it (and a wrong block must not reach C++, where
        an exception crossing torch's dispatcher crashed a process on one machine)."""
        lowest, highest = self.blocks_read
        if highest >= 0 and (lowest < 0 or highest >= num_blocks):
            raise RuntimeError(f"block {lowest if lowest < 0 else highest} is outside the pool of {num_blocks}")

