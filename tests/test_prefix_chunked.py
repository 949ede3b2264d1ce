"""Prefix caching and chunked prefill (chapters 9-10).

The bookkeeping is tested on plain data; the oracle on the real model: greedy
outputs with caching and chunking on equal those with both off, token for
token (``agree``), through full-prompt hits, hits within one step, a hit on the
block next in line for eviction, chunk edges inside and on block edges, and
preemption of a request whose blocks are shared. A hypothesis test runs random
schedules on the tiny model and checks after every step that no shared block
is freed or overwritten, nothing leaks and nothing is lost.
"""
from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from enginelib.baselines import generate_cached
from enginelib.config import SamplingParams
from enginelib.core.block_pool import BlockPool
from enginelib.core.engine import Engine, EngineConfig
from enginelib.core.kv_manager import KVCacheManager, chain_hashes
from enginelib.core.paged_cache import PagedKVCache
from enginelib.core.request import Request
from enginelib.core.scheduler import SchedulerConfig
from enginelib.model.checks import check_greedy

from .conftest import chat_ids, tiny_tokenizer

SYSTEM = ("You are a patient astronomy tutor. Answer in one or two plain sentences, name the planet or moon "
          "you talk about, and never use lists.")
QUESTIONS = ["What is the largest planet?", "Why is Mars red?", "How far away is the Moon?",
             "What are Saturn's rings made of?", "Which planet has the shortest day?"]
GREEDY = SamplingParams(temperature=0, max_tokens=10)


# --- bookkeeping, on plain data ---------------------------------------------------------

def test_chained_hashes_stand_for_the_whole_prefix():
    a = chain_hashes(list(range(10)), 4)
    assert len(a) == 2  # two full blocks; the partial third is not hashed
    assert chain_hashes(list(range(8)) + [99, 98], 4) == a  # the tail differs inside the partial block only
    b = chain_hashes([100] + list(range(1, 10)), 4)
    assert b[0] != a[0] and b[1] != a[1]  # same second block, different parent: a different prefix
    known = a[:1]
    assert chain_hashes(list(range(10)), 4, known) is known and known == a  # extends what is known


def test_a_freed_cached_block_is_found_again_and_evicted_last_recently_used_first():
    pool = BlockPool(4, 2)
    a, b = pool.allocate(2)
    pool.cache(a, 111, (1, 2))
    pool.cache(b, 222, (3, 4))
    pool.free([a])  # a first: it is the least recently used
    pool.free([b])
    assert pool.num_free == 4 and pool.stats().cached == 2
    assert pool.lookup(111, (1, 2)) == a and pool.lookup(111, (9, 9)) is None  # a hash hit compares tokens
    assert sorted(pool.allocate(2)) == [2, 3]  # empty blocks go before cached ones
    assert pool.allocate(1) == [a] and pool.evictions == 1 and pool.lookup(111, (1, 2)) is None
    pool.share([b])  # a hit on a free cached block takes it off the free side
    assert pool.ref_counts[b] == 1 and pool.num_free == 0
    pool.check()
    with pytest.raises(ValueError, match="holds nothing cached"):
        BlockPool(2, 2).share([0])


def _request(rid: str, tokens: list[int], max_tokens: int = 4) -> Request:
    return Request(rid, tokens, SamplingParams(temperature=0, max_tokens=max_tokens))


def test_the_manager_reuses_full_blocks_only_and_always_computes_the_last_token():
    kv = KVCacheManager(BlockPool(16, 4))
    first = _request("a", list(range(12)))  # exactly 3 full blocks
    assert kv.find_cached_prefix(first) == []
    assert kv.allocate_slots(first, 12, [])
    same = _request("b", list(range(12)))
    hit = kv.find_cached_prefix(same)
    assert hit == first.block_table[:2]  # not the third: the last token must be computed for its logits
    longer = _request("c", list(range(14)))
    assert kv.find_cached_prefix(longer) == first.block_table[:3]  # a full-prompt hit of another's prompt
    assert kv.allocate_slots(longer, 2, kv.find_cached_prefix(longer))
    assert longer.num_computed_tokens == 12 and longer.block_table[:3] == first.block_table
    assert [kv.pool.ref_counts[b] for b in first.block_table] == [2, 2, 2]
    assert kv.pool.block_hashes[longer.block_table[3]] is None  # still being filled: never shared
    assert kv.stats.lookups == 2 and kv.stats.hit_tokens == 12 and kv.stats.queried_tokens == 26
    kv.free(first)
    kv.free(longer)
    kv.pool.check({})
    assert kv.pool.num_free == 16


