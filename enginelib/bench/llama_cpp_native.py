"""llama.cpp itself, through llama-cpp-python's ctypes bindings: the part of the peer that runs in its child process.

The benchmark builds :class:`LlamaCpp` in a child (:mod:`.child`), so this
module imports neither torch nor the rest of ``enginelib``: only numpy and
the child's :func:`~.child.native_call` marker, set around every call into
llama.cpp so that a crash names the call. The request loop and the decode
timing run here too, next to llama.cpp, so that no pipe sits inside a timed step.
"""
from __future__ import annotations

import contextlib
import importlib
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from enginelib.bench.child import native_call

# The llama-cpp-python release the peer is measured with; .ci/build_llama_cpp.sh builds llama.cpp's own
# tools from the llama.cpp source vendored in this release's sdist, so both ways run the same llama.cpp.
PINNED_VERSION = "0.3.36"
INSTALL = (f"pip install llama-cpp-python=={PINNED_VERSION}  (it compiles llama.cpp from source for several "
           "minutes; CMAKE_BUILD_PARALLEL_LEVEL=<cores> speeds that up)")


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """llama.cpp logs every load at INFO through llama-cpp-python's logger: errors only, while we load."""
    logger = logging.getLogger("llama-cpp-python")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


@dataclass
class _Running:
    index: int        # the request's place in the workload
    seq: int          # its llama.cpp sequence id
    pending: list[int]  # tokens to feed next step: the prompt, then the last token
    pos: int          # tokens already in its KV cache
    arrival: float
    times: list[float]
    tokens: list[int]


