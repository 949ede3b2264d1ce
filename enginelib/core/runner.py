"""The model runner: turns one scheduled step into tokens, owning all of it that touches tensors (paged KV cache, batch,
forward pass, sampling, verifying guesses). The speed code a config asks for comes in through one factory, the
runner's ``speed_factory``, which the package's ``__init__`` sets: the core imports nothing of :mod:`enginelib.speed`,
and a plain engine loads none of it."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from enginelib.config import EngineConfig, SamplingParams
from enginelib.core.outputs import TokenLogprob
from enginelib.core.paged_cache import PagedKVCache
from enginelib.core.request import Request
from enginelib.core.scheduler import ScheduledWork, SchedulerOutput
from enginelib.model.device import greedy, record_function
from enginelib.model.logits_processors import apply_history
from enginelib.model.sampling import make_generator, sample, token_logprobs
from enginelib.model.transformer import Transformer
from enginelib.step.batch import Batch, HostBuffer, SequenceWork, to_device
from enginelib.step.parts import SpeedFactory, SpeedParts

if TYPE_CHECKING:
    from enginelib.model.structured import StructuredOutputManager


@dataclass
class SpecStats:
    """Counters over every verification (a request's step that carried at least one guess)."""
    verifications: int = 0
    proposed: int = 0  # guesses verified
    accepted: int = 0  # of them, agreed with by the target (a stop inside the run may still drop some)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Guesses kept per verification; each verification also emits one token of the target's own."""
        return self.accepted / self.verifications if self.verifications else 0.0

    def record(self, proposed: int, accepted: int) -> None:
        self.verifications += 1
        self.proposed += proposed
        self.accepted += accepted


class ModelRunner:
    """The paged cache and the model, run one scheduled step at a time."""

    # builds the speed parts a config asks for: enginelib.speed's factory, which the package's __init__ (above both)
    # sets here, so that the core imports none of the speed code
    speed_factory: SpeedFactory | None = None

    def __init__(self, model: Transformer, config: EngineConfig, num_blocks: int, eos: int | None = None,
                 structured: StructuredOutputManager | None = None) -> None:
        self.model, self.config, self.eos = model, config, eos  # EOS: what min_tokens holds back
        self.structured = structured  # the grammars of requests with a structured_output: their token masks
        self.cache = PagedKVCache(model.cfg, num_blocks, config.block_size, device=model.device, dtype=model.dtype)
        self.host = HostBuffer() if model.device.type == "cpu" else None  # each step's batch, on a CPU
        asks = any((config.cpu_decode_kernel, config.fused_step, config.speculative, config.compile))  # any part
        self.speed = self.speed_factory(model, config, self.cache) if asks else SpeedParts()
        self.cache.decode_kernel = self.speed.decode_kernel
        self.proposer = self.speed.proposer  # a chapter or a test may swap in its own
        self.spec_stats = SpecStats()  # proposed / accepted guesses (all zero without speculation)
        self.compiled, self.compile_report = self.speed.compiled, self.speed.compile_report
        self._generators: dict[str, torch.Generator | None] = {}

    def add(self, request_id: str, params: SamplingParams) -> None:
        """A request's own random stream (None: greedy, or torch's global one when it has no seed)."""
        self._generators[request_id] = make_generator(params.seed, self.model.device)

    def release(self, request_id: str) -> None:
        self._generators.pop(request_id, None)

    def propose(self, running: list[Request]) -> tuple[dict[str, list[int]], list[tuple[Request, Exception]]]:
        """Guesses for every running request that decodes next step, at most k and never past its max_tokens; and the
        requests whose proposal failed, with the error: such a request fails alone."""
        k, vocab = self.config.speculative.num_speculative_tokens, self.model.cfg.vocab_size
        drafts, failed = {}, []
        for request in running:
            n = min(k, request.params.max_tokens - len(request.output_token_ids) - 1)
            decodes = (request.num_uncomputed_tokens == 1
                       and request.num_computed_tokens >= len(request.prompt_token_ids))
            # penalties change with each token of a run; a grammar's mask too (its requests decode unguessed)
            if n < 1 or not decodes or request.params.uses_history or request.params.structured_output is not None:
                continue
            try:  # one request's proposal (a draft model's step, a bad guess): it fails alone, the step goes on
                guesses = list(self.proposer.propose(request.all_token_ids, n))[:n]
                if any(not 0 <= t < vocab for t in guesses):
                    raise ValueError(f"the proposer guessed token ids outside the vocabulary (0..{vocab - 1}): "
                                     f"{guesses}")
            except Exception as error:  # noqa: BLE001 - the request fails with it, the others go on
                failed.append((request, error))
                continue
            if guesses:
                drafts[request.request_id] = guesses
        return drafts, failed

    def execute(self, plan: SchedulerOutput) -> tuple[list[int | list[int]], list[tuple[Request, Exception]]]:
        """The step's tokens (one per work that ``samples``, a verified run per work with guesses) and the requests
        whose own sampling failed, with the error: they fail alone (placeholder tokens). A failed step raises."""
        with record_function("prepare"):
            seqs = [SequenceWork(w.request.token_slice(w.start, w.start + w.num_tokens - len(w.draft_token_ids))
                                 + w.draft_token_ids, w.start, w.request.block_table, w.samples, len(w.draft_token_ids),
                                 prompt_rows(w))
                    for w in plan.scheduled]
            batch = Batch.build(seqs, self.cache.block_size, self.model.device, self.host)
        with record_function("forward"):  # a step of prefill chunks only has no rows of logits
            if self.compiled is not None and not batch.num_prompt_rows and self.compiled.serves(batch):
                logits = self.compiled(batch, self.cache)
            else:
                logits = self.model(batch.token_ids, self.cache.bind(batch), positions=batch.positions,
                                    logits_indices=batch.logits_indices)
        logits, argmax = logits if isinstance(logits, tuple) else (logits, None)  # fused_step: each row's argmax too
        if batch.num_prompt_rows:  # the rows after the sampled ones: prompt logprobs (none in most steps)
            with record_function("prompt_logprobs"):
                logits, extra = logits[:-batch.num_prompt_rows], logits[-batch.num_prompt_rows:]
                self._prompt_logprobs(plan.scheduled, seqs, extra)
        with record_function("sample"):  # every row on the device (argmax, or its own generator), one sync a step
            tokens = greedy(logits) if argmax is None else argmax
            sampling = [w for w in plan.scheduled if w.samples]
            rows, verdicts, failed = self._sample(sampling, logits, tokens)
            self._logprobs(sampling, rows, logits, tokens)
            if not any(w.draft_token_ids for w in sampling):
                return tokens.tolist(), failed
            runs = self._verify(sampling, tokens, rows, verdicts, failed)
            self._run_logprobs(sampling, rows, logits, runs)
            return runs, failed

    def _sample(self, sampling: list[ScheduledWork], logits: torch.Tensor, tokens: torch.Tensor):
        """Sample each non-greedy or penalised work with its request's generator: its token into ``tokens``, or a
        verdict [accepted, token] for a work with guesses. Returns each work's first row, the verdicts, the failed."""
        rows, verdicts, failed = [], [], []
        row = 0
        for work in sampling:
            request, n = work.request, 1 + len(work.draft_token_ids)
            rows.append(row)
            structured = request.params.structured_output is not None
            if not request.params.greedy or request.params.uses_history or structured:
                try:  # one request's own failure (e.g. NaN probabilities in its row): it fails alone
                    generator = self._generators[request.request_id]
                    if work.draft_token_ids:
                        verdicts.append(self.speed.rejection_sample(logits[row:row + n], work.draft_token_ids,
                                                                    request.params, generator))
                    else:
                        own = logits[row:row + 1]
                        if request.params.uses_history:  # penalties, min_tokens: on a copy (logprobs stay the model's)
                            own = apply_history(own.clone(), request.params, request.prompt_token_ids,
                                                request.output_token_ids, self.eos)
                        if structured:  # what its grammar cannot take next: -inf, on a copy too
                            own = self.structured.mask(own if request.params.uses_history else own.clone(),
                                                       request.request_id, request.output_token_ids)
                        tokens[row:row + 1] = sample(own, request.params, generator)
                except Exception as error:  # noqa: BLE001 - the request fails with it, the step goes on
                    failed.append((request, error))
            row += n
        return rows, verdicts, failed

    @staticmethod
    def _logprobs(sampling: list[ScheduledWork], rows: list[int], logits: torch.Tensor, tokens: torch.Tensor) -> None:
        """Log-probabilities of each sampled token, for the requests that ask (runs: ``_run_logprobs``)."""
        wanted = [(w.request, row) for w, row in zip(sampling, rows)
                  if w.request.params.logprobs is not None and not w.draft_token_ids]
        if not wanted:
            return
        index = to_device([row for _, row in wanted], logits.device)
        num_top = max(request.params.logprobs for request, _ in wanted)
        for (request, _), (token, logprob, top, rank) in zip(wanted, token_logprobs(logits[index], tokens[index],
                                                                                     num_top)):
            request.output_logprobs.append(TokenLogprob(token, logprob, top[:request.params.logprobs], rank))

    @staticmethod
    def _prompt_logprobs(works: list[ScheduledWork], seqs: list[SequenceWork], logits: torch.Tensor) -> None:
        """Each prompt token's logprob from the row before it (``prompt_rows``), appended to its request's."""
        wanted = [(w.request, w.start + r + 1) for w, s in zip(works, seqs) for r in s.prompt_rows]
        targets = to_device([request.prompt_token_ids[t] for request, t in wanted], logits.device)
        num_top = max(request.params.prompt_logprobs for request, _ in wanted)
        for (request, _), (token, logprob, top, rank) in zip(wanted, token_logprobs(logits, targets, num_top)):
            request.prompt_logprobs.append(TokenLogprob(token, logprob, top[:request.params.prompt_logprobs], rank))

    @staticmethod
    def _run_logprobs(sampling: list[ScheduledWork], rows: list[int], logits: torch.Tensor,
                      runs: list[int | list[int]]) -> None:
        """A verified run's log-probabilities: token j of the run at row ``first + j``. The run is known only
        after the step's transfer, so this takes a second one, in steps where a request with guesses asks."""
        wanted = [(w.request, first, run) for w, first, run in zip(sampling, rows, runs)
                  if w.draft_token_ids and w.request.params.logprobs is not None and isinstance(run, list)]
        if not wanted:
            return
        index = to_device([first + j for _, first, run in wanted for j in range(len(run))], logits.device)
        tokens = to_device([t for *_, run in wanted for t in run], logits.device)
        found = iter(token_logprobs(logits[index], tokens, max(request.params.logprobs for request, *_ in wanted)))
        for request, _, run in wanted:
            for _ in run:
                token, logprob, top, rank = next(found)
                request.output_logprobs.append(TokenLogprob(token, logprob, top[:request.params.logprobs], rank))

    def _verify(self, sampling: list[ScheduledWork], tokens: torch.Tensor, rows: list[int],
                verdicts: list[torch.Tensor], failed: list[tuple[Request, Exception]]) -> list[int | list[int]]:
        """Each work's verified run, from one transfer to the host; a request in ``failed`` gets a placeholder."""
        row = len(tokens)  # the verdicts follow the tokens on the host
        host = torch.cat([tokens, *verdicts]).tolist()
        sampled = iter(zip(host[row::2], host[row + 1::2]))
        gone = {request.request_id for request, _ in failed}
        out: list[int | list[int]] = []
        for work, first in zip(sampling, rows):
            guesses = work.draft_token_ids
            if not guesses or work.request.request_id in gone:
                out.append(host[first])
                continue
            if work.request.params.greedy:
                run = self.speed.accept_greedy(guesses, host[first:first + len(guesses) + 1])
            else:
                kept, token = next(sampled)
                run = guesses[:kept] + [token]
            self.spec_stats.record(len(guesses), len(run) - 1)
            out.append(run)
        return out


def prompt_rows(work: ScheduledWork) -> tuple[int, ...]:
    """The rows of ``work``'s tokens whose logits give prompt logprobs it still needs: the row at position p
    scores prompt token p + 1. Empty for a request that does not ask (every step of most batches)."""
    request = work.request
    if not request.needs_prompt_logprobs or work.draft_token_ids:
        return ()
    first = len(request.prompt_logprobs) + 1  # the next prompt token owed (token 0 has no logprob)
    if first < work.start + 1:
        raise RuntimeError(f"request {request.request_id}: prompt tokens {first}..{work.start} were not computed "
                           "here (a prefix-cache hit on a request wanting prompt logprobs)")
    last = min(len(request.prompt_token_ids) - 1, work.start + work.num_tokens)
    return tuple(range(first - 1 - work.start, last - work.start))
