"""From a prompt to what the engine queues: tokenized and checked against the model, once. A server checks in its
own process, where a refusal is a 400 before the engine is touched; :class:`Engine` checks whatever else it is given."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from enginelib.config import SamplingParams, as_token_ids, check_request

if TYPE_CHECKING:
    from enginelib.model.tokenizer import Tokenizer


@dataclass(frozen=True)
class CheckedPrompt:
    """A prompt's token ids with its params, checked against the model by :func:`check_prompt`: the engine queues it
    as it is."""

    token_ids: list[int]
    params: SamplingParams
    text: str | None = None  # the prompt as given, when it was text


def check_prompt(prompt: str | list[int], params: SamplingParams, tokenizer: Tokenizer, vocab_size: int,
                 context_length: int) -> CheckedPrompt:
    """The prompt tokenized and checked against the model (length, vocabulary) and ``params``: ``ValueError`` for
    what the engine cannot run, with what to change."""
    text = prompt if isinstance(prompt, str) else None
    if text is not None and isinstance(params, SamplingParams):
        refuse_long_text(text, params.max_tokens, tokenizer, context_length)
    ids = tokenizer.encode(text) if text is not None else as_token_ids(prompt)
    check_request(ids, params, vocab_size, context_length)
    return CheckedPrompt(ids, params, text)


def refuse_long_text(text: str, max_tokens: int, tokenizer: Tokenizer, context_length: int) -> None:
    """``ValueError`` for a text that cannot fit the context whatever its tokens: each token stands for at most
    ``tokenizer.max_token_bytes`` bytes, so this costs a length, not a tokenization."""
    fewest = -(-len(text.encode("utf-8", "surrogatepass")) // tokenizer.max_token_bytes)
    if fewest + max_tokens > context_length:
        raise ValueError(f"prompt (at least {fewest} tokens) + max_tokens ({max_tokens}) exceeds the model's "
                         f"context of {context_length} tokens: shorten the prompt or lower max_tokens")
