"""The block pool: a fixed number of KV-cache blocks, handed out and taken back.

It is pure bookkeeping — block ids, a free list and reference counts — and
knows nothing about tensors or requests. A block shared by several owners
(chapter 9's prefix caching) returns to the free list when its last owner
lets go.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass


class NoFreeBlocks(RuntimeError):
    """Raised when an allocation asks for more blocks than are free."""


@dataclass(frozen=True)
class PoolStats:
    total: int
    used: int
    free: int
    high_water: int  # the most blocks ever in use at once


class BlockPool:
    """``num_blocks`` blocks of ``block_size`` token slots each."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need at least one block of at least one slot, got {num_blocks} x {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_counts = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self.high_water = 0

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        """How many blocks hold ``num_tokens`` tokens (the last one may be partly empty)."""
        return -(-num_tokens // self.block_size)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` free blocks, each with one owner."""
        if n > len(self._free):
            raise NoFreeBlocks(f"asked for {n} blocks, {len(self._free)} free")
        blocks = [self._free.popleft() for _ in range(n)]
        for b in blocks:
            self.ref_counts[b] = 1
        self.high_water = max(self.high_water, self.num_used)
        return blocks

    def share(self, blocks: list[int]) -> None:
        """Add an owner to blocks already in use."""
        for b in blocks:
            if self.ref_counts[b] == 0:
                raise ValueError(f"block {b} is free; only blocks in use can be shared")
            self.ref_counts[b] += 1

    def free(self, blocks: list[int]) -> None:
        """Drop one owner from each block; a block nobody owns goes back to the free list."""
        for b in blocks:
            if self.ref_counts[b] == 0:
                raise ValueError(f"block {b} is already free (double free)")
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                self._free.append(b)

    def stats(self) -> PoolStats:
        return PoolStats(self.num_blocks, self.num_used, self.num_free, self.high_water)

    def check(self, owners: dict[str, list[int]] | None = None) -> None:
        """Assert the pool's invariants (used by tests after every step).

        Free + used = total; the free list has no duplicates and only unowned
        blocks; with ``owners`` (who holds which blocks), every reference count
        equals the number of holders.
        """
        free = set(self._free)
        assert len(free) == len(self._free), "a block is on the free list twice"
        assert all(self.ref_counts[b] == 0 for b in free), "a free block has an owner"
        assert all((c == 0) == (b in free) for b, c in enumerate(self.ref_counts)), "a used block is lost"
        if owners is not None:
            counts = [0] * self.num_blocks
            for blocks in owners.values():
                for b in blocks:
                    counts[b] += 1
            assert counts == self.ref_counts, "reference counts disagree with the block tables"
