"""Speculative decoding (issue 11): guesses verified in one step, rolled back exactly.

On plain data: the n-gram proposer, the KV-cache manager's rule that a hash
only ever stands for verified tokens, and the rejection rule's distribution.
On the real model, the oracle: greedy output with speculation equals plain
greedy, token for token (``agree``), also in batches that mix speculating and
prefilling requests with prefix caching on, with the pool's invariants checked
after every step and no cached block holding anything but the request's own
tokens. On the tiny model: with temperature > 0 the tokens that verification
emits follow the target's distribution.
"""
from __future__ import annotations

import dataclasses
import math
import random
from collections import Counter

import pytest
import torch

from enginelib.baselines import generate_cached
from enginelib.config import SamplingParams
from enginelib.core.block_pool import BlockPool
from enginelib.core.engine import Engine, EngineConfig
from enginelib.core.kv_manager import KVCacheManager, chain_hashes
from enginelib.core.request import Request
from enginelib.core.scheduler import ScheduledWork, Scheduler, SchedulerConfig, SchedulerOutput
from enginelib.model import ModelConfig, Transformer
from enginelib.model.sampling import filter_logits
from enginelib.speed.speculative import (
    DraftModelProposer,
    NgramProposer,
    SpeculativeConfig,
    accept_greedy,
    common_prefix,
    compile_draft_unavailable,
    rejection_sample,
)

from .conftest import chat_ids, tiny_tokenizer

REPEAT = "Repeat this line three times: the quick brown fox jumps over the lazy dog."
DAYS = "List the days of the week, one per line, then list them again in reverse order."
PLAIN = "Why is the sky blue?"
SYSTEM = "You are a helpful assistant. Answer briefly and plainly."


def ngram(k: int = 4, **more) -> SpeculativeConfig:
    return SpeculativeConfig(method="ngram", num_speculative_tokens=k, **more)


# --- plain data -------------------------------------------------------------------------

def test_the_ngram_proposer_proposes_what_followed_the_latest_earlier_match():
    p = NgramProposer(max_n=3, min_n=1)
    assert p.propose([1, 2, 3, 9, 1, 2, 3], 2) == [9, 1]  # the 3-gram [1, 2, 3] was followed by 9, 1
    assert p.propose([5, 1, 2, 7, 1, 2, 8, 3, 1, 2], 3) == [8, 3, 1]  # the latest earlier [1, 2]
    assert p.propose([4, 5, 6, 7], 3) == []  # nothing repeats: no guess, a plain decode
    assert p.propose([1, 2, 3, 4, 3], 5) == [4, 3]  # the 1-gram, and only what exists after it
    assert NgramProposer(max_n=3, min_n=2).propose([1, 9, 2, 1], 2) == []  # 1-grams are not tried


def test_greedy_acceptance_keeps_guesses_while_they_match_then_adds_the_targets_token():
    assert accept_greedy([5, 6, 7], [5, 6, 8, 9]) == [5, 6, 8]  # the third guess is wrong: corrected
    assert accept_greedy([5, 6, 7], [5, 6, 7, 9]) == [5, 6, 7, 9]  # all right: a bonus token
    assert accept_greedy([5, 6], [4, 6, 1]) == [4]


def test_a_block_is_hashed_only_once_its_tokens_are_verified_and_rejected_guesses_free_their_blocks():
    pool = BlockPool(8, 4)
    kv = KVCacheManager(pool)
    request = Request("a", list(range(10, 16)), SamplingParams(temperature=0, max_tokens=20))
    assert kv.allocate_slots(request, 6, [])  # the prompt: one full block, hashed
    request.num_computed_tokens = 6  # what the scheduler counts after the prefill...
    request.output_token_ids.append(50)  # ...which sampled the first token: 7 tokens, 6 computed
    assert [h is not None for h in pool.block_hashes[:2]] == [True, False]
    guesses = [51, 52, 53, 54, 55]  # positions 7..11: they would fill block 1 and start block 2
    assert kv.allocate_slots(request, 1 + len(guesses))
    assert len(request.block_table) == 3
    assert pool.block_hashes[request.block_table[1]] is None  # block 1 would hold guesses: not hashed yet
    # verification kept two guesses (51, 52) and the target said 60: tokens 0..8 stand, 9 is computed next step
    request.output_token_ids += [51, 52, 60]
    request.num_computed_tokens = 6 + 1 + 2
    kv.keep(request, 7)
    assert len(request.block_table) == 3  # 9 computed tokens need 3 blocks
    assert pool.block_hashes[request.block_table[1]] == chain_hashes(request.all_token_ids, 4)[1]  # now verified
    assert pool.block_hashes[request.block_table[2]] is None
    guesses = [61, 62, 63, 64]  # positions 10..13: blocks 2 and 3
    assert kv.allocate_slots(request, 1 + len(guesses)) and len(request.block_table) == 4
    request.output_token_ids.append(70)  # all rejected: the target said 70; 10 tokens computed
    request.num_computed_tokens = 9 + 1
    kv.keep(request, 10)
    assert len(request.block_table) == 3 and pool.num_used == 3  # block 3 held rejected guesses only
    assert pool.block_hashes[request.block_table[2]] is None  # block 2 is not full of verified tokens
    pool.check(kv.owners([request]))
    kv.free(request)
    assert pool.num_used == 0


