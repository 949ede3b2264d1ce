"""Speculative decoding: guess k tokens cheaply, let the target model check them all in one step.

A decode step reads every weight to produce one token, so it is bound by
memory, not arithmetic: the same step could score several tokens for about the
same cost. A *proposer* guesses the next k tokens; the engine feeds the last
verified token and the k guesses to the target in one forward pass over the
paged cache and gets logits at all k + 1 positions. *Verification* keeps the
guesses while the target agrees and adds one token of its own (a correction,
or a bonus when all k were right), so a step emits between 1 and k + 1 tokens
and the output is the target's (greedy: token for token; sampled: in
distribution, by the rejection rule of Leviathan et al. 2023 and Chen et al. 2023).

Proposers here are per request (``propose(token_ids, k)``): the n-gram one is a
cheap Python search; the draft model keeps a KV cache per sequence, rolls it
back with the target, and can run its one-token steps through a compiled graph.
A batched draft (one draft forward for the whole batch, over a paged cache of its
own, as vLLM does) is the next step for throughput at large batch, not for
correctness.
"""
from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from enginelib.baselines.kv_cache import ContiguousKVCache
from enginelib.config import CompileConfig, SamplingParams, SpeculativeConfig
from enginelib.model.sampling import filter_logits
from enginelib.model.transformer import Transformer
from enginelib.speed import cpu_kernels
from enginelib.speed.compiled import CompiledDecoder, compile_unavailable
from enginelib.step.batch import Batch, SequenceWork, to_device


class Proposer(Protocol):
    """Guesses the tokens that follow ``token_ids`` (prompt + output so far): at most ``k``, maybe none."""

    def propose(self, token_ids: Sequence[int], k: int) -> list[int]: ...


@dataclass(frozen=True)
class NgramProposer:
    """Prompt lookup: find the sequence's last n tokens earlier in it and propose what followed them there.

    Tries n from ``max_n`` down to ``min_n`` and takes the most recent earlier
    match. It costs no model at all and pays off when the output repeats the
    prompt or itself (code edits, quoting, lists, summaries).
    """

    max_n: int = 4
    min_n: int = 1

    def propose(self, token_ids: Sequence[int], k: int) -> list[int]:
        ids = list(token_ids)
        end = len(ids)
        for n in range(min(self.max_n, end - 1), self.min_n - 1, -1):
            suffix = ids[end - n:]
            for i in range(end - n - 1, -1, -1):  # latest match first; it must end before the suffix starts
                if ids[i] == suffix[0] and ids[i:i + n] == suffix:
                    return ids[i + n:i + n + k]
        return []


@dataclass
class _DraftSequence:
    """One sequence the draft has seen: the tokens its cache holds, in order (``cache.length`` of them)."""

    tokens: list[int]
    cache: ContiguousKVCache


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share (list comparisons in C, halving the range)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo] and a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


