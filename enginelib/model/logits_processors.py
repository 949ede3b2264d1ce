"""Logits edits that read a request's tokens so far, before temperature and the filters (as vLLM's sampler applies
them): ``min_tokens`` and the repetition, presence and frequency penalties. The runner calls :func:`apply_history` only
for a request that sets one (``SamplingParams.uses_history``), on a copy of its row: a default request's logits, and
every request's logprobs, stay the model's own. Structured output's token masks are :mod:`.structured`'s (each request
keeps a grammar's state), applied the same way."""
from __future__ import annotations

import torch

from enginelib.config import SamplingParams
from enginelib.model.device import to_device


def apply_history(logits: torch.Tensor, params: SamplingParams, prompt_ids: list[int], output_ids: list[int],
                  eos_token_id: int | None) -> torch.Tensor:
    """A request's logits row [1, V] (or [V]) edited in place by its tokens so far, with vLLM's semantics (the one
    function the engine's runner and Part I's generators share, so a penalised request means the same in both):

    - fewer outputs than ``min_tokens``: EOS and the ``stop_token_ids`` are masked out (-inf), so it cannot stop;
    - ``repetition_penalty`` r: each token of the prompt or the output has its logit divided by r if positive and
      multiplied by r if negative (r > 1 makes every seen token less likely, whatever its sign);
    - ``presence_penalty`` p and ``frequency_penalty`` f: a token the output holds c times loses ``p + f * c`` from
      its logit (the prompt does not count: OpenAI's definition).
    """
    row = logits.view(-1)
    if len(output_ids) < params.min_tokens:
        stops = [t for t in [eos_token_id, *params.stop_token_ids] if t is not None and 0 <= t < len(row)]
        row[to_device(stops, row.device)] = float("-inf")  # indices copied without blocking: no host sync
    if params.repetition_penalty != 1:
        seen = to_device(sorted(set(prompt_ids) | set(output_ids)), row.device)
        values, penalty = row[seen], params.repetition_penalty
        row[seen] = torch.where(values > 0, values / penalty, values * penalty)
    if output_ids and (params.presence_penalty or params.frequency_penalty):
        ids = to_device(output_ids, row.device)  # a scatter, not bincount: its length does not depend on the data
        counts = torch.zeros_like(row).scatter_add_(0, ids, torch.ones_like(ids, dtype=row.dtype))
        row -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0)
    return logits