def test_guesses_fit_the_budget_max_tokens_and_never_take_a_block_another_decode_needs():
    pool = BlockPool(4, 4)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), KVCacheManager(pool))
    a = Request("a", [1, 2, 3], SamplingParams(temperature=0, max_tokens=10))
    b = Request("b", [4, 5, 6, 7], SamplingParams(temperature=0, max_tokens=9))
    scheduler.add(a)
    scheduler.add(b)
    scheduler.update(scheduler.schedule(), [8, 8])  # both prefilled: a block each, two free
    plan = scheduler.schedule({"a": [9] * 6})
    (wa, wb) = plan.scheduled
    assert wa.draft_token_ids == [9] * 4 and wa.num_tokens == 5  # 4 guesses: one block, one left for b
    assert wb.num_tokens == 1 and len(b.block_table) == 2 and not plan.preempted  # b needed a new block to decode
    scheduler.update(plan, [[9, 9, 5], 6])  # a kept two guesses, then the target's 5
    assert a.output_token_ids == [8, 9, 9, 5] and a.num_computed_tokens == 6 and len(a.block_table) == 2
    assert b.output_token_ids == [8, 6] and pool.num_free == 0
    pool.check(scheduler.kv.owners(scheduler.running))
    plan = scheduler.schedule({"a": [1] * 9, "b": [2] * 9})
    assert [w.num_tokens for w in plan.scheduled] == [1 + 1, 1 + 2]  # what is left of their blocks
    tight = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=3), KVCacheManager(BlockPool(8, 4)))
    c = Request("c", [1, 2], SamplingParams(temperature=0, max_tokens=3))
    tight.add(c)
    tight.update(tight.schedule(), [3])
    assert tight.schedule({"c": [4, 5, 6]}).scheduled[0].draft_token_ids == [4]  # max_tokens 3: 1 + 1 guess + 1 more
    with pytest.raises(ValueError, match="must start with the kept guesses"):
        tight.update(SchedulerOutput([ScheduledWork(c, 2, False, 2, True, [4])]), [[5, 7]])


def test_the_rejection_rule_emits_the_targets_distribution_for_any_proposal_distribution():
    """Statistically, with a proposer that samples from its own q (not one-hot): what comes out is p."""
    torch.manual_seed(0)
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, 1.5]])
    q = torch.tensor([[0.05, 0.6, 0.05, 0.1, 0.1, 0.1]])  # far from p: many rejections
    p = logits.softmax(-1)[0]
    n, got = 3000, Counter()
    generator = torch.Generator().manual_seed(1)
    for _ in range(n):
        x = int(torch.multinomial(q[0], 1, generator=generator))
        accepted, token = rejection_sample(torch.cat([logits, logits]), [x], SamplingParams(temperature=1.0),
                                           generator, draft_probs=q).tolist()
        assert accepted in (0, 1)
        got[x if accepted else token] += 1
    for t in range(len(p)):
        pt = float(p[t])
        assert abs(got[t] / n - pt) <= 4.5 * math.sqrt(pt * (1 - pt) / n), (t, got, p)


def test_common_prefix_counts_the_shared_leading_tokens():
    assert common_prefix([1, 2, 3], [1, 2, 3, 4]) == 3
    assert common_prefix([1, 2, 3, 4], [1, 2, 9, 4]) == 2
    assert common_prefix([5], [6]) == 0 and common_prefix([], [1]) == 0
    rng = random.Random(0)
    for _ in range(200):
        a = [rng.randrange(3) for _ in range(rng.randrange(40))]
        b = a[:rng.randrange(len(a) + 1)] + [rng.randrange(3) for _ in range(rng.randrange(10))]
        want = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        assert common_prefix(a, b) == want