class DraftModelProposer:
    """A smaller model with the target's vocabulary proposes its own greedy continuation.

    The draft keeps a KV cache of its own for each sequence it drafts for, so a
    proposal feeds only the tokens that are new since the last one (the
    target's correction and the accepted guesses) and then ``k - 1`` single
    tokens. Sequences are found by their tokens, not by request id: the cache
    whose tokens share the longest prefix with ``token_ids`` is reused, and
    rolling back rejected guesses is setting its length to that common prefix
    (their K/V are overwritten next time), as the target's rollback frees slots.
    A cache that would lose more than ``k`` tokens belongs to another sequence
    (two chats with the same system prompt): the new sequence gets a cache of its
    own, starting from a copy of the shared prefix. At most ``max_sequences``
    caches are kept, the least recently used dropped first. A greedy draft is a
    deterministic proposer: its q is one-hot, which the rejection rule handles exactly.

    ``compile``: the guesses after the first (one token each) run through one
    compiled graph, the engine's batch-1 decode step (:class:`CompiledDecoder`: on a
    CPU in float32 with our C++ attention, on a GPU with its opaque attention
    operator): a cache's row is seen as a pool of blocks 0, 1, 2, ... (a view,
    nothing copied), so every cache has the same
    size, ``COMPILED_SLOTS`` tokens (a longer sequence grows past it and runs
    eagerly). Compiled once per draft model, when the first proposer is built.
    """

    def __init__(self, draft: Transformer, target_vocab_size: int, max_sequences: int = 8,
                 compile: bool = False) -> None:
        if draft.cfg.vocab_size != target_vocab_size:
            raise ValueError(f"the draft model's vocabulary ({draft.cfg.vocab_size} tokens) differs from the "
                             f"target's ({target_vocab_size}): its token ids would mean other tokens; use a draft "
                             "with the target's tokenizer (e.g. the target itself, quantized)")
        if max_sequences < 1:
            raise ValueError(f"max_sequences must be at least 1 (draft caches kept), got {max_sequences}")
        self.model = draft
        self.max_sequences = max_sequences
        self.sequences: list[_DraftSequence] = []  # least recently used first
        self.fed_tokens = 0  # tokens run through the draft, prefills included: what its caches save shows here
        self.slots = 64  # a new cache's least size
        self.decoder = _compiled_draft(draft) if compile else None
        if self.decoder is not None:
            self.slots = min(COMPILED_SLOTS, draft.cfg.context_length // BLOCK * BLOCK)
            self.table = list(range(self.slots // BLOCK))
            self._step(torch.zeros(1, 1, dtype=torch.long, device=draft.device), self._new_cache(1))  # warm

    def _new_cache(self, tokens: int) -> ContiguousKVCache:
        return _new_cache(self.model, tokens, self.slots)

    def _step(self, token: torch.Tensor, cache: ContiguousKVCache) -> torch.Tensor:
        """Logits [1, vocab] after ``token`` [1, 1]: compiled where the cache is of the compiled size."""
        if self.decoder is None or cache.max_len != self.slots:
            return self.model(token, cache, last_only=True)[:, -1]
        batch = Batch.build([SequenceWork([int(token)], cache.length, self.table)], BLOCK, self.model.device)
        logits = self.decoder(batch, _as_pool(cache))
        cache.advance(1)
        return logits

    @torch.inference_mode()
    def propose(self, token_ids: Sequence[int], k: int) -> list[int]:
        ids = list(token_ids)
        k = min(k, self.model.cfg.context_length - len(ids))
        if k < 1 or not ids:
            return []
        seq = self._sequence_for(ids, k)
        cache = seq.cache = _with_room(seq.cache, len(ids) + k - 1, self.model)
        x = to_device(ids[cache.length:], self.model.device)[None]  # a copy that does not block
        self.fed_tokens += x.shape[1] + k - 1
        guesses = []
        for i in range(k):  # greedy, on the device: one transfer to the host at the end
            logits = self._step(x, cache) if x.shape[1] == 1 else self.model(x, cache, last_only=True)[:, -1]
            token = logits.argmax(dim=-1)
            guesses.append(token)
            x = token[None]
        drafts = torch.cat(guesses).tolist()
        seq.tokens = ids + drafts[:-1]  # the last guess was never fed
        return drafts

    def _sequence_for(self, ids: list[int], k: int) -> _DraftSequence:
        """The cache to extend for ``ids``, rolled back to what it shares with them (never all of ``ids``:
        the last token is fed again, its logits start the guesses)."""
        best, common = None, 0
        for seq in self.sequences:
            c = common_prefix(seq.tokens, ids)
            if c > common:
                best, common = seq, c
        common = min(common, len(ids) - 1)
        if best is not None and len(best.tokens) - common <= k:  # its own rejected guesses: roll back
            self.sequences.remove(best)
            seq = best
        else:  # new, or another sequence's: copy the shared prefix
            cache = self._new_cache(len(ids) + k)
            if best is not None and common:
                cache.k[:, :, :common] = best.cache.k[:, :, :common]
                cache.v[:, :, :common] = best.cache.v[:, :, :common]
            seq = _DraftSequence([], cache)
            if len(self.sequences) >= self.max_sequences:
                self.sequences.pop(0)
        seq.cache.length = common
        self.sequences.append(seq)
        return seq


COMPILED_SLOTS = 1024  # a compiled draft's caches: one size, so one graph (46 KB a token for SmolLM2-135M)
BLOCK = 16  # the block size a compiled draft step sees its cache in


def _new_cache(model: Transformer, tokens: int, least: int = 64) -> ContiguousKVCache:
    """A draft cache with room for ``tokens``: the next power of two (at least ``least``, at most the
    context), so that a growing sequence is copied into a bigger one rarely."""
    slots = min(max(least, 1 << (tokens - 1).bit_length()), model.cfg.context_length)
    return ContiguousKVCache(model.cfg, 1, slots, device=model.device, dtype=model.dtype)


@dataclass
class _Pool:
    """A one-row contiguous cache as the paged pool a compiled step reads: its slots in blocks 0, 1, 2, ..."""

    k: torch.Tensor  # [layers, blocks, BLOCK, KV, D], views of the cache's tensors
    v: torch.Tensor
    block_size: int = BLOCK

    @property
    def num_blocks(self) -> int:
        return self.k.shape[1]


def _as_pool(cache: ContiguousKVCache) -> _Pool:
    layers, _, slots, kv, d = cache.k.shape
    return _Pool(*(t.view(layers, slots // BLOCK, BLOCK, kv, d) for t in (cache.k, cache.v)))


def compile_draft_unavailable(draft: Transformer) -> str | None:
    """Why ``compile_draft`` cannot work for ``draft`` here (None: it can).

    On a CPU the compiled step reads the cache in our C++ attention (float32, with the kernels); on a GPU in the
    engine's opaque ``paged_attend`` operator, as the engine's compiled decode does there, so a GPU compiles the
    draft too rather than the chapter and the benchmark leaving it eager without a word."""
    if torch.device(draft.device).type == "cpu":
        return compile_unavailable(draft.device) or cpu_kernels.unavailable(draft.device, draft.dtype)
    return compile_unavailable(draft.device)


def _compiled_draft(draft: Transformer) -> CompiledDecoder:
    """The draft's batch-1 decode step, compiled once per model: every engine's proposer for that model shares
    it (compiling takes tens of seconds). Remembered beside the model, not set on it; as the decoder holds the
    model, the pair lasts as long as the process, as the model's own attribute did before."""
    decoder = _COMPILED_DRAFTS.get(draft)
    if decoder is None:
        reason = compile_draft_unavailable(draft)
        if reason:
            raise ValueError(f"cannot compile the draft model: {reason}; use compile_draft=False")
        config = CompileConfig(batch_sizes=(1,), cpp_wrapper=True, freeze=True)  # the last two: a CPU's options
        decoder = _COMPILED_DRAFTS[draft] = CompiledDecoder(draft, config, what="compiled draft")
    return decoder


_COMPILED_DRAFTS: weakref.WeakKeyDictionary[Transformer, CompiledDecoder] = weakref.WeakKeyDictionary()


def _with_room(cache: ContiguousKVCache, tokens: int, model: Transformer) -> ContiguousKVCache:
    """``cache``, or a bigger copy of it when ``tokens`` would not fit."""
    if tokens <= cache.max_len:
        return cache
    bigger = _new_cache(model, tokens)
    bigger.k[:, :, :cache.length] = cache.k[:, :, :cache.length]
    bigger.v[:, :, :cache.length] = cache.v[:, :, :cache.length]
    bigger.length = cache.length
    return bigger


def make_proposer(config: SpeculativeConfig, target: Transformer, max_sequences: int = 8) -> Proposer:
    """The config's proposer; a draft model keeps caches for up to ``max_sequences`` sequences (the batch)."""
    if config.method == "ngram":
        return NgramProposer(config.prompt_lookup_max, config.prompt_lookup_min)
    return DraftModelProposer(config.draft_model, target.cfg.vocab_size, max_sequences, config.compile_draft)


def accept_greedy(drafts: Sequence[int], target: Sequence[int]) -> list[int]:
    """Keep guesses while they equal the target's argmax; then add the target's own token.

    ``target`` holds the argmax at each of the ``len(drafts) + 1`` positions.
    """
    a = 0
    while a < len(drafts) and drafts[a] == target[a]:
        a += 1
    return list(drafts[:a]) + [target[a]]


def rejection_sample(logits: torch.Tensor, drafts: Sequence[int], params: SamplingParams,
                     generator: torch.Generator | None = None,
                     draft_probs: torch.Tensor | None = None) -> torch.Tensor:
    """Verify guesses by sampling: returns [accepted count, next token] as a tensor on the logits' device.

    logits: [k + 1, V] the target's at the guesses' positions (and one past);
    ``draft_probs`` [k, V] the proposer's q (None: a deterministic proposer,
    q one-hot). Guess x_i is kept with probability min(1, p(x_i) / q(x_i));
    at the first rejection the token is drawn from norm(max(0, p - q)),
    after k acceptances from p at the last position. That makes each emitted
    token distributed exactly as p, the target's (filtered) distribution.
    Nothing here waits for the device: the engine brings all results over at once.
    """
    k = len(drafts)
    probs = filter_logits(logits, params).softmax(dim=-1)  # [k + 1, V]: what plain sampling would draw from
    guess = to_device(list(drafts), logits.device)[:, None]  # torch.tensor(..., device) would wait on a GPU
    p = probs[:k].gather(1, guess).squeeze(1)
    if draft_probs is None:
        ratio = p
        residual = probs[:k].scatter(1, guess, 0.0)  # max(0, p - onehot): p without the guess
    else:
        ratio = p / draft_probs.float().gather(1, guess).squeeze(1)
        residual = (probs[:k] - draft_probs.float()).clamp(min=0)
    u = torch.rand(k, generator=generator, device=logits.device)
    accepted = (u < ratio).long().cumprod(0).sum()
    # A residual of all zeros (p == q) is never drawn from, since then the guess is always kept; give
    # multinomial a valid row there. One candidate per position, the accepted count picks which one counts.
    empty = residual.sum(dim=-1, keepdim=True) <= 0
    candidates = torch.cat([torch.where(empty, probs[:k], residual), probs[k:]])
    choice = torch.multinomial(candidates, 1, generator=generator).squeeze(1)
    return torch.stack([accepted, choice.gather(0, accepted[None])[0]])


__all__ = ["Proposer", "NgramProposer", "DraftModelProposer", "common_prefix", "make_proposer", "accept_greedy", "rejection_sample"]
