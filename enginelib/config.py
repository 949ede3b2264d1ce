"""Every knob in one place, as plain data with no torch: what a request asks for (:class:`SamplingParams`) and how the
engine runs (:class:`EngineConfig`); the scheduling side imports it, not the tensor code, as in vLLM. Each config checks
its values when built, so a bad value fails where it is written, not steps later inside the engine."""
from __future__ import annotations

import math
import operator
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

from enginelib.structured_output import StructuredOutput

# Below this a temperature is greedy; below MIN_TEMPERATURE it is raised to it: dividing logits by, say, 1e-38
# overflows to inf and the probabilities become NaN (vLLM's _SAMPLING_EPS and _MAX_TEMP).
GREEDY_TEMPERATURE = 1e-5
MIN_TEMPERATURE = 1e-2
SEED_RANGE = (-2**63, 2**64)  # what torch.Generator.manual_seed accepts
MAX_LOGPROBS = 20  # most-likely tokens reported per position at most (OpenAI's top_logprobs limit; vLLM's default)


def _is_int(value: object) -> bool:
    """An int that is not a bool: ``True`` would otherwise pass as 1 and hide a mix-up of arguments."""
    return isinstance(value, int) and not isinstance(value, bool)


def _check_number(name: str, value: object, example: str) -> None:
    """Refuse a non-number or a nan/inf up front: either would crash or sample garbage only later, mid-batch."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r} ({type(value).__name__}): pass e.g. {name}={example}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}: pass e.g. {name}={example}")


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop, like vLLM's. ``temperature=0``: greedy; ``top_k`` of 0 or -1 and ``top_p``
    of 1: off. A stop string ends the text before it, unless ``include_stop_str_in_output``. ``seed``: reproducible
    sampling per request. ``logprobs`` (0..20, None: off): each token's log-probability and the likeliest tokens', from
    the raw logits. ``prompt_logprobs`` (0..20, None: off, vLLM's): each prompt token's log-probability given the
    tokens before it and the likeliest tokens' there (the first token has none); such a request computes its whole
    prompt, taking no prefix-cache hits for it. ``n`` samples per prompt: ``LLM.generate`` runs ``n`` requests
    (seeded ``seed + j``) sharing the prompt's blocks; an ``Engine`` request is one sample. ``min_p``, ``min_tokens`` and the penalties are vLLM's.
    ``structured_output``: the output must match a JSON Schema, a regex, a choice or a grammar (chapter 12); a request
    whose grammar is complete stops ("stop"), and EOS is allowed only where the grammar may end."""
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 16
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    seed: int | None = None
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    n: int = 1
    min_p: float = 0.0
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    skip_special_tokens: bool = True
    prompt_logprobs: int | None = None
    structured_output: StructuredOutput | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self._check_types()
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 means greedy), got {self.temperature}")
        if 0 < self.temperature < GREEDY_TEMPERATURE:
            self.temperature = 0.0
        elif GREEDY_TEMPERATURE <= self.temperature < MIN_TEMPERATURE:
            self.temperature = MIN_TEMPERATURE
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k must be a positive integer, or 0 / -1 to disable it; got {self.top_k!r}")
        for name, low, high, eg in (("min_p", 0, 1, "0.05"), ("presence_penalty", -2, 2, "0.5"),
                                     ("frequency_penalty", -2, 2, "0.5"), ("repetition_penalty", 0, math.inf, "1.2")):
            value = getattr(self, name)  # in vLLM's ranges; a repetition_penalty of 0 would divide by zero
            _check_number(name, value, eg)
            if not low <= value <= high or (name == "repetition_penalty" and value == 0):
                raise ValueError(f"{name} must be {'above 0' if high == math.inf else f'in [{low}, {high}]'}, got "
                                 f"{value}: pass e.g. {name}={eg}")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be an integer from 0 to max_tokens ({self.max_tokens}), got "
                             f"{self.min_tokens!r}: lower min_tokens or raise max_tokens")

    def _check_types(self) -> None:
        """Checks the range checks below cannot make: a string or nan there would raise TypeError or pass."""
        _check_number("temperature", self.temperature, "0.7 (0 means greedy)")
        _check_number("top_p", self.top_p, "0.9 (1 turns it off)")
        if not isinstance(self.stop, (list, tuple)) or not all(isinstance(s, str) for s in self.stop):
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}")
        if any(s == "" for s in self.stop):
            raise ValueError(f"stop strings must not be empty (one would match before any text), got {self.stop!r}: "
                             "pass only non-empty strings in stop")
        self.stop = list(self.stop)
        if not isinstance(self.stop_token_ids, (list, tuple)) or not all(_is_int(t) for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be a list of integer token ids, got {self.stop_token_ids!r}")
        self.stop_token_ids = list(self.stop_token_ids)
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        if self.seed is not None and not SEED_RANGE[0] <= self.seed < SEED_RANGE[1]:
            raise ValueError(f"seed must fit in 64 bits ({SEED_RANGE[0]} to {SEED_RANGE[1] - 1}), got {self.seed}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or not 0 <= value <= MAX_LOGPROBS):
                raise ValueError(f"{name} must be an integer from 0 to {MAX_LOGPROBS} (the most likely tokens to "
                                 f"report per position), or None for none; got {value!r}")
        if not _is_int(self.n) or self.n < 1:
            raise ValueError(f"n (samples per prompt) must be a positive integer, got {self.n!r}")
        if self.structured_output is not None and not isinstance(self.structured_output, StructuredOutput):
            raise ValueError(f"structured_output must be a StructuredOutput or None, got {self.structured_output!r}:"
                             " pass e.g. structured_output=StructuredOutput(json={'type': 'object'})")
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def uses_history(self) -> bool:  # penalties and min_tokens read the tokens so far (model/logits_processors.py)
        return bool(self.min_tokens or self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1)

    def sample(self, j: int) -> SamplingParams:
        """Sample ``j`` of ``n`` as a request of its own (as vLLM's child requests): seeded ``seed + j``, wrapped
        around the 64 bits a seed may take (a seed of 2**64 - 1 with n = 2 is valid, its second sample too)."""
        low, high = SEED_RANGE
        seed = None if self.seed is None else (self.seed + j - low) % (high - low) + low
        return replace(self, n=1, seed=seed)


def finish_reason(token: int, num_generated: int, params: SamplingParams, eos_token_id: int | None) -> str | None:
    """Why a request stops after emitting ``token``, or None if it goes on (min_tokens: see apply_history)."""
    if (token == eos_token_id and not params.ignore_eos) or token in params.stop_token_ids:
        return "stop"
    if num_generated >= params.max_tokens:
        return "length"
    return None


def stop_hold_back(params: SamplingParams) -> int:
    """How many trailing characters a stream keeps back: a stop string may start in them and end in a token still
    to come, and then the final text ends before it (0 without stop strings)."""
    return max((len(s) for s in params.stop), default=1) - 1


def as_token_ids(prompt: object) -> list[int]:
    """A non-text prompt as int token ids; anything else is refused here, before the scheduler, saying what to pass."""
    what = f"a prompt must be text (str) or a list of int token ids, got {type(prompt).__name__}"
    if prompt is None or isinstance(prompt, (bytes, Mapping, set, frozenset)) or not hasattr(prompt, "__iter__"):
        raise ValueError(f"{what}: pass a string, or tokenizer.encode(text)")
    ids = []
    for t in prompt:
        if isinstance(t, bool):
            raise ValueError(f"{what} holding a bool ({t!r}): pass int token ids")
        try:
            ids.append(operator.index(t))  # int, numpy and 0-d torch ints; not floats or strings
        except TypeError:
            raise ValueError(f"{what} holding {type(t).__name__} {t!r}: pass int token ids, "
                             "or a single string (one prompt) as text") from None
    return ids


def check_request(prompt_ids: list[int], params: SamplingParams, vocab_size: int, context_length: int) -> None:
    """Refuse, with what to change, a request no generator or engine can run (shared by both)."""
    if not isinstance(params, SamplingParams):
        raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}: "
                         "pass SamplingParams(...) or None for the defaults")
    if not prompt_ids:
        raise ValueError("the prompt is empty: give at least one token")
    bad = [t for t in prompt_ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"token ids {bad[:5]} are outside the vocabulary (0..{vocab_size - 1})")
    if params.n != 1:
        raise ValueError(f"n={params.n}: the engine runs one sample per request; LLM.generate (or a server) runs n "
                         "samples as n requests, seeded seed + j")
    if len(prompt_ids) + params.max_tokens > context_length:
        raise ValueError(f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the "
                         f"model's context of {context_length} tokens: shorten the prompt or lower max_tokens")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 32              # requests running at once
    max_num_batched_tokens: int = 2048  # tokens computed in one step (the token budget)
    enable_chunked_prefill: bool = True  # split prompts longer than what is left of the budget

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be at least "
                             f"max_num_seqs ({self.max_num_seqs}): every running request decodes each step")