def test_the_draft_proposers_caches_propose_what_a_fresh_recompute_would(tiny):
    """Rollback, a copied shared prefix, growth past the first cache and eviction: the guesses are
    always the draft's own greedy continuation, and a sequence's cache only feeds what is new."""
    proposer = DraftModelProposer(tiny, tiny.cfg.vocab_size, max_sequences=2)

    def propose(ids: list[int], k: int = 4) -> list[int]:
        got = proposer.propose(ids, k)
        assert got == generate_cached(tiny, ids, SamplingParams(temperature=0, max_tokens=k)).token_ids
        return got

    rng = random.Random(1)
    a = [rng.randrange(200) for _ in range(20)]
    guesses = propose(a)
    assert proposer.fed_tokens == 20 + 3
    a += guesses[:2] + [7]  # two guesses kept, then the target's correction
    before = proposer.fed_tokens
    guesses = propose(a)
    assert proposer.fed_tokens - before == 1 + 3  # the kept guesses are cached: the correction, then k - 1
    b = a[:15] + [9, 9]  # another sequence, sharing 15 tokens: a cache of its own from a copy
    propose(b)
    assert len(proposer.sequences) == 2
    before = proposer.fed_tokens
    a += guesses  # every guess kept, and the bonus token (its last guess) was the target's
    propose(a)
    assert proposer.fed_tokens - before == 1 + 3, "a's cache survived b's proposal"
    for _ in range(12):  # past 64 tokens: the cache grows into a bigger copy
        a += propose(a)
    assert proposer.sequences[-1].cache.max_len == 128 and len(a) > 64
    c = [rng.randrange(200) for _ in range(6)]
    propose(c)  # a third sequence: b's cache, used least recently, goes
    assert len(proposer.sequences) == 2 and all(s.tokens[:17] != b for s in proposer.sequences)
    assert propose(b) and proposer.propose(list(range(tiny.cfg.context_length)), 4) == []  # no room: no guess


def test_a_compiled_draft_proposes_its_own_greedy_continuation_and_keeps_the_engine_exact(tiny):
    """compile_draft: one-token guesses through the engine's compiled batch-1 step, each cache's row seen as
    blocks 0, 1, 2, ...; on the float32 tiny model they are the draft's greedy continuation, exactly."""
    reason = compile_draft_unavailable(tiny)
    if reason:
        pytest.skip(reason)
    proposer = DraftModelProposer(tiny, tiny.cfg.vocab_size, max_sequences=2, compile=True)
    assert proposer.slots == tiny.cfg.context_length  # 256: below COMPILED_SLOTS, one size for every cache
    rng = random.Random(2)
    seqs = [[rng.randrange(200) for _ in range(20)], [rng.randrange(200) for _ in range(9)]]
    for turn in range(12):  # two sequences in turn; a kept guess, a correction, rolled back each time
        ids = seqs[turn % 2]
        got = proposer.propose(ids, 4)
        assert got == generate_cached(tiny, ids, SamplingParams(temperature=0, max_tokens=4)).token_ids
        ids += got[:1] + [7]
    assert proposer.decoder.calls[1] >= 12 * 3  # every one-token guess ran compiled
    assert DraftModelProposer(tiny, tiny.cfg.vocab_size, compile=True).decoder is proposer.decoder  # compiled once

    tok = tiny_tokenizer(tiny.cfg.vocab_size)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    spec = SpeculativeConfig(method="draft", draft_model=tiny, compile_draft=True)
    engine = Engine(tiny, tok, EngineConfig(num_blocks=64, block_size=4, speculative=spec))
    prompts = [[rng.randrange(200) for _ in range(n)] for n in (5, 11)]
    ids = [engine.add_request(p, params) for p in prompts]
    while engine.has_unfinished_requests():
        engine.step()
    for prompt, rid in zip(prompts, ids):
        assert engine.request(rid).output_token_ids == generate_cached(tiny, prompt, params).token_ids
    assert engine.runner.spec_stats.acceptance_rate == 1.0 and engine.pool.num_used == 0  # its own draft: all kept


