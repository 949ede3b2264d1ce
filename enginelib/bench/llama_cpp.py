"""llama.cpp as a peer: the same GGUF file, thread count, greedy decoding and token ids, in the same process.

``llama-cpp-python`` is optional (``pip install llama-cpp-python`` compiles
llama.cpp from source: several minutes). Its high-level ``Llama`` runs one
sequence at a time, so this module drives llama.cpp's own batch API
(``llama_batch`` / ``llama_decode``) the way its server does: up to
``max_num_seqs`` sequences share each decode step, each its own sequence id in
one unified KV cache, and a request joins as soon as a sequence id is free
(continuous batching). With ``max_num_seqs=1`` it is one request at a time.

Greedy here is the argmax of llama.cpp's logits, which is what its greedy
sampler picks. llama.cpp computes on the file's quantized tensors (Q4_1, with
activations rounded to 8 bits inside its matmuls), the engine on float weights
dequantized from them, so their greedy texts agree often but not always:
the fraction that agree is reported, never asserted. (llama.cpp's own greedy
text also changes with how many sequences share its steps: measured here,
one request of four parted at its first token between batch 1 and batch 4.)
"""
from __future__ import annotations

import collections
import contextlib
import importlib
import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from enginelib.bench.results import SystemResult, add_latencies
from enginelib.bench.workloads import QUESTIONS, BenchRequest, Workload, chat_prompt
from enginelib.model.tokenizer import Tokenizer
from enginelib.model.transformer import Transformer
from enginelib.model.weights import resolve
from enginelib.speed.quant import quant_info

NAME = "llama_cpp"
INSTALL = ("pip install llama-cpp-python  (it compiles llama.cpp from source for several minutes; "
           "CMAKE_BUILD_PARALLEL_LEVEL=<cores> speeds that up)")


def import_error() -> str | None:
    """Why ``import llama_cpp`` fails here (None when it works): the system runs only when it does."""
    try:
        importlib.import_module("llama_cpp")
    except (ImportError, OSError, RuntimeError) as err:  # OSError/RuntimeError: the compiled library did not load
        return f"{type(err).__name__}: {err}"
    return None


def available() -> bool:
    """Whether the ``llama_cpp`` system can run (``llama-cpp-python`` imports)."""
    return import_error() is None


def gguf_path(model: str | Path) -> Path:
    """The GGUF file the engine loads for ``model`` (a known name or a path); llama.cpp reads only GGUF."""
    path = resolve(model)
    if path.suffix != ".gguf":
        raise ValueError(f"the llama_cpp system needs a GGUF file, and {str(model)!r} resolves to {path}: "
                         f"pass --model a .gguf file or a known name, or leave llama_cpp out of --systems")
    return path


def gguf_format(path: Path) -> str:
    """The tensor type of most of the file's weight matrices, then the exceptions.

    The shipped file: ``Q4_1 (token_embd.weight Q8_0)``.
    """
    from gguf import GGUFReader

    matrices = [t for t in GGUFReader(str(path)).tensors if len(t.shape) == 2]
    counts = collections.Counter()
    for t in matrices:
        counts[t.tensor_type.name] += int(t.n_elements)
    main = counts.most_common(1)[0][0]
    others = [f"{t.name} {t.tensor_type.name}" for t in matrices if t.tensor_type.name != main]
    return main + (f" ({', '.join(others)})" if others else "")


def engine_format(model: Transformer) -> str:
    """What the engine's linear layers hold: the dtype, or the quantized format and the head's."""
    dtype = str(model.dtype).removeprefix("torch.")
    info = quant_info(model)
    if info is None:
        return dtype
    head = "" if info.head_fmt == info.fmt else f", LM head {info.head_fmt}"
    return f"{info.fmt} weights{head}, {dtype} activations"


@contextlib.contextmanager
def _quiet():
    """llama.cpp logs every load at INFO through llama-cpp-python's logger: errors only, while we load."""
    logger = logging.getLogger("llama-cpp-python")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