def test_a_hit_on_the_block_next_in_line_for_eviction_is_taken_before_anything_is_evicted():
    kv = KVCacheManager(BlockPool(4, 2))
    for rid, tokens in (("old", [1, 2, 3]), ("older", [5, 6, 7])):  # each: 1 full block (cached) + 1 partial
        r = _request(rid, tokens)
        assert kv.allocate_slots(r, 3, [])
        kv.free(r)
    head = next(iter(kv.pool._evictable))
    new = _request("new", [1, 2, 9, 9, 9, 9, 9])  # shares old's full block, then needs 3 more blocks
    hit = kv.find_cached_prefix(new)
    assert hit == [head] and kv.pool.num_free == 4  # the hit is the least recently used cached block
    assert kv.allocate_slots(new, 5, hit)  # 1 reused + 3 new = 4: only possible if the hit is not evicted
    assert new.block_table[0] == head and kv.pool.evictions == 1 and new.num_computed_tokens == 2
    kv.pool.check({"new": new.block_table})


# --- the oracle on the real model -------------------------------------------------------

@pytest.fixture(scope="module")
def prompts(real):
    _, tok = real
    return [tok.encode(tok.apply_chat_template([{"role": "system", "content": SYSTEM},
                                                {"role": "user", "content": q}])) for q in QUESTIONS]


@pytest.fixture(scope="module")
def reference(real, prompts):
    model, tok = real
    return [generate_cached(model, p, GREEDY, tok.eos_token_id).token_ids for p in prompts]


def serve(engine: Engine, prompts: list[list[int]], arrivals: list[int] | None = None,
          params: SamplingParams = GREEDY) -> list[list[int]]:
    """Add prompt i at step arrivals[i] (from now), run to the end checking the pool every step; outputs in order."""
    arrivals = arrivals or [0] * len(prompts)
    ids, outs, start = {}, {}, engine.steps
    while len(outs) < len(prompts):
        assert engine.steps - start < 500, "the engine stalled"
        for i, at in enumerate(arrivals):
            if at == engine.steps - start and i not in ids.values():
                ids[engine.add_request(prompts[i], params)] = i
        outs |= {o.request_id: o for o in engine.step() if o.finished}
        engine.pool.check(engine.kv.owners(engine.scheduler.running))
    assert engine.pool.num_used == 0, "blocks leaked"
    return [outs[rid].outputs[0].token_ids for rid in sorted(ids, key=ids.get)]


def engine(real, *, caching=True, chunking=True, budget=2048, seqs=8, num_blocks=256, block_size=4,
           record=False) -> Engine:
    model, tok = real
    return Engine(model, tok, EngineConfig(block_size=block_size, num_blocks=num_blocks, enable_prefix_caching=caching,
                                           scheduler=SchedulerConfig(seqs, budget, chunking), record=record))