SPECULATIVE_METHODS = ("ngram", "draft")


@dataclass(frozen=True)
class SpeculativeConfig:
    """How to speculate (chapter 15): ``method`` "ngram" (prompt lookup) or "draft" (a second, smaller model)."""
    method: str = "ngram"
    num_speculative_tokens: int = 4  # k: guesses per step, so up to k + 1 tokens per step
    prompt_lookup_max: int = 4       # n-gram: the longest suffix looked up earlier in the sequence
    prompt_lookup_min: int = 1       # n-gram: the shortest one tried before giving up for this step
    draft_model: Any = field(default=None, compare=False, repr=False)  # method "draft": a Transformer
    compile_draft: bool = False      # draft: its one-token steps through one compiled graph

    def __post_init__(self) -> None:
        k = self.num_speculative_tokens
        if not _is_int(k) or k <= 0:
            raise ValueError(f"num_speculative_tokens must be a positive integer (the guesses per step), got {k!r}: "
                             "pass e.g. num_speculative_tokens=4, or speculative=None to turn speculation off")
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"unknown speculative method {self.method!r}: use one of {SPECULATIVE_METHODS}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(f"need 1 <= prompt_lookup_min ({self.prompt_lookup_min}) <= prompt_lookup_max "
                             f"({self.prompt_lookup_max}): e.g. prompt_lookup_min=1, prompt_lookup_max=4")
        if self.method == "draft" and self.draft_model is None:
            raise ValueError("method 'draft' needs a draft model: pass draft_model=<Transformer with the target's "
                             "vocabulary>, or use method='ngram'")
        if self.compile_draft and self.method != "draft":
            raise ValueError("compile_draft compiles a draft model's steps: use it with method='draft'")


DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 32)
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")  # torch.compile's


@dataclass(frozen=True)
class CompileConfig:
    """What to compile (chapter 14): steps padded up to ``batch_sizes`` tokens (one per decoding sequence)."""
    batch_sizes: tuple[int, ...] = DEFAULT_BATCH_SIZES
    mode: str | None = None       # torch.compile's mode: None (its default) or e.g. "reduce-overhead" (CUDA graphs)
    # CPU: the weights become graph constants (folded, pre-packed for oneDNN, not ~430 arguments each step): faster
    # steps, and faster compiling with cpp_wrapper (how much depends on the machine and torch: chapter 14 times one)
    freeze: bool = False
    # CPU: the step's ~300 kernel calls made in C++, not Python: a few ms less a step at batch 1, a minute more to build
    cpp_wrapper: bool = False
    fallback: bool = True         # when compiling is unavailable: run eagerly and say why (False: raise)

    def __post_init__(self) -> None:
        sizes = self.batch_sizes
        if not sizes or any(not _is_int(b) or b < 1 for b in sizes):
            raise ValueError(f"batch_sizes must be positive integers, e.g. (1, 2, 4, 8), got {sizes!r}")
        if tuple(sorted(set(sizes))) != tuple(sizes):
            raise ValueError(f"batch_sizes must be increasing without repeats, e.g. (1, 2, 4, 8), got {sizes!r}")
        if self.mode not in (None, *COMPILE_MODES):
            raise ValueError(f"mode must be None or one of torch.compile's modes {list(COMPILE_MODES[1:])}, "
                             f"got {self.mode!r}")


@dataclass(frozen=True)
class EngineConfig:
    block_size: int = 16
    num_blocks: int | None = None       # the pool's size; else from kv_cache_memory
    kv_cache_memory: int | None = None  # bytes for K/V; default 512 MiB on a CPU, else the fraction below
    gpu_memory_fraction: float = 0.4    # of the free GPU memory (device.free_gpu_memory) without kv_cache_memory
    enable_prefix_caching: bool = True  # reuse computed blocks of a shared prefix (chapter 9)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)  # seats, token budget, chunked prefill
    record: bool = False                # keep a StepRecord per step (for timelines and block maps)
    speculative: SpeculativeConfig | None = None  # guess tokens and verify them in one step (chapter 15); off: None
    compile: CompileConfig | None = None  # decode and verify steps through torch.compile, per bucket; off: None (eager)
    # eager decode steps attend with a fused kernel reading K/V where they lie, not gathered for SDPA: C++ on a float32
    # CPU, Triton on a CUDA GPU (the name is older); enginelib.speed.factory.decode_attention_kernel picks it or
    # raises a ValueError
    cpu_decode_kernel: bool = False
    # tokens a request's grammar forces (a schema's next key) appended unsampled, computed with the next step's tokens
    # (SGLang's jump-forward decoding, chapter 12); off: each sampled under the mask, as the model itself picks them
    jump_forward: bool = False
    fused_step: bool = False  # decode steps in one C++ call, llama.cpp's way (speed.fused_step: int4 cpp_q8 on a CPU)

    @classmethod
    def from_args(cls, **args: Any) -> EngineConfig:
        """Flat keyword arguments, as ``LLM(max_num_seqs=8, block_size=16)`` takes them, sorted into the configs."""
        names = {f.name for f in fields(SchedulerConfig)}
        unknown = set(args) - names - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(
                f"unknown engine arguments {sorted(unknown)}: use fields of EngineConfig or SchedulerConfig")
        scheduler = SchedulerConfig(**{k: args.pop(k) for k in list(args) if k in names})
        args.setdefault("scheduler", scheduler)
        return cls(**args)
