"""Text <-> token ids, through the ``tokenizers`` library, plus the model's chat template."""
from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

# Byte-level BPE pre-tokenizer splits, by llama.cpp's names (``tokenizer.ggml.pre``); GPT-2's is built into ByteLevel
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in ("gpt2", "default"):
        return byte_level
    if pre == "smollm":  # every digit on its own, then the GPT-2 rule
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in ("qwen2", "llama-bpe"):
        split = pre_tokenizers.Split(Regex(_QWEN2_SPLIT if pre == "qwen2" else _LLAMA3_SPLIT), behavior="isolated")
        return pre_tokenizers.Sequence([split, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    raise ValueError(f"unsupported GGUF pre-tokenizer {pre!r}; supported: gpt2, smollm, qwen2, llama-bpe. "
                     "Load the model's safetensors checkpoint with its tokenizer.json instead.")


def _check_messages(messages: object) -> None:
    """Refuse a malformed chat before rendering: a template would render it silently, or fail obscurely."""
    example = "[{'role': 'user', 'content': 'Hello'}]"
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError(f"a chat needs a non-empty list of messages, got {messages!r}: pass e.g. {example}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ValueError(f"message {i} must be a dict with 'role' and 'content', got {m!r}: pass e.g. {example}")
        for key in ("role", "content"):
            if not isinstance(m.get(key), str):
                raise ValueError(f"message {i} needs a string {key!r}, got {m.get(key)!r} in {m!r}: "
                                 f"pass e.g. {example}")


class Tokenizer:
    """A ``tokenizers.Tokenizer`` with the special ids and chat template the engine needs."""

    def __init__(self, backend: HFTokenizer, *, eos_token_id: int, bos_token_id: int | None = None,
                 chat_template: str | None = None, add_bos: bool = False) -> None:
        self.backend = backend
        self.eos_token_id = eos_token_id
        self.bos_token_id = bos_token_id
        self.chat_template = chat_template
        self.add_bos = add_bos

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        # encode_batch, unlike encode, releases the GIL: a long prompt tokenized in a server thread stalls nothing else
        ids = self.backend.encode_batch([text], add_special_tokens=False)[0].ids
        return [self.bos_token_id, *ids] if self.add_bos and self.bos_token_id is not None else ids

    @functools.cached_property
    def max_token_bytes(self) -> int:
        """The most UTF-8 bytes one token stands for: a text of ``b`` bytes is at least ``b / max_token_bytes``
        tokens, which refuses a prompt far past the context before any tokenizing."""
        return max(len(self.backend.decode([i]).encode("utf-8")) for i in range(self.vocab_size))

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token(self, token_id: int) -> str:
        """One token as text (byte-level BPE pieces decoded), for tables and plots."""
        return self.decode([token_id])

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """Render ``[{"role": ..., "content": ...}, ...]`` with the model's own Jinja template."""
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat template; pass plain prompts instead")
        _check_messages(messages)
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

        def raise_exception(message: str) -> None:
            raise ValueError(f"chat template: {message}")
        env.globals["raise_exception"] = raise_exception
        special = lambda i: None if i is None else self.backend.id_to_token(i)  # noqa: E731
        return env.from_string(self.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt,
            bos_token=special(self.bos_token_id) or "", eos_token=special(self.eos_token_id) or "")

    @classmethod
    def from_gguf_metadata(cls, meta: dict) -> "Tokenizer":
        """Rebuild a byte-level BPE tokenizer from the vocabulary stored in a GGUF file."""
        kind = meta.get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise ValueError(f"unsupported GGUF tokenizer {kind!r}: only byte-level BPE ('gpt2') is read. "
                             "Load the model's safetensors checkpoint with its tokenizer.json instead.")
        tokens = meta["tokenizer.ggml.tokens"]
        merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
        backend = HFTokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges))
        backend.pre_tokenizer = _pre_tokenizer(meta.get("tokenizer.ggml.pre", "default"))
        backend.decoder = decoders.ByteLevel()
        types = meta.get("tokenizer.ggml.token_type", [])
        control, user = 3, 4  # llama.cpp token types
        backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                    for t, k in zip(tokens, types) if k == control])
        backend.add_tokens([AddedToken(t, normalized=False) for t, k in zip(tokens, types) if k == user])
        return cls(backend, eos_token_id=meta["tokenizer.ggml.eos_token_id"],
                   bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
                   chat_template=meta.get("tokenizer.chat_template"),
                   add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", False)))

    @classmethod
    def from_directory(cls, path: str | Path, eos_token_id: int | None = None) -> "Tokenizer":
        """Load ``tokenizer.json`` (and ``tokenizer_config.json`` for the template) from a checkpoint."""
        path = Path(path)
        if not (path / "tokenizer.json").exists():
            raise FileNotFoundError(f"{path} has no tokenizer.json; a Hugging Face checkpoint needs one")
        backend = HFTokenizer.from_file(str(path / "tokenizer.json"))
        config_file = path / "tokenizer_config.json"
        config = json.loads(config_file.read_text()) if config_file.exists() else {}

        def token_id(name: str) -> int | None:
            tok = config.get(name)
            tok = tok.get("content") if isinstance(tok, dict) else tok
            return backend.token_to_id(tok) if tok else None
        eos = eos_token_id if eos_token_id is not None else token_id("eos_token")
        if eos is None:
            raise ValueError(f"cannot tell the end-of-sequence token of {path}: set eos_token in tokenizer_config.json")
        return cls(backend, eos_token_id=eos, bos_token_id=token_id("bos_token"),
                   chat_template=config.get("chat_template"), add_bos=bool(config.get("add_bos_token", False)))


@dataclass
class IncrementalDetokenizer:
    """A growing token list's text, decoding a small window per new token (decoding it all each step is O(n^2) per
    request). As in vLLM, text up to ``read_offset`` is final; each step decodes ``ids[prefix_offset:]`` and
    ``ids[prefix_offset:read_offset]`` and keeps what the first adds (the tokens before are context: a SentencePiece
    decoder drops a text's leading space). A window ending in a partial character (U+FFFD) waits for the next token."""
    tokenizer: Tokenizer
    skip_special_tokens: bool = True
    text: str = ""
    prefix_offset: int = 0
    read_offset: int = 0

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def step(self, ids: list[int]) -> str:
        """Bring ``text`` up to date with ``ids`` (the same list, grown); return the new characters."""
        prefix = self._decode(ids[self.prefix_offset:self.read_offset])
        window = self._decode(ids[self.prefix_offset:])
        if len(window) <= len(prefix) or window.endswith("\ufffd"):
            return ""
        new = window[len(prefix):]
        self.text += new
        self.prefix_offset, self.read_offset = self.read_offset, len(ids)
        return new

    def flush(self, ids: list[int]) -> str:
        """At the end: add whatever is still held back (a trailing partial character decodes as U+FFFD)."""
        new = self._decode(ids[self.prefix_offset:])[len(self._decode(ids[self.prefix_offset:self.read_offset])):]
        self.text += new
        self.prefix_offset = self.read_offset = len(ids)
        return new
