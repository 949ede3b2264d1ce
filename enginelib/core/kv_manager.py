"""The KV-cache manager, between the scheduler and the :class:`BlockPool` as in vLLM v1: the scheduler decides *how
many* tokens a request computes, the manager finds the blocks (it alone writes ``request.block_table``). Prefix caching
(chapter 9): a full block's hash chains its parent's hash and its own tokens, so equal hashes mean equal prefixes and a
new request reuses the longest cached chain; a block still being filled has no hash and is never shared."""
from __future__ import annotations

from dataclasses import dataclass

from enginelib.core.block_pool import BlockPool
from enginelib.core.request import Request

ROOT_HASH = 0  # the "parent" of a sequence's first block


def chain_hashes(token_ids: list[int], block_size: int, hashes: list[int] | None = None) -> list[int]:
    """The chained hash of every full block of ``token_ids``, appended to ``hashes`` (those of a prefix). Different
    tokens may share a hash (64 bits), so a hit also compares the tokens (:meth:`BlockPool.lookup`)."""
    hashes = [] if hashes is None else hashes
    for i in range(len(hashes), len(token_ids) // block_size):
        parent = hashes[-1] if hashes else ROOT_HASH
        hashes.append(hash((parent, tuple(token_ids[i * block_size:(i + 1) * block_size]))))
    return hashes


@dataclass
class PrefixCacheStats:
    lookups: int = 0         # admissions that looked for a cached prefix
    queried_tokens: int = 0  # tokens those admissions had to compute without the cache
    hit_tokens: int = 0      # of them, tokens found in the cache

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


class KVCacheManager:
    def __init__(self, pool: BlockPool, enable_prefix_caching: bool = True) -> None:
        self.pool = pool
        self.enable_prefix_caching = enable_prefix_caching
        self.stats = PrefixCacheStats()

    @property
    def block_size(self) -> int:
        return self.pool.block_size

    def find_cached_prefix(self, request: Request) -> list[int]:
        """The longest chain of cached blocks that starts the request's tokens (no owners added yet). It stops one token
        short of the end: the last token is always computed, for the logits that sample the next one. A request
        still owed prompt logprobs finds nothing: a cached token has no logits (vLLM skips the cache for it too)."""
        if not self.enable_prefix_caching or request.needs_prompt_logprobs:
            return []
        tokens = request.all_token_ids
        chain_hashes(tokens, self.block_size, request.block_hashes)
        blocks = []
        for i, h in enumerate(request.block_hashes[:(len(tokens) - 1) // self.block_size]):
            block = self.pool.lookup(h, tuple(tokens[i * self.block_size:(i + 1) * self.block_size]))
            if block is None:
                break
            blocks.append(block)
        return blocks

    def allocate_slots(self, request: Request, num_new_tokens: int, cached: list[int] | None = None) -> bool:
        """Give ``request`` blocks for ``num_new_tokens`` more tokens after the ``cached`` prefix (admission); False,
        changing nothing, if too few are free. Blocks the new tokens fill are hashed at once, so a request admitted
        later in the step can share them: every layer writes the step's K/V before any attention reads them."""
        admission, cached = cached is not None, cached or []
        reused = sum(self.pool.ref_counts[b] == 0 for b in cached)  # cached, but on the free side: they cost a slot
        computed = request.num_computed_tokens + len(cached) * self.block_size
        need = self.pool.blocks_for(computed + num_new_tokens) - len(request.block_table) - len(cached)
        if need + reused > self.pool.num_free:
            return False
        if admission and self.enable_prefix_caching and not request.needs_prompt_logprobs:  # one that looked, once
            self.stats.lookups += 1
            self.stats.queried_tokens += request.num_tokens
            self.stats.hit_tokens += len(cached) * self.block_size
        self.pool.share(cached)  # before allocating, so no block we reuse is evicted
        request.block_table += cached + self.pool.allocate(max(need, 0))
        request.num_computed_tokens = computed
        if self.enable_prefix_caching:  # only the request's own tokens: slots for guesses past them are not hashed
            self._cache_full_blocks(request, computed, min(computed + num_new_tokens, request.num_tokens))
        return True

    def keep(self, request: Request, start: int) -> None:
        """After verifying guesses, tokens ``start..num_computed_tokens`` are the request's: blocks they complete are
        hashed only now (a hash stands for verified tokens); blocks past them held rejected guesses and go back."""
        keep = self.pool.blocks_for(request.num_computed_tokens)
        if self.enable_prefix_caching:
            self._cache_full_blocks(request, start, request.num_computed_tokens)
        self.pool.free(request.block_table[keep:][::-1])
        del request.block_table[keep:]

    def _cache_full_blocks(self, request: Request, start: int, end: int) -> None:
        """Hash the blocks that tokens ``start..end`` complete; a partly filled block stays private."""
        first, full = start // self.block_size, end // self.block_size
        if first == full:
            return  # most decode steps: no block completed
        tokens = request.all_token_ids
        chain_hashes(tokens[:full * self.block_size], self.block_size, request.block_hashes)
        for i in range(first, full):
            self.pool.cache(request.block_table[i], request.block_hashes[i],
                            tuple(tokens[i * self.block_size:(i + 1) * self.block_size]))

    def free(self, request: Request) -> None:
        """Give every block back, last first (the tail is the least likely to be shared: evict it first)."""
        self.pool.free(request.block_table[::-1])
        request.block_table = []

    def owners(self, requests: list[Request]) -> dict[str, list[int]]:
        """Who holds which blocks: for :meth:`BlockPool.check`."""
        return {r.request_id: r.block_table for r in requests}
