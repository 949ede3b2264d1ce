"""The engine's side of structured output (chapter 12): one grammar matcher per request that has a spec, kept in
step with the request's tokens, and the token mask it gives the sampler (a logits processor, as
:mod:`.logits_processors`' are, but with a state per request).

Each step, for such a request, the runner calls :meth:`StructuredOutputManager.mask` on a copy of the request's
logits row: every token the grammar cannot take next becomes -inf, so sampling (greedy or not) picks an allowed
one, while the logprobs stay the model's own. After the step the engine calls :meth:`~StructuredOutputManager.advance`:
the matcher takes the request's new tokens, and a grammar that is complete ends the request ("stop"). A matcher
counts the tokens it has taken and catches up from there, whatever appended them (a sampled token, tokens a grammar
forced); a preempted request keeps its tokens when it is recomputed, and its matcher keeps its state with them.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import llguidance
import numpy as np
import torch

from enginelib.model.grammar import GrammarCompiler, compiler_for
from enginelib.model.tokenizer import Tokenizer
from enginelib.structured_output import StructuredOutput

NUMPY_FLOATS = (torch.float32, torch.float16, torch.float64)  # a CPU row of these is masked in place with NumPy


@dataclass
class StructuredStats:
    """Counters over an engine's life: what the grammars cost, next to the steps they ran in."""
    masks: int = 0              # token masks computed: one per structured request per sampled row
    mask_seconds: float = 0.0   # host time computing them (llguidance) and applying them to the rows
    forced_tokens: int = 0      # tokens appended by jump-forward, with no sampling of their own

    @property
    def mask_ms(self) -> float:
        """Milliseconds per mask, on average."""
        return 1000 * self.mask_seconds / self.masks if self.masks else 0.0


class RequestGrammar:
    """One request's matcher and how many of its output tokens it has taken."""

    def __init__(self, matcher: llguidance.LLMatcher, spec: StructuredOutput) -> None:
        self.matcher, self.spec = matcher, spec
        self.num_tokens = 0

    def catch_up(self, tokens: list[int]) -> None:
        """Take ``tokens[num_tokens:]``: the request's output tokens since the last call."""
        if len(tokens) < self.num_tokens:
            raise RuntimeError(f"the output shrank from {self.num_tokens} to {len(tokens)} tokens while its "
                               "request was live: a matcher cannot follow that")
        new = tokens[self.num_tokens:]
        if new and not self.matcher.consume_tokens(new):
            raise ValueError(f"structured output: the grammar refused tokens {new}: {self.matcher.get_error()}")
        self.num_tokens = len(tokens)

    @property
    def complete(self) -> bool:
        """Nothing more may follow (but EOS): the output is whole."""
        return self.matcher.is_stopped()

    def forced_tokens(self) -> list[int]:
        """The tokens the grammar forces next, whatever the model would say (empty when it leaves a choice)."""
        return list(self.matcher.compute_ff_tokens())


class StructuredOutputManager:
    """The grammars of one engine's live requests, keyed by request id."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, device: torch.device | str = "cpu") -> None:
        self.tokenizer, self.vocab_size, self.device = tokenizer, vocab_size, torch.device(device)
        self.grammars: dict[str, RequestGrammar] = {}
        self.stats = StructuredStats()
        self._compiler: GrammarCompiler | None = None  # made with the first spec: an engine without any pays nothing
        self._bits = np.zeros((vocab_size + 31) // 32, dtype="<i4")  # the mask, one bit per token (token 32w + b:
        self._shifts = torch.arange(32, dtype=torch.int32, device=self.device)  # bit b of word w, little-endian)

    @property
    def compiler(self) -> GrammarCompiler:
        if self._compiler is None:
            self._compiler = compiler_for(self.tokenizer, self.vocab_size)
        return self._compiler

    def add(self, request_id: str, spec: StructuredOutput | None) -> None:
        """A matcher for the request (none without a spec); ValueError if its spec does not compile."""
        if spec is not None:
            self.grammars[request_id] = RequestGrammar(self.compiler.matcher(spec), spec)

    def release(self, request_id: str) -> None:
        self.grammars.pop(request_id, None)

    def mask(self, logits: torch.Tensor, request_id: str, output_ids: list[int]) -> torch.Tensor:
        """Set to -inf, in ``logits`` (the request's own row [1, V] or [V], a copy), every token its grammar cannot
        take after ``output_ids``; return it. ValueError when the grammar allows nothing (it failed)."""
        start = time.perf_counter()
        grammar = self.grammars[request_id]
        grammar.catch_up(output_ids)
        bits = self._bits
        grammar.matcher.unsafe_compute_mask_ptr(bits.ctypes.data, bits.nbytes)
        if grammar.matcher.is_error() or not bits.any():
            raise ValueError(f"structured output: no token can follow ({grammar.matcher.get_error() or 'empty mask'})")
        row = logits.view(-1)
        if row.device.type == "cpu" and row.dtype in NUMPY_FLOATS:
            # NumPy, on this thread: torch would split a 49k-element op over its threads, and on a busy CPU (a
            # server's other process, a second job) waiting for them costs ~30 ms where this takes ~0.3 ms
            allowed = np.unpackbits(bits.view(np.uint8), bitorder="little")[:row.numel()]
            np.putmask(row.numpy(), allowed == 0, -np.inf)
        else:  # a GPU's row: 6 KB of bits over, unpacked there
            bits_there = torch.from_numpy(bits).to(self.device)
            row.masked_fill_(((bits_there[:, None] >> self._shifts) & 1).view(-1)[:row.numel()] == 0, float("-inf"))
        self.stats.masks += 1
        self.stats.mask_seconds += time.perf_counter() - start
        return logits

    def advance(self, request_id: str, output_ids: list[int]) -> bool:
        """The matcher takes the request's new tokens; True when its grammar is complete (the request ends)."""
        grammar = self.grammars[request_id]
        grammar.catch_up(output_ids)
        return grammar.complete

    def forced_tokens(self, request_id: str) -> list[int]:
        """What the request's grammar forces next (see :meth:`RequestGrammar.forced_tokens`), e.g. a schema's next
        key after a value; the engine appends them with ``EngineConfig(jump_forward=True)``."""
        return self.grammars[request_id].forced_tokens()
