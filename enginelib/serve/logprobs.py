"""Log-probabilities in the shapes clients parse: OpenAI's chat and legacy completions objects, and vLLM's
``prompt_logprobs``. The legacy shape is what lm-eval-harness reads for loglikelihood tasks (``echo: true``): a
prompt's first token has no logprob, so its ``token_logprobs`` and ``top_logprobs`` entries are ``null``."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from enginelib.core.outputs import TokenLogprob

LOGPROB_FLOOR = -9999.0  # a logprob of -inf is not JSON: reported as this (as vLLM does)


def _floor(logprob: float) -> float:
    return max(logprob, LOGPROB_FLOOR)


def chat_logprobs(tokenizer: Any, items: Sequence[TokenLogprob]) -> dict:
    """Chat's ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}``, the top list being the
    ``top_logprobs`` most likely tokens."""
    def entry(token_id: int, logprob: float) -> dict:
        text = tokenizer.token(token_id)
        return {"token": text, "logprob": _floor(logprob), "bytes": list(text.encode("utf-8"))}
    return {"content": [entry(it.token_id, it.logprob) | {"top_logprobs": [entry(t, lp) for t, lp in it.top]}
                        for it in items]}


def legacy_logprobs(tokenizer: Any, ids: Sequence[int], items: Sequence[TokenLogprob | None],
                    offset: int = 0) -> tuple[dict, int]:
    """Completions' ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`` of tokens ``ids`` (an item of
    None: a token with no logprob, the prompt's first), and the text offset after them. Each top dict holds the
    ``logprobs`` most likely tokens and the token itself (as vLLM gives them): lm-eval calls a continuation greedy
    when every token's logprob is its dict's largest."""
    texts, values, tops, offsets = [], [], [], []
    for token_id, it in zip(ids, items, strict=True):
        text = tokenizer.token(token_id)
        top = None
        if it is not None:
            top = {tokenizer.token(t): _floor(lp) for t, lp in it.top}
            top.setdefault(text, _floor(it.logprob))
        texts.append(text)
        values.append(None if it is None else _floor(it.logprob))
        tops.append(top)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": texts, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}, offset


def joined(first: dict | None, then: dict) -> dict:
    """Two legacy logprobs objects, one after the other (an echoed prompt's, then the completion's)."""
    return then if first is None else {key: first[key] + then[key] for key in then}


def vllm_prompt_logprobs(tokenizer: Any, items: Sequence[TokenLogprob | None]) -> list[dict | None]:
    """vLLM's ``prompt_logprobs``: per prompt token None (the first) or ``{token id: {"logprob", "rank",
    "decoded_token"}}``, the token itself first, then the ``prompt_logprobs`` most likely ones."""
    out: list[dict | None] = []
    for it in items:
        if it is None:
            out.append(None)
            continue
        entry = {str(it.token_id): {"logprob": _floor(it.logprob), "rank": it.rank,
                                    "decoded_token": tokenizer.token(it.token_id)}}
        for rank, (token_id, logprob) in enumerate(it.top, 1):
            entry.setdefault(str(token_id), {"logprob": _floor(logprob), "rank": rank,
                                             "decoded_token": tokenizer.token(token_id)})
        out.append(entry)
    return out
