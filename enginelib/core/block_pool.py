"""The block pool: a fixed number of KV-cache blocks, handed out and taken back; pure bookkeeping (ids, reference
counts, each full block's hash for prefix caching). A freed block that holds a hashed, full block keeps its contents and
stays findable by hash until it is needed, least recently used first. No tensors, no requests."""
from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass


class NoFreeBlocks(RuntimeError):
    """Raised when an allocation asks for more blocks than are free."""


@dataclass(frozen=True)
class PoolStats:
    total: int
    used: int        # owned by at least one request
    free: int        # owned by none: empty, or cached and evictable
    high_water: int  # the most blocks ever in use at once
    cached: int = 0  # blocks findable by hash (in use or evictable)
    evictions: int = 0


class BlockPool:
    """``num_blocks`` blocks of ``block_size`` token slots each."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need at least one block of at least one slot, got {num_blocks} x {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_counts = [0] * num_blocks
        self.block_hashes: list[int | None] = [None] * num_blocks  # a full block's chained hash, once cached
        self._tokens: list[tuple[int, ...] | None] = [None] * num_blocks  # its token ids, to confirm a hit
        self._cached: dict[int, int] = {}  # hash -> the block that holds it
        self._free: deque[int] = deque(range(num_blocks))  # free blocks holding nothing worth keeping
        self._evictable: OrderedDict[int, None] = OrderedDict()  # free cached blocks, least recently used first
        self.high_water = 0
        self.evictions = 0

    @property
    def num_free(self) -> int:
        return len(self._free) + len(self._evictable)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    def blocks_for(self, num_tokens: int) -> int:
        """How many blocks hold ``num_tokens`` tokens (the last one may be partly empty)."""
        return -(-num_tokens // self.block_size)

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` free blocks, each with one owner: empty ones first, then evict the least recently used."""
        if n > self.num_free:
            raise NoFreeBlocks(f"asked for {n} blocks, {self.num_free} free")
        blocks = []
        for _ in range(n):
            if self._free:
                b = self._free.popleft()
            else:
                b, _ = self._evictable.popitem(last=False)
                self._uncache(b)
                self.evictions += 1
            self.ref_counts[b] = 1
            blocks.append(b)
        self.high_water = max(self.high_water, self.num_used)
        return blocks

    def share(self, blocks: list[int]) -> None:
        """Add an owner to each block: one in use, or a cached one waiting on the free side (a prefix hit)."""
        for b in blocks:
            if self.ref_counts[b] == 0:
                if b not in self._evictable:
                    raise ValueError(f"block {b} is free and holds nothing cached; it cannot be shared")
                del self._evictable[b]
            self.ref_counts[b] += 1
        self.high_water = max(self.high_water, self.num_used)

    def free(self, blocks: list[int]) -> None:
        """Drop one owner from each block, in the order given. An unowned cached block joins the end of the eviction
        order, so callers free a request's blocks last first: a sequence's tail, the least likely shared, goes first."""
        for b in blocks:
            if self.ref_counts[b] == 0:
                raise ValueError(f"block {b} is already free (double free)")
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                if self.block_hashes[b] is None:
                    self._free.append(b)
                else:
                    self._evictable[b] = None

    def cache(self, block: int, block_hash: int, token_ids: tuple[int, ...]) -> None:
        """Make a full, owned block findable by its hash (a hash already held elsewhere is left as it is)."""
        if self.ref_counts[block] == 0:
            raise ValueError(f"block {block} is free: only a block its owner has filled can be cached")
        if self.block_hashes[block] is None and block_hash not in self._cached:
            self._cached[block_hash] = block
            self.block_hashes[block] = block_hash
            self._tokens[block] = token_ids

    def lookup(self, block_hash: int, token_ids: tuple[int, ...]) -> int | None:
        """The block holding these tokens under this hash, or None. Equal hashes must also hold equal tokens."""
        b = self._cached.get(block_hash)
        return b if b is not None and self._tokens[b] == token_ids else None

    def _uncache(self, block: int) -> None:
        del self._cached[self.block_hashes[block]]
        self.block_hashes[block] = self._tokens[block] = None

    def stats(self) -> PoolStats:
        return PoolStats(self.num_blocks, self.num_used, self.num_free, self.high_water,
                         len(self._cached), self.evictions)

    def check(self, owners: dict[str, list[int]] | None = None) -> None:
        """Assert the pool's invariants, and with ``owners`` (who holds which blocks) its reference counts."""
        free = set(self._free) | set(self._evictable)
        assert len(free) == len(self._free) + len(self._evictable), "a block is on the free side twice"
        assert all(self.ref_counts[b] == 0 for b in free), "a free block has an owner"
        assert all((c == 0) == (b in free) for b, c in enumerate(self.ref_counts)), "a used block is lost"
        assert all(self.block_hashes[b] is None for b in self._free), "an empty free block still has a hash"
        assert all(self.block_hashes[b] is not None for b in self._evictable), "an evictable block has no hash"
        assert all(self.block_hashes[b] == h for h, b in self._cached.items()), "the hash map and blocks disagree"
        assert sum(h is not None for h in self.block_hashes) == len(self._cached), "a block's hash is not in the map"
        if owners is not None:
            counts = [0] * self.num_blocks
            for owner, blocks in owners.items():
                assert len(set(blocks)) == len(blocks), f"{owner} holds a block twice: {blocks}"
                for b in blocks:
                    counts[b] += 1
            assert counts == self.ref_counts, "reference counts disagree with the block tables"