def test_bad_speculative_configs_say_what_to_change(tiny):
    for k in (0, -2, True, 1.5):
        with pytest.raises(ValueError, match="num_speculative_tokens must be a positive integer"):
            SpeculativeConfig(num_speculative_tokens=k)
    with pytest.raises(ValueError, match="unknown speculative method"):
        SpeculativeConfig(method="medusa")
    with pytest.raises(ValueError, match="needs a draft model"):
        SpeculativeConfig(method="draft")
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        SpeculativeConfig(prompt_lookup_min=3, prompt_lookup_max=2)
    with pytest.raises(ValueError, match="compile_draft compiles a draft model's steps: use it with method='draft'"):
        SpeculativeConfig(compile_draft=True)
    other = Transformer(ModelConfig.tiny(vocab_size=128))
    with pytest.raises(ValueError, match="vocabulary .128 tokens. differs from the target's .256."):
        Engine(tiny, tiny_tokenizer(256), EngineConfig(num_blocks=16, speculative=SpeculativeConfig(
            method="draft", draft_model=other)))
    with pytest.raises(ValueError, match="differs"):
        DraftModelProposer(other, 256)


# --- the oracle on the real model -------------------------------------------------------

def _check_cached_blocks(engine: Engine) -> None:
    """Every hashed block a live request holds carries exactly that request's tokens (never a guess)."""
    pool, bs = engine.pool, engine.pool.block_size
    for request in engine.scheduler.running:
        tokens = request.all_token_ids
        for i, block in enumerate(request.block_table):
            if pool.block_hashes[block] is not None:
                assert (i + 1) * bs <= len(tokens), f"block {block} is hashed but not full of {request.request_id}'s tokens"
                assert pool.lookup(pool.block_hashes[block], tuple(tokens[i * bs:(i + 1) * bs])) == block
                assert pool.block_hashes[block] == chain_hashes(tokens, bs)[i]


def _run(engine: Engine, arrivals: list[tuple[int, list[int], SamplingParams]]) -> list[str]:
    """Add each request at its step, step to the end, check the pool after every step; return the ids."""
    ids, step = [], 0
    pending = sorted(arrivals, key=lambda a: a[0])
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][0] <= step:
            _, prompt, params = pending.pop(0)
            ids.append(engine.add_request(prompt, params))
        engine.step()
        step += 1
        engine.pool.check(engine.kv.owners(engine.scheduler.running))
        _check_cached_blocks(engine)
    assert engine.stats().pool.used == 0
    return ids


def test_greedy_with_ngram_speculation_is_plain_greedy_in_a_mixed_batch(real, agree, k=3):
    model, tok = real
    prompts = [chat_ids(tok, q) for q in (DAYS, REPEAT, PLAIN)]
    prompts.append(tok.encode(tok.apply_chat_template([{"role": "system", "content": SYSTEM},
                                                       {"role": "user", "content": REPEAT}])))
    prompts.append(list(prompts[3]))  # the same again, later: a prefix-cache hit while others speculate
    params = [SamplingParams(temperature=0, max_tokens=m) for m in (40, 48, 24, 33, 17)]
    expected = [generate_cached(model, p, sp, tok.eos_token_id).token_ids for p, sp in zip(prompts, params)]
    engine = Engine(model, tok, EngineConfig(block_size=4, num_blocks=200, speculative=ngram(k), record=True,
                                             scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64)))
    ids = _run(engine, [(0, prompts[0], params[0]), (0, prompts[1], params[1]), (3, prompts[2], params[2]),
                        (5, prompts[3], params[3]), (9, prompts[4], params[4])])
    got = [engine.request(i).output_token_ids for i in ids]
    print(agree(model, prompts, got, expected))
    stats = engine.runner.spec_stats
    assert stats.accepted > 0 and 0 < stats.acceptance_rate <= 1, stats
    assert stats.proposed <= k * stats.verifications
    mixed = [r for r in engine.history if any(n > 1 for rid, n in r.scheduled.items() if rid not in r.prefill)
             and r.prefill]
    assert mixed, "some step should verify guesses while another request prefills"
    assert engine.stats().prefix_cache.hit_tokens > 0
    assert engine.stats().generated_tokens == sum(map(len, got))


