"""Chapter 5: the block pool, a free list and a reference count per block."""
import collections


class NoFreeBlocks(RuntimeError):
    """Asked for more blocks than are free."""


class MiniBlockPool:
    """``num_blocks`` blocks of ``block_size`` slots: a free list and a reference count per block."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks, self.block_size = num_blocks, block_size
        self.ref_counts = [0] * num_blocks
        self.free_list = collections.deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self.free_list)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free_list)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)  # ceiling division

    def allocate(self, n: int) -> list[int]:
        if n > len(self.free_list):
            raise NoFreeBlocks(f"asked for {n} blocks, {len(self.free_list)} free")
        blocks = [self.free_list.popleft() for _ in range(n)]
        for b in blocks:
            self.ref_counts[b] = 1
        return blocks

    def free(self, blocks: list[int]) -> None:
        for b in blocks:
            if self.ref_counts[b] == 0:
                raise ValueError(f"block {b} is already free (double free)")
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                self.free_list.append(b)
