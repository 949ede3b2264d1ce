"""Chapter 9: a block pool with a prefix cache, and chapter 6's scheduler admitting requests past their cached blocks."""
from collections import OrderedDict, deque

from .block_pool import NoFreeBlocks
from .engine import MiniEngine
from .hashing import block_hashes
from .scheduler import MiniScheduler, Request


class MiniPrefixCache:
    """A block pool with a prefix cache: hash -> block, reference counts, LRU eviction of freed blocks."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks, self.block_size = num_blocks, block_size
        self.refs = [0] * num_blocks                        # requests holding each block
        self.hash_of: list[int | None] = [None] * num_blocks  # a cached block's hash ...
        self.tokens_of: list[tuple | None] = [None] * num_blocks  # ... and its tokens, to confirm a hit
        self.by_hash: dict[int, int] = {}                   # hash -> block
        self.empty = deque(range(num_blocks))               # free blocks that hold nothing
        self.evictable: OrderedDict[int, None] = OrderedDict()  # free cached blocks, least recently used first
        self.evictions = 0

    def lookup(self, tokens: list[int]) -> list[int]:
        """The cached blocks that start `tokens`: full blocks only, never the one with the last token."""
        bs, hits = self.block_size, []
        for i, h in enumerate(block_hashes(tokens, bs)[:(len(tokens) - 1) // bs]):
            b = self.by_hash.get(h)
            if b is None or self.tokens_of[b] != tuple(tokens[i * bs:(i + 1) * bs]):
                break
            hits.append(b)
        return hits

    def take(self) -> int:
        """A block for new tokens: an empty one if any, else evict the least recently used cached one."""
        if self.empty:
            b = self.empty.popleft()
        else:
            b, _ = self.evictable.popitem(last=False)
            del self.by_hash[self.hash_of[b]]
            self.hash_of[b] = self.tokens_of[b] = None
            self.evictions += 1
        self.refs[b] = 1
        return b

    def admit(self, tokens: list[int]) -> tuple[list[int], int]:
        """A block table for a prompt, and how many of its tokens were found cached."""
        bs, table = self.block_size, self.lookup(tokens)
        hit = len(table) * bs
        for b in table:  # shared: one more holder; a freed cached block is back in use
            self.evictable.pop(b, None)
            self.refs[b] += 1
        hashes = block_hashes(tokens, bs)
        while len(table) * bs < len(tokens):
            i, b = len(table), self.take()
            table.append(b)
            if i < len(hashes) and hashes[i] not in self.by_hash:  # full: findable from now on
                self.by_hash[hashes[i]], self.hash_of[b] = b, hashes[i]
                self.tokens_of[b] = tuple(tokens[i * bs:(i + 1) * bs])
        return table, hit

    def release(self, table: list[int]) -> None:
        """A request ends: last block first, so its tail is the first to be evicted."""
        for b in reversed(table):
            self.refs[b] -= 1
            if self.refs[b] == 0:
                if self.hash_of[b] is None:
                    self.empty.append(b)
                else:
                    self.evictable[b] = None

    # What chapter 6's scheduler asks of a pool: cached blocks count as free, since a request may evict them.
    @property
    def num_free(self) -> int:
        return len(self.empty) + len(self.evictable)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate(self, n: int) -> list[int]:
        if n > self.num_free:
            raise NoFreeBlocks(f"asked for {n} blocks, {self.num_free} free")
        return [self.take() for _ in range(n)]

    def free(self, blocks: list[int]) -> None:
        self.release(blocks)


class PrefixCachingScheduler(MiniScheduler):
    """Chapter 6's scheduler over a MiniPrefixCache: a request starts computing after its cached blocks."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.cached_tokens: dict[str, int] = {}  # request -> tokens found cached at its first admission

    def allocate_prompt(self, request: Request, need: int) -> None:
        request.block_table, request.num_computed_tokens = self.pool.admit(request.all_token_ids)
        self.cached_tokens.setdefault(request.request_id, request.num_computed_tokens)


def prefix_caching_engine(model, eos_token_id: int, num_blocks: int = 256, block_size: int = 16,
                          max_num_seqs: int = 8, max_num_batched_tokens: int = 2048) -> MiniEngine:
    """Chapter 7's engine with the prefix cache in place of its block pool."""
    engine = MiniEngine(model, eos_token_id, num_blocks, block_size, max_num_seqs, max_num_batched_tokens)
    engine.pool = MiniPrefixCache(num_blocks, block_size)
    engine.scheduler = PrefixCachingScheduler(engine.pool, max_num_seqs, max_num_batched_tokens, eos_token_id)
    return engine