class LlamaCpp:
    """One llama.cpp model and context: ``max_num_seqs`` sequences in a unified KV cache of ``n_ctx`` tokens.

    ``n_batch`` is the most tokens one ``llama_decode`` call takes (prompts of
    the requests joining plus one token per running request); llama.cpp splits
    it into micro-batches itself. ``gpu`` offloads every layer where this
    build of llama.cpp can (a CUDA build); ``device`` says where it runs.
    Call :meth:`close` (or use ``with``) to free it.
    """

    def __init__(self, path: str | Path, threads: int, max_num_seqs: int = 64, n_ctx: int = 16384,
                 n_batch: int = 2048, gpu: bool = False):
        try:
            lc = importlib.import_module("llama_cpp")
        except (ImportError, OSError, RuntimeError) as err:  # OSError/RuntimeError: the compiled library did not load
            raise ValueError(f"the llama_cpp system needs llama-cpp-python: {INSTALL}; import failed with "
                             f"{type(err).__name__}: {err}") from err
        self.lc, self.path, self.threads = lc, Path(path), threads
        self.ctx = self.model = None
        self.max_num_seqs = min(max_num_seqs, lc.llama_max_parallel_sequences())
        self.n_ctx, self.n_batch = n_ctx, n_batch
        self.device = "cuda" if gpu and lc.llama_supports_gpu_offload() else "cpu"
        with _quiet():
            with native_call("llama_backend_init"):
                lc.llama_backend_init()
            mparams = lc.llama_model_default_params()
            mparams.n_gpu_layers = 999 if self.device == "cuda" else 0
            with native_call("llama_model_load_from_file"):
                self.model = lc.llama_model_load_from_file(str(path).encode(), mparams)
            if not self.model:
                raise ValueError(f"llama.cpp could not load {path}")
            params = lc.llama_context_default_params()
            params.n_ctx, params.n_batch, params.n_ubatch = n_ctx, n_batch, min(512, n_batch)
            params.n_seq_max, params.kv_unified = self.max_num_seqs, True
            params.n_threads = params.n_threads_batch = threads
            with native_call("llama_init_from_model"):
                self.ctx = lc.llama_init_from_model(self.model, params)
            if not self.ctx:
                lc.llama_model_free(self.model)
                raise ValueError(f"llama.cpp could not make a context of {n_ctx} tokens for {path}")
        self.memory = lc.llama_get_memory(self.ctx)
        self.n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(self.model))
        self.batch = lc.llama_batch_init(n_batch, 0, 1)
        self.version = getattr(lc, "__version__", "?")

    def describe(self) -> dict:
        """What the parent needs to know of this peer (its child holds the object itself)."""
        return {"path": str(self.path), "threads": self.threads, "max_num_seqs": self.max_num_seqs,
                "n_ctx": self.n_ctx, "n_batch": self.n_batch, "device": self.device, "version": self.version}

    def close(self) -> None:
        if self.ctx:
            with _quiet(), native_call("llama_free"):  # llama.cpp logs what it frees
                self.lc.llama_batch_free(self.batch)
                self.lc.llama_free(self.ctx)
                self.lc.llama_model_free(self.model)
            self.ctx = self.model = None

    def __enter__(self) -> LlamaCpp:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def decode(self, rows: list[tuple[int, list[int], int]]) -> list[int]:
        """One ``llama_decode`` call: each row is (sequence id, new tokens, position of the first).

        Returns each row's greedy next token, the argmax of its last token's logits.
        """
        b, n = self.batch, 0
        for seq, tokens, pos in rows:
            for j, token in enumerate(tokens):
                b.token[n], b.pos[n], b.n_seq_id[n] = token, pos + j, 1
                b.seq_id[n][0] = seq
                b.logits[n] = j == len(tokens) - 1
                n += 1
        b.n_tokens = n
        with native_call("llama_decode"):
            code = self.lc.llama_decode(self.ctx, b)
        if code != 0:
            raise RuntimeError(f"llama_decode returned {code} for {n} tokens in {len(rows)} sequences "
                               f"(1: no room in the {self.n_ctx}-token KV cache: pass a larger n_ctx)")
        out, n = [], 0
        with native_call("llama_get_logits_ith"):
            for _, tokens, _ in rows:
                n += len(tokens)
                logits = np.ctypeslib.as_array(self.lc.llama_get_logits_ith(self.ctx, n - 1), shape=(self.n_vocab,))
                out.append(int(logits.argmax()))
        return out

    def forget(self, seq: int) -> None:
        """Free a finished sequence's KV cells."""
        with native_call("llama_memory_seq_rm"):
            self.lc.llama_memory_seq_rm(self.memory, seq, -1, -1)

    def serve_requests(self, requests: list[tuple[list[int], int, float, int]], eos_token_id: int | None,
                       seats: int) -> tuple[float, list[tuple[float, list[float], list[int]]]]:
        """Requests (prompt ids, max tokens, arrival second, arrival step) through continuous batching.

        Returns the seconds taken and, per request, (arrival, token times,
        tokens), times from ``time.perf_counter``. A request joins at its
        arrival (one injected at an engine step: after that many of llama.cpp's
        steps) when a sequence id is free, its whole prompt fits this step's
        ``n_batch`` tokens and the KV cache holds its prompt plus its max
        tokens beside every running one. It ends at its max tokens, or at
        ``eos_token_id`` (None: never).
        """
        pending = sorted(range(len(requests)), key=lambda i: (requests[i][3], requests[i][2]))
        free, running, done = list(range(seats)), [], {}
        steps = 0
        start = time.perf_counter()
        while pending or running:
            now = time.perf_counter() - start
            budget = self.n_batch - len(running)
            reserved = sum(len(requests[r.index][0]) + requests[r.index][1] for r in running)
            while pending and free:
                prompt, max_tokens, arrival_s, arrival_step = requests[pending[0]]
                need = len(prompt) + max_tokens
                if arrival_step > steps or arrival_s > now or len(prompt) > budget or reserved + need > self.n_ctx:
                    break
                i = pending.pop(0)
                arrival = start + arrival_s if not arrival_step else time.perf_counter()
                running.append(_Running(i, free.pop(0), list(prompt), 0, arrival, [], []))
                budget -= len(prompt)
                reserved += need
            if not running:  # idle until the next arrival: a request due at a later step is due now
                _, _, arrival_s, arrival_step = requests[pending[0]]
                steps = max(steps, arrival_step)
                time.sleep(max(0.0, arrival_s - now))
                continue
            tokens = self.decode([(r.seq, r.pending, r.pos) for r in running])
            stamp = time.perf_counter()
            steps += 1
            for r, token in zip(list(running), tokens):
                r.pos += len(r.pending)
                r.pending = [token]
                r.tokens.append(token)
                r.times.append(stamp)
                if len(r.tokens) == requests[r.index][1] or token == eos_token_id:
                    running.remove(r)
                    self.forget(r.seq)
                    free.append(r.seq)
                    done[r.index] = r
        seconds = time.perf_counter() - start
        return seconds, [(done[i].arrival, done[i].times, done[i].tokens) for i in range(len(requests))]

    def step_times(self, prompts: list[list[int]], new_tokens: int) -> list[float]:
        """The seconds of each pure decode step: ``prompts`` prefilled together (untimed), then
        ``new_tokens - 1`` timed greedy steps of one token per sequence; the sequences are freed after."""
        if len(prompts) > self.max_num_seqs:
            raise ValueError(f"batch {len(prompts)} > the {self.max_num_seqs} sequences this LlamaCpp holds")
        rows = [(seq, p, 0) for seq, p in enumerate(prompts)]
        times = []
        for step in range(new_tokens):
            t = time.perf_counter()
            nxt = self.decode(rows)
            if step:  # the first call is the prefill
                times.append(time.perf_counter() - t)
            rows = [(seq, [token], pos + len(fed)) for (seq, fed, pos), token in zip(rows, nxt)]
        for seq in range(len(prompts)):
            self.forget(seq)
        return times