def test_a_full_prompt_hit_gives_the_same_answer(real, prompts, reference, agree):
    e = engine(real)
    p = prompts[0][:len(prompts[0]) // 4 * 4]  # a whole number of blocks
    first = serve(e, [p])
    again = serve(e, [p])
    assert e.kv.stats.hit_tokens == len(p) - 4  # every block but the last, whose last token is computed
    expected = generate_cached(real[0], p, GREEDY, real[1].eos_token_id).token_ids
    print(agree(real[0], [p, p], first + again, [expected, expected]))


def test_requests_admitted_in_one_step_share_the_system_prompt(real, prompts, reference, agree):
    e = engine(real, record=True)
    got = serve(e, prompts)
    first = e.history[0]
    assert len(first.scheduled) == len(prompts)  # all admitted in step 0...
    computed = [first.scheduled[str(i)] for i in range(len(prompts))]
    assert all(c < len(p) for c, p in zip(computed[1:], prompts[1:]))  # ...the later ones on the first's blocks
    shared = set(e.history[0].block_tables["0"]) & set(e.history[0].block_tables["1"])
    assert shared and all(first.ref_counts[b] == len(prompts) for b in shared)
    assert e.kv.stats.hit_rate > 0.3
    print(agree(real[0], prompts, got, reference))


def test_a_hit_on_a_block_about_to_be_evicted(real, prompts, reference, agree):
    """A small pool: the system prompt's blocks are next in line for eviction when the next request needs
    nearly every block, so they must be shared before any block is taken."""
    model, tok = real
    filler = chat_ids(tok, "Say something about the ocean, the waves and the wind, at some length.")
    need = -(-(len(prompts[1]) + GREEDY.max_tokens) // 4)
    e = engine(real, num_blocks=need + 1)
    serve(e, [prompts[0]])
    serve(e, [filler])  # freed after the system prompt's blocks: those are now the least recently used
    got = serve(e, [prompts[1]])
    assert e.kv.stats.hit_tokens > 0 and e.pool.evictions > 0
    print(agree(model, prompts[1:2], got, reference[1:2]))


@pytest.mark.parametrize("budget", [8, 7, 13])  # chunks ending on block edges (8), and inside blocks
def test_chunked_prefill_of_a_long_prompt_among_decodes(real, prompts, reference, agree, budget):
    model, tok = real
    e = engine(real, caching=False, budget=budget, seqs=4, record=True)
    got = serve(e, prompts[:4], arrivals=[0, 0, 2, 9])
    chunked = [r for r in e.history if any(n == budget - 1 or n < 4 for n in r.scheduled.values())]
    assert max(r.scheduled.get("3", 0) for r in e.history) <= budget and chunked
    steps_with_token = [r.step for r in e.history if "3" in r.scheduled]
    assert len(steps_with_token) > 1, "the long prompt was prefilled in one step"
    print(agree(model, prompts[:4], got, reference[:4]))


def test_caching_and_chunking_together_equal_both_off(real, prompts, agree):
    model, _ = real
    arrivals = [0, 1, 1, 4, 6]
    off = serve(engine(real, caching=False, chunking=False), prompts, arrivals)
    on = serve(engine(real, budget=9, seqs=3), prompts, arrivals)
    print(agree(model, prompts, on, off))


def test_preempting_a_request_whose_blocks_are_shared(real, prompts, reference, agree):
    model, _ = real
    e = engine(real, num_blocks=26, seqs=4, budget=16)
    got = serve(e, prompts[:4])
    assert e.stats().preemptions > 0 and e.kv.stats.hit_tokens > 0
    print(agree(model, prompts[:4], got, reference[:4]))


def test_without_chunking_a_request_longer_than_the_budget_is_refused(real, prompts):
    e = engine(real, chunking=False, budget=16)
    with pytest.raises(ValueError, match="enable chunked prefill"):
        e.add_request(prompts[0], GREEDY)
    assert engine(real, budget=16).add_request(prompts[0], GREEDY) == "0"  # chunking lifts the limit


# --- random schedules on the tiny model -------------------------------------------------

class _Writes:
    """Records the cache slots each step writes (PagedKVCache.bind sees every batch) and the blocks
    the pool evicted meanwhile (an evicted block may be refilled, even with the same tokens)."""

    def __init__(self, engine: Engine) -> None:
        self.slots: list[int] = []
        self.evicted: set[int] = set()
        bind, uncache = engine.cache.bind, engine.pool._uncache

        def spy_bind(batch) -> PagedKVCache:
            self.slots = batch.slot_mapping.tolist()
            return bind(batch)

        def spy_uncache(block: int) -> None:
            self.evicted.add(block)
            uncache(block)

        engine.cache.bind, engine.pool._uncache = spy_bind, spy_uncache


ops = st.lists(st.one_of(
    st.tuples(st.just("add"), st.integers(0, 3), st.integers(0, 8), st.integers(1, 10)),  # prefix, tail, max_tokens
    st.tuples(st.just("add"), st.integers(1, 3), st.integers(0, 3), st.integers(-6, -1)),  # mostly the prefix,
    # and max_tokens < 0 means |max_tokens| without ignore_eos: EOS may end it early
    st.tuples(st.just("abort"), st.integers(0, 100), st.just(0), st.just(0)),
    st.tuples(st.just("step"), st.integers(1, 3), st.just(0), st.just(0)),
), min_size=8, max_size=40)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=ops, num_blocks=st.integers(8, 40), block_size=st.sampled_from([1, 2, 4]),
       seqs=st.integers(1, 5), budget_extra=st.integers(0, 12), caching=st.booleans(), chunking=st.booleans(),
       seed=st.integers(0, 1000))
def test_random_schedules_with_shared_prefixes(tiny, tiny_dt, ops, num_blocks, block_size, seqs, budget_extra,
                                               caching, chunking, seed):
    tok = tiny_tokenizer(tiny.cfg.vocab_size)
    budget = seqs + budget_extra if chunking else 64
    e = Engine(tiny_dt, tok, EngineConfig(num_blocks=num_blocks, block_size=block_size, enable_prefix_caching=caching,
                                          scheduler=SchedulerConfig(seqs, budget, chunking)))
    rng = random.Random(seed)
    prefixes = [[rng.randrange(tok.eos_token_id) for _ in range(n)] for n in (0, 5, 9, 14)]
    writes = _Writes(e)
    added, aborted, finals = {}, set(), {}

    def step():
        before = {b: h for b, h in enumerate(e.pool.block_hashes) if h is not None}
        writes.slots, writes.evicted = [], set()
        for out in e.step():
            if out.finished:
                finals[out.request_id] = out
        # No slot was written of a block whose contents were cached before the step and not evicted since.
        kept = set(before) - writes.evicted
        assert not {s // block_size for s in writes.slots} & kept, "a cached block was overwritten"
        e.pool.check(e.kv.owners(e.scheduler.running))  # ref counts = holders: nothing shared was freed
        assert all(not r.block_table for r in e.scheduler.waiting)

    for op, a, b, c in ops:
        if op == "add":
            prompt = prefixes[a] + [rng.randrange(tok.eos_token_id) for _ in range(b)] or [1]
            params = SamplingParams(temperature=0, max_tokens=abs(c), ignore_eos=c > 0)
            try:
                added[e.add_request(prompt, params)] = (prompt, params)
            except ValueError as err:
                assert "whole pool" in str(err) or "max_num_batched_tokens" in str(err)
        elif op == "abort":
            live = [r.request_id for r in (*e.scheduler.running, *e.scheduler.waiting)]
            if live:
                rid = live[a % len(live)]
                finals[rid] = e.abort(rid)
                aborted.add(rid)
        else:
            for _ in range(a):
                step()
    for _ in range(3000):
        if not e.has_unfinished_requests():
            break
        step()
    assert not e.has_unfinished_requests(), "the engine stalled"
    event(f"hits: {e.kv.stats.hit_tokens > 0}, preemptions: {e.stats().preemptions > 0}, "
          f"evictions: {e.pool.evictions > 0}, chunked: {chunking}")
    assert e.pool.num_used == 0, "blocks leaked"
    assert set(finals) == set(added), "a request was lost"
    for rid, (prompt, params) in added.items():
        out = finals[rid].outputs[0]
        if rid in aborted:
            assert out.finish_reason == "abort"
            continue
        assert out.finish_reason in ("stop", "length") and len(out.token_ids) <= params.max_tokens
        expected = generate_cached(tiny_dt, prompt, params, tok.eos_token_id)
        check_greedy(tiny_dt, [prompt], [out.token_ids], [expected.token_ids], reference=tiny)