def test_stops_inside_an_accepted_run_end_the_output_where_plain_decoding_does(real):
    model, tok = real
    prompt = chat_ids(tok, DAYS)
    plain = Engine(model, tok, EngineConfig(num_blocks=100))
    spec = Engine(model, tok, EngineConfig(num_blocks=100, speculative=ngram(6)))
    runs = []  # (request id, outputs before, run) of every verification, to see where a stop fell
    verify = spec.scheduler._update_verified

    def spy(work, run):
        runs.append((work.request.request_id, len(work.request.output_token_ids), len(run)))
        return verify(work, run)

    spec.scheduler._update_verified = spy
    reference = plain.add_request(prompt, SamplingParams(temperature=0, max_tokens=50))
    while plain.has_unfinished_requests():
        plain.step()
    words = plain.request(reference).output_token_ids
    text = tok.decode(words)
    assert "Sunday, Monday, Tuesday, Wednesday, Thursday, Friday" in text  # it repeats itself: guesses hit
    cases = [SamplingParams(temperature=0, max_tokens=37)]
    cases += [SamplingParams(temperature=0, max_tokens=50, stop=[s]) for s in (
        "Sunday, Monday, Tuesday, Wednesday, Thursday", "Sunday, Monday, Tuesday, Wednesday, Thursday, Friday")]
    cases.append(SamplingParams(temperature=0, max_tokens=50, stop_token_ids=[words[45]]))
    cut_inside = 0
    for params in cases:
        outs = []
        for engine in (plain, spec):
            rid = engine.add_request(prompt, params)
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        outs.append(out)
        a, b = outs
        assert (b.outputs[0].token_ids, b.outputs[0].text, b.outputs[0].finish_reason) == \
               (a.outputs[0].token_ids, a.outputs[0].text, a.outputs[0].finish_reason), params
        assert len(b.metrics.token_times) == len(b.outputs[0].token_ids)
        last = [r for r in runs if r[0] == rid][-1:]
        cut_inside += bool(last) and last[0][1] + last[0][2] > len(b.outputs[0].token_ids)
        assert spec.stats().pool.used == 0
    assert spec.runner.spec_stats.accepted > 0
    assert cut_inside > 0, "some stop should fall inside a verified run, before its last token"


def test_the_target_as_its_own_draft_model_is_accepted_and_exact_in_a_batch(real, agree):
    """Three chats with the same system prompt at once: each keeps a draft cache of its own."""
    model, tok = real
    prompts = [tok.encode(tok.apply_chat_template([{"role": "system", "content": SYSTEM},
                                                   {"role": "user", "content": q}])) for q in (PLAIN, DAYS, REPEAT)]
    params = SamplingParams(temperature=0, max_tokens=12)
    expected = [generate_cached(model, p, params, tok.eos_token_id).token_ids for p in prompts]
    engine = Engine(model, tok, EngineConfig(num_blocks=64, speculative=SpeculativeConfig(
        method="draft", num_speculative_tokens=3, draft_model=model)))
    ids = _run(engine, [(0, p, params) for p in prompts])
    print(agree(model, prompts, [engine.request(i).output_token_ids for i in ids], expected))
    assert engine.runner.spec_stats.acceptance_rate > 0.8, engine.runner.spec_stats  # the same model: only near-ties differ
    assert len(engine.runner.proposer.sequences) == 3
    verifications = engine.runner.spec_stats.verifications
    assert engine.runner.proposer.fed_tokens < sum(map(len, prompts)) + verifications * (3 + 3), "no prefill per proposal"


def test_without_a_speculative_config_nothing_speculates(real):
    model, tok = real
    engine = Engine(model, tok, EngineConfig(num_blocks=64, record=True))
    assert engine.runner.proposer is None
    _run(engine, [(0, chat_ids(tok, REPEAT), SamplingParams(temperature=0, max_tokens=20))])
    assert engine.runner.spec_stats.proposed == 0
    assert all(n == 1 for r in engine.history for rid, n in r.scheduled.items() if rid not in r.prefill)


# --- sampling: the distribution is the target's -------------------------------------------

class FixedProposer:
    """Always guesses the same token: a deterministic proposer (q one-hot)."""

    def __init__(self, token: int) -> None:
        self.token = token

    def propose(self, token_ids, k):
        return [self.token] * k


