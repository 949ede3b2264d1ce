"""From a :class:`StructuredOutput` to a compiled grammar over one tokenizer's vocabulary, with llguidance.

Compiling has two costs, both paid once and cached: the tokenizer's vocabulary as llguidance's token trie (about
a second; once per tokenizer) and each spec's grammar (milliseconds; once per distinct spec, so the n samples of a
request, or a thousand requests with one schema, compile it once). A request's matcher is a copy of its spec's
freshly compiled one.
"""
from __future__ import annotations

import json
import threading
import weakref
from collections import OrderedDict

import llguidance

from enginelib.model.tokenizer import Tokenizer
from enginelib.structured_output import StructuredOutput

MAX_CACHED_GRAMMARS = 256
# JSON as a model writes it, and as json.dumps does: ", " and ": ", no other whitespace. Flexible whitespace
# lets a small model pad with new lines until max_tokens; a schema's "x-guidance" options may still ask for it.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def grammar_text(spec: StructuredOutput) -> str:
    """llguidance's grammar for ``spec`` (not yet checked: :meth:`GrammarCompiler.matcher` does that)."""
    if spec.json is not None or spec.json_object:
        schema = spec.json if spec.json is not None else {"type": "object"}
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    if spec.regex is not None:
        return llguidance.LLMatcher.grammar_from_regex(spec.regex)
    if spec.choice is not None:  # each choice a JSON-quoted literal, which Lark's strings are
        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c, ensure_ascii=False)
                                                                           for c in spec.choice))
    return llguidance.grammar_from("grammar", spec.grammar)  # Lark, or GBNF converted to Lark


class GrammarCompiler:
    """One tokenizer's llguidance vocabulary and the grammars compiled over it (the last
    :data:`MAX_CACHED_GRAMMARS` specs), shared by every engine on that tokenizer: see :func:`compiler_for`."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        # The tokenizer's own JSON (vocabulary, merges, pre-tokenizer, added tokens): llguidance reads it with the
        # same Rust `tokenizers` library; ``vocab_size`` is the logits' width, which may pass the tokenizer's.
        self.tokenizer = llguidance.LLTokenizer(tokenizer.backend.to_str(), n_vocab=vocab_size,
                                                eos_token=tokenizer.eos_token_id)
        self.vocab_size = vocab_size
        self._compiled: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()
        self.num_compiled = self.num_reused = 0  # grammars compiled; matchers copied from one compiled before

    def matcher(self, spec: StructuredOutput) -> llguidance.LLMatcher:
        """A fresh matcher for ``spec`` at its start; ValueError naming the spec's kind if it does not compile."""
        key = spec.key
        with self._lock:
            template = self._compiled.get(key)
            if template is not None:
                self._compiled.move_to_end(key)
                self.num_reused += 1
                return template.deep_copy()
        try:
            grammar = grammar_text(spec)
        except ValueError as error:  # e.g. GBNF that does not convert
            raise ValueError(f"structured output: the {spec.kind} is not usable: {error}") from None
        template = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)  # compiles; an error is kept inside
        if template.is_error():
            raise ValueError(f"structured output: the {spec.kind} is not usable: {template.get_error()}")
        with self._lock:
            self._compiled[key] = template
            self.num_compiled += 1
            if len(self._compiled) > MAX_CACHED_GRAMMARS:
                self._compiled.popitem(last=False)
        return template.deep_copy()


_COMPILERS: weakref.WeakKeyDictionary[Tokenizer, dict[int, GrammarCompiler]] = weakref.WeakKeyDictionary()
_COMPILERS_LOCK = threading.Lock()


def compiler_for(tokenizer: Tokenizer, vocab_size: int) -> GrammarCompiler:
    """The :class:`GrammarCompiler` of ``tokenizer`` (made on first use: the vocabulary costs about a second), kept
    while the tokenizer lives: every engine, and every test, on one tokenizer shares it."""
    with _COMPILERS_LOCK:
        by_size = _COMPILERS.setdefault(tokenizer, {})
        if vocab_size not in by_size:
            by_size[vocab_size] = GrammarCompiler(tokenizer, vocab_size)
        return by_size[vocab_size]