class LlamaCpp:
    """One llama.cpp model and context: ``max_num_seqs`` sequences in a unified KV cache of ``n_ctx`` tokens.

    ``n_batch`` is the most tokens one ``llama_decode`` call takes (prompts of
    the requests joining plus one token per running request); llama.cpp splits
    it into micro-batches itself. ``gpu`` offloads every layer where this
    build of llama.cpp can (a CUDA build); ``device`` says where it runs.
    Call :meth:`close` (or use ``with``) to free it.
    """

    def __init__(self, path: Path, threads: int, max_num_seqs: int = 64, n_ctx: int = 16384, n_batch: int = 2048,
                 gpu: bool = False):
        err = import_error()
        if err is not None:
            raise ValueError(f"the llama_cpp system needs llama-cpp-python: {INSTALL}; import failed with {err}")
        import llama_cpp as lc

        self.lc, self.path, self.threads = lc, Path(path), threads
        self.max_num_seqs = min(max_num_seqs, lc.llama_max_parallel_sequences())
        self.n_ctx, self.n_batch = n_ctx, n_batch
        self.device = "cuda" if gpu and lc.llama_supports_gpu_offload() else "cpu"
        with _quiet():
            lc.llama_backend_init()
            mparams = lc.llama_model_default_params()
            mparams.n_gpu_layers = 999 if self.device == "cuda" else 0
            self.model = lc.llama_model_load_from_file(str(path).encode(), mparams)
            if not self.model:
                raise ValueError(f"llama.cpp could not load {path}")
            params = lc.llama_context_default_params()
            params.n_ctx, params.n_batch, params.n_ubatch = n_ctx, n_batch, min(512, n_batch)
            params.n_seq_max, params.kv_unified = self.max_num_seqs, True
            params.n_threads = params.n_threads_batch = threads
            self.ctx = lc.llama_init_from_model(self.model, params)
            if not self.ctx:
                lc.llama_model_free(self.model)
                raise ValueError(f"llama.cpp could not make a context of {n_ctx} tokens for {path}")
        self.memory = lc.llama_get_memory(self.ctx)
        self.n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(self.model))
        self.batch = lc.llama_batch_init(n_batch, 0, 1)
        self.version = getattr(lc, "__version__", "?")

    def close(self) -> None:
        if self.ctx:
            with _quiet():  # llama.cpp logs what it frees
                self.lc.llama_batch_free(self.batch)
                self.lc.llama_free(self.ctx)
                self.lc.llama_model_free(self.model)
            self.ctx = self.model = None

    def __enter__(self) -> LlamaCpp:
        return self

    def __exit__(self, *exc) -> None:
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
        code = self.lc.llama_decode(self.ctx, b)
        if code != 0:
            raise RuntimeError(f"llama_decode returned {code} for {n} tokens in {len(rows)} sequences "
                               f"(1: no room in the {self.n_ctx}-token KV cache: pass a larger n_ctx)")
        out, n = [], 0
        for _, tokens, _ in rows:
            n += len(tokens)
            logits = np.ctypeslib.as_array(self.lc.llama_get_logits_ith(self.ctx, n - 1), shape=(self.n_vocab,))
            out.append(int(logits.argmax()))
        return out

    def forget(self, seq: int) -> None:
        """Free a finished sequence's KV cells."""
        self.lc.llama_memory_seq_rm(self.memory, seq, -1, -1)