def test_sampled_tokens_after_verification_follow_the_targets_distribution(tiny_dt):
    """Requests of 3 tokens: the second comes out of verification of one guess. Its frequencies over
    many seeded requests match the target's marginal sum_t0 p(t0) p(t1 | t0), for a likely and an unlikely guess."""
    tok = tiny_tokenizer(tiny_dt.cfg.vocab_size)
    prompt, n = [3, 4, 5], 800
    params = SamplingParams(temperature=0.8, top_k=40, max_tokens=3, ignore_eos=True)
    with torch.inference_mode():
        device = tiny_dt.device
        p0 = filter_logits(tiny_dt(torch.tensor([prompt], device=device))[:, -1], params).softmax(-1)[0]
        vocab = torch.arange(tiny_dt.cfg.vocab_size, device=device)
        seqs = torch.cat([torch.tensor(prompt, device=device).expand(len(vocab), 3), vocab[:, None]], dim=1)
        p1 = filter_logits(tiny_dt(seqs)[:, -1], params).softmax(-1)  # [t0, t1]
        marginal = (p0[:, None] * p1).sum(0).cpu()
    top = marginal.argsort(descending=True)[:8].tolist()
    for guess in (top[0], top[6]):
        engine = Engine(tiny_dt, tok, EngineConfig(num_blocks=512, block_size=4, speculative=ngram(1),
                                                   scheduler=SchedulerConfig(max_num_seqs=128,
                                                                             max_num_batched_tokens=1024)))
        engine.runner.proposer = FixedProposer(guess)
        for seed in range(n):
            engine.add_request(prompt, dataclasses.replace(params, seed=seed))
        second = Counter()
        while engine.has_unfinished_requests():
            second.update(o.outputs[0].token_ids[1] for o in engine.step() if o.finished)
        stats = engine.runner.spec_stats
        assert stats.verifications == n and 0 < stats.accepted < n, stats
        groups = [[t] for t in top] + [[t for t in range(len(marginal)) if t not in top]]
        for group in groups:  # each frequency within 4.5 standard deviations of its probability
            p = float(marginal[group].sum())
            freq = sum(second[t] for t in group) / n
            assert abs(freq - p) <= 4.5 * math.sqrt(p * (1 - p) / n) + 1e-9, (guess, group[:3], freq, p)
        assert engine.stats().pool.used == 0


class NoisyOracle:
    """Proposes the known plain-greedy continuation, each guess corrupted with some probability: some runs
    are kept whole, some cut at a random place (the tiny model's prompts differ in their 11th token)."""

    def __init__(self, expected: dict[int, tuple[int, list[int]]], noise: float, seed: int) -> None:
        self.expected, self.noise, self.rng = expected, noise, random.Random(seed)

    def propose(self, token_ids, k):
        prompt_len, out = self.expected[token_ids[10]]
        truth = out[len(token_ids) - prompt_len:][:k]
        return [self.rng.randrange(200) if self.rng.random() < self.noise else t for t in truth]


@pytest.mark.parametrize("seed", [0, 2])
def test_random_schedules_with_preemption_chunks_and_shared_prefixes_stay_exact_and_leak_nothing(tiny_dt, seed):
    """A small pool (preemptions), a small token budget (chunks), shared prefixes (cache hits), staggered
    arrivals: greedy output with guesses equals the same engine's without, and the pool holds after every step."""
    tok = tiny_tokenizer(tiny_dt.cfg.vocab_size)
    rng = random.Random(seed)
    shared = [rng.randrange(1, 200) for _ in range(10)]
    arrivals = [(rng.randrange(6), shared + [i + 1] + [rng.randrange(1, 200) for _ in range(rng.randrange(1, 12))],
                 SamplingParams(temperature=0, max_tokens=rng.randrange(4, 30), ignore_eos=True)) for i in range(8)]
    config = dict(block_size=4, num_blocks=24, scheduler=SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=24))
    plain = Engine(tiny_dt, tok, EngineConfig(**config))
    expected = {a[1][10]: (len(a[1]), plain.request(rid).output_token_ids)
                for a, rid in zip(sorted(arrivals, key=lambda a: a[0]), _run(plain, arrivals))}
    spec = Engine(tiny_dt, tok, EngineConfig(**config, speculative=ngram(4)))
    spec.runner.proposer = NoisyOracle(expected, noise=0.3, seed=seed)
    ids = _run(spec, arrivals)
    for a, rid in zip(sorted(arrivals, key=lambda a: a[0]), ids):
        assert spec.request(rid).output_token_ids == expected[a[1][10]][1]
    stats = spec.runner.spec_stats
    assert 0 < stats.accepted < stats.proposed, stats
    assert spec.stats().preemptions > 0 and spec.stats().prefix_cache.hit_tokens > 0  # these seeds do both
    assert spec.stats().steps < plain.stats().steps
