"""The model runner: turns one scheduled step into tokens, owning all of it that touches tensors (paged KV cache, batch,
forward pass, sampling, verifying guesses). The only core module that reaches into :mod:`enginelib.speed`, it imports
that lazily, when a config asks: a plain engine loads none of it."""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Callable

import torch
from torch.profiler import record_function

from enginelib.config import EngineConfig, SamplingParams
from enginelib.core.batch import Batch, SequenceWork, to_device
from enginelib.core.outputs import TokenLogprob
from enginelib.core.paged_cache import PagedKVCache
from enginelib.core.request import Request
from enginelib.core.scheduler import ScheduledWork, SchedulerOutput
from enginelib.model.logits_processors import apply_history
from enginelib.model.sampling import make_generator, sample, token_logprobs
from enginelib.model.transformer import Transformer


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

    def __init__(self, model: Transformer, config: EngineConfig, num_blocks: int, eos: int | None = None) -> None:
        self.model, self.config, self.eos = model, config, eos  # EOS: what min_tokens holds back
        decode_kernel = decode_attention_kernel(model.device, model.dtype) if config.cpu_decode_kernel else None
        self.cache = PagedKVCache(model.cfg, num_blocks, config.block_size, device=model.device, dtype=model.dtype,
                                  decode_kernel=decode_kernel)
        self.proposer = None
        if config.speculative is not None:
            from enginelib.speed.speculative import make_proposer
            self.proposer = make_proposer(config.speculative, model, config.scheduler.max_num_seqs)
        self.spec_stats = SpecStats()  # proposed / accepted guesses (all zero without speculation)
        self.compiled, self.compile_report = None, None
        if config.compile is not None:
            self.compiled, self.compile_report = self._compile()
        self._generators: dict[str, torch.Generator | None] = {}

    def _compile(self):
        """Build the compiled decode step for every bucket now, or say why the engine stays eager."""
        from enginelib.speed import compiled
        config = self.config.compile
        reason = compiled.compile_unavailable(self.model.device)
        if reason and config.fallback:
            compiled.fell_back_to_eager(config, reason)  # recorded (speed.paths); raises under ENGINELIB_STRICT_PATHS=1
            warnings.warn(f"{reason}; the engine runs eagerly", RuntimeWarning, stacklevel=4)
            return None, None
        decoder = compiled.CompiledDecoder(self.model, config)  # raises ValueError with the reason if it cannot
        try:
            return decoder, decoder.compile(self.cache)
        except torch._dynamo.exc.BackendCompilerFailed as e:  # e.g. the C++ compiler rejected inductor's code
            inner = e.inner_exception
            message = f"torch.compile failed: {type(inner).__name__}: {str(inner).strip()[:300]}"
            if not config.fallback:
                raise ValueError(f"{message} (CompileConfig(fallback=True) runs eagerly instead)") from e
            warnings.warn(f"{message}; the engine runs eagerly", RuntimeWarning, stacklevel=4)
            return None, None

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
            if n < 1 or not decodes or request.params.uses_history:  # penalties change with each token of a run
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
            batch = Batch.build(seqs, self.cache.block_size, self.model.device)
        with record_function("forward"):  # a step of prefill chunks only has no rows of logits
            if self.compiled is not None and not batch.num_prompt_rows and self.compiled.serves(batch):
                logits = self.compiled(batch, self.cache)
            else:
                logits = self.model(batch.token_ids, self.cache.bind(batch), positions=batch.positions,
                                    logits_indices=batch.logits_indices)
        if batch.num_prompt_rows:  # the rows after the sampled ones: prompt logprobs (none in most steps)
            with record_function("prompt_logprobs"):
                logits, extra = logits[:-batch.num_prompt_rows], logits[-batch.num_prompt_rows:]
                self._prompt_logprobs(plan.scheduled, seqs, extra)
        with record_function("sample"):
            # every row is sampled on the device (argmax, or its own generator), then one transfer: one sync a step
            tokens = logits.argmax(dim=-1)
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
            if not request.params.greedy or request.params.uses_history:
                try:  # one request's own failure (e.g. NaN probabilities in its row): it fails alone
                    generator = self._generators[request.request_id]
                    if work.draft_token_ids:
                        from enginelib.speed.speculative import rejection_sample
                        verdicts.append(rejection_sample(logits[row:row + n], work.draft_token_ids, request.params,
                                                         generator))
                    else:
                        own = logits[row:row + 1]
                        if request.params.uses_history:  # penalties, min_tokens: on a copy (logprobs stay the model's)
                            own = apply_history(own.clone(), request.params, request.prompt_token_ids,
                                                request.output_token_ids, self.eos)
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
        from enginelib.speed.speculative import accept_greedy
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
                run = accept_greedy(guesses, host[first:first + len(guesses) + 1])
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


def decode_attention_kernel(device: torch.device | str, dtype: torch.dtype) -> Callable[..., torch.Tensor]:
    """The fused decode attention for ``EngineConfig(cpu_decode_kernel=True)``, picked here only: our C++ kernel on a
    float32 CPU (built now, so a failed build raises before the first step), Triton's on a CUDA GPU (bfloat16 from
    compute capability 8.0). It writes the step's K/V and returns the attention; elsewhere: ValueError."""
    kind = torch.device(device).type
    if kind == "cpu":
        from enginelib.speed import cpu_kernels
        reason = cpu_kernels.unavailable(device, dtype)
        if reason is None:
            cpu_kernels.load()
            return torch.ops.enginelib.decode_attention
    elif kind == "cuda":
        from enginelib.speed import triton_kernels
        reason = triton_kernels.unavailable(device, dtype)
        if reason is None:
            return triton_kernels.decode_attention
    else:
        reason = f"the fused decode attention runs on a CPU (C++) or a CUDA GPU (Triton), not {kind}"
    raise ValueError(f"cpu_decode_kernel cannot be used here: {reason}")