def open_peer(model: str | Path, threads: int, max_num_seqs: int, workloads: list[Workload],
              gpu: bool = False) -> LlamaCpp:
    """llama.cpp on ``model``'s GGUF file, with room for ``workloads``: a KV cache for every request at once.

    The cache is capped at 32768 tokens (about 750 MB for SmolLM2-135M in
    float16); past that, requests wait for room, as the engine's do for blocks.
    """
    reqs = [r for wl in workloads for r in wl.requests]
    want = max(sum(len(r.prompt_ids) + r.max_tokens for r in wl.requests) for wl in workloads)
    n_ctx = min(32768, max(4096, -(-want // 256) * 256))
    n_batch = min(n_ctx, max(2048, max(len(r.prompt_ids) for r in reqs) + max_num_seqs))
    return LlamaCpp(gguf_path(model), threads, max_num_seqs, n_ctx, n_batch, gpu)


@dataclass
class _Running:
    index: int        # the request's place in the workload
    seq: int          # its llama.cpp sequence id
    pending: list[int]  # tokens to feed next step: the prompt, then the last token
    pos: int          # tokens already in its KV cache
    arrival: float
    times: list[float]
    tokens: list[int]


def run_llama_cpp(peer: LlamaCpp, tok: Tokenizer, wl: Workload, max_num_seqs: int | None = None) -> SystemResult:
    """The workload through llama.cpp, continuous batching over sequence ids; greedy, the workload's token ids.

    Requests join at their ``arrival_s``, and those the workload injects at an
    engine step after that many of llama.cpp's steps. A request joins when a
    sequence id is free, its whole prompt fits this step's ``n_batch`` tokens
    and the KV cache holds its prompt plus ``max_tokens`` beside every running one.
    """
    seats = min(max_num_seqs or peer.max_num_seqs, peer.max_num_seqs)
    for r in wl.requests:
        if len(r.prompt_ids) + r.max_tokens > peer.n_ctx or len(r.prompt_ids) + seats > peer.n_batch:
            raise ValueError(f"a request of {len(r.prompt_ids)} prompt tokens and {r.max_tokens} new does not fit "
                             f"llama.cpp's n_ctx={peer.n_ctx} / n_batch={peer.n_batch}: make LlamaCpp larger")
    result = SystemResult(NAME, len(wl.requests), 0, 0.0,
                          note=f"llama.cpp {peer.version} on {peer.device}, {seats} sequences at most, no prefix cache")
    pending = sorted(range(len(wl.requests)), key=lambda i: (wl.requests[i].arrival_step, wl.requests[i].arrival_s))
    free, running, done = list(range(seats)), [], {}
    steps = 0
    start = time.perf_counter()
    while pending or running:
        now = time.perf_counter() - start
        budget = peer.n_batch - len(running)
        reserved = sum(len(wl.requests[r.index].prompt_ids) + wl.requests[r.index].max_tokens for r in running)
        while pending and free:
            req: BenchRequest = wl.requests[pending[0]]
            need = len(req.prompt_ids) + req.max_tokens
            if req.arrival_step > steps or req.arrival_s > now or len(req.prompt_ids) > budget \
                    or reserved + need > peer.n_ctx:
                break
            i = pending.pop(0)
            arrival = start + req.arrival_s if not req.arrival_step else time.perf_counter()
            running.append(_Running(i, free.pop(0), list(req.prompt_ids), 0, arrival, [], []))
            budget -= len(req.prompt_ids)
            reserved += need
        if not running:  # idle until the next arrival: a request due at a later step is due now
            head = wl.requests[pending[0]]
            steps = max(steps, head.arrival_step)
            time.sleep(max(0.0, head.arrival_s - now))
            continue
        tokens = peer.decode([(r.seq, r.pending, r.pos) for r in running])
        stamp = time.perf_counter()
        steps += 1
        for r, token in zip(list(running), tokens):
            r.pos += len(r.pending)
            r.pending = [token]
            r.tokens.append(token)
            r.times.append(stamp)
            req = wl.requests[r.index]
            if len(r.tokens) == req.max_tokens or (not wl.ignore_eos and token == tok.eos_token_id):
                running.remove(r)
                peer.forget(r.seq)
                free.append(r.seq)
                done[r.index] = r
    result.seconds = time.perf_counter() - start
    for i in range(len(wl.requests)):
        r = done[i]
        result.output_tokens += len(r.tokens)
        result.outputs.append(r.tokens)
        result.texts.append(tok.decode(r.tokens))
        add_latencies(result, r.arrival, r.times)
        result.timings.append((r.arrival, r.times))
    return result


def decode_step_time(peer: LlamaCpp, tok: Tokenizer, batch: int, new_tokens: int) -> float:
    """Median time of llama.cpp's pure decode steps with ``batch`` sequences: :func:`roofline.decode_step_time`'s twin.

    The same prompts (the first ``batch`` chats of :data:`QUESTIONS`), prefilled
    together, then ``new_tokens`` greedy steps of one token per sequence.
    """
    if batch > peer.max_num_seqs:
        raise ValueError(f"batch {batch} > the {peer.max_num_seqs} sequences this LlamaCpp holds")
    prompts = [chat_prompt(tok, QUESTIONS[i % len(QUESTIONS)]) for i in range(batch)]
    rows = [(seq, p, 0) for seq, p in enumerate(prompts)]
    times = []
    for step in range(new_tokens):
        t = time.perf_counter()
        nxt = peer.decode(rows)
        if step:  # the first call is the prefill
            times.append(time.perf_counter() - t)
        rows = [(seq, [token], pos + len(fed)) for (seq, fed, pos), token in zip(rows, nxt)]
    for seq in range(batch):
        peer.forget(seq)
    return statistics.median(times)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def agreement(ours: SystemResult, theirs: SystemResult) -> dict:
    """How often llama.cpp's greedy tokens equal the engine's, request by request (not asserted: formats differ)."""
    pairs = list(zip(ours.outputs, theirs.outputs))
    if not pairs:
        return {"texts_equal": None, "common_prefix_frac": None}
    return {"texts_equal": sum(a == b for a, b in pairs) / len(pairs),
            "common_prefix_frac": statistics.mean(common_prefix(a, b) / max(1, len(a)) for a, b in pairs)}


def llama_cpp_effect(peer: LlamaCpp, model: Transformer, tok: Tokenizer, quick: bool,
                     engine_step: Callable[[int, int], float], rounds: int = 2,
                     fast_step: Callable[[int, int], float] | None = None, fast_format: str | None = None,
                     fast_b32_step: Callable[[int, int], float] | None = None,
                     fast_b32_format: str | None = None) -> dict:
    """Single-stream and batch-32 decode, the engine's against llama.cpp's, alternated in the same process.

    ``engine_step(batch, new_tokens)`` is the engine's median decode step
    (:func:`roofline.decode_step_time`); llama.cpp's is :func:`decode_step_time`
    here, on the same prompts and token counts (16 quick, 64 full; batch 32:
    8 quick, 32 full). The two alternate ``rounds`` times and each keeps its
    best round, so a burst of load from elsewhere hurts neither side alone.
    ``fast_step``: the engine at its fastest single stream (``fast_format``,
    e.g. quantized and compiled), measured at batch 1 in the same rounds;
    ``fast_b32_step`` (``fast_b32_format``) likewise at batch 32.
    """
    new1, new32 = (16, 8) if quick else (64, 32)
    figures: dict[str, list[float]] = collections.defaultdict(list)
    for _ in range(rounds):
        figures["engine_b1"].append(1 / engine_step(1, new1))
        if fast_step is not None:
            figures["fast_b1"].append(1 / fast_step(1, new1))
        figures["llama_cpp_b1"].append(1 / decode_step_time(peer, tok, 1, new1))
        if peer.max_num_seqs >= 32:
            figures["engine_b32"].append(32 / engine_step(32, new32))
            if fast_b32_step is not None:
                figures["fast_b32"].append(32 / fast_b32_step(32, new32))
            figures["llama_cpp_b32"].append(32 / decode_step_time(peer, tok, 32, new32))
    best = {k: max(v) for k, v in figures.items()}
    b32 = "engine_b32" in best
    return {"single_stream_tok_per_s": best["llama_cpp_b1"], "engine_single_stream_tok_per_s": best["engine_b1"],
            "single_stream_ratio": best["engine_b1"] / best["llama_cpp_b1"],
            "decode_b32_tok_per_s": best["llama_cpp_b32"] if b32 else None,
            "engine_decode_b32_tok_per_s": best["engine_b32"] if b32 else None,
            "decode_b32_ratio": best["engine_b32"] / best["llama_cpp_b32"] if b32 else None,
            "decode_tokens": new1, "decode_tokens_b32": new32, "rounds": rounds, "threads": peer.threads,
            "device": peer.device,
            "version": peer.version, "gguf": peer.path.name, "format": gguf_format(peer.path),
            "engine_format": engine_format(model),
            "fast_single_stream_tok_per_s": best.get("fast_b1"), "fast_format": fast_format,
            "fast_single_stream_ratio": best["fast_b1"] / best["llama_cpp_b1"] if "fast_b1" in best else None,
            "fast_decode_b32_tok_per_s": best.get("fast_b32"), "fast_b32_format": fast_b32_format,
            "fast_decode_b32_ratio": best["fast_b32"] / best["llama_cpp_b32"] if "fast_b32" in best else None}

