"""llama.cpp as a peer: the same GGUF file, thread count, greedy decoding and token ids, in a child process.

``llama-cpp-python`` is optional (``pip install llama-cpp-python`` compiles
llama.cpp from source: several minutes). Its high-level ``Llama`` runs one
sequence at a time, so :mod:`.llama_cpp_native` drives llama.cpp's own batch API
(``llama_batch`` / ``llama_decode``) the way its server does: up to
``max_num_seqs`` sequences share each decode step, each its own sequence id in
one unified KV cache, and a request joins as soon as a sequence id is free
(continuous batching). With ``max_num_seqs=1`` it is one request at a time.

It runs in a child process (:class:`LlamaCppProcess`): llama-cpp-python built
from its sdist segfaulted on its first prompt on one Intel Xeon, which ended
the whole benchmark. Now such a crash is reported ("llama.cpp crashed: signal
11 (SIGSEGV) in llama_decode") and the run goes on without the peer.
:mod:`.llama_cpp_tools` compares with llama.cpp's own benchmark tools instead.

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
import functools
import importlib.util
import statistics
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from enginelib.bench.child import Child, ChildCrashed, child_env
from enginelib.bench.cpu import cpu_info, cpu_label
from enginelib.bench.llama_cpp_native import INSTALL, PINNED_VERSION, LlamaCpp
from enginelib.bench.results import SystemResult, add_latencies
from enginelib.bench.workloads import QUESTIONS, Workload, chat_prompt
from enginelib.model.tokenizer import Tokenizer
from enginelib.model.transformer import Transformer
from enginelib.model.weights import resolve
from enginelib.speed.quant import quant_info

NAME = "llama_cpp"
__all__ = ["INSTALL", "NAME", "PINNED_VERSION", "ChildCrashed", "LlamaCpp", "LlamaCppProcess", "agreement",
           "available", "decode_step_time", "gguf_format", "gguf_path", "import_error", "llama_cpp_effect",
           "open_peer", "run_llama_cpp"]


@functools.cache
def import_error() -> str | None:
    """Why ``import llama_cpp`` fails here (None when it works): the system runs only when it does.

    The import is tried in a child process: loading llama.cpp's library is
    native code too, and a build for another CPU dies there with SIGILL.
    """
    if importlib.util.find_spec("llama_cpp") is None:
        return "ModuleNotFoundError: No module named 'llama_cpp'"
    probe = subprocess.run([sys.executable, "-c", "import llama_cpp"], capture_output=True, text=True,
                           env=child_env(), timeout=300)
    if probe.returncode < 0:
        return f"import llama_cpp died with signal {-probe.returncode}"
    if probe.returncode:
        lines = probe.stderr.strip().splitlines()
        return lines[-1] if lines else f"import llama_cpp exited with code {probe.returncode}"
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


class LlamaCppProcess:
    """:class:`LlamaCpp` in a child process (:class:`~.child.Child`): a crash in llama.cpp ends the child, not us.

    The same figures and methods as :class:`LlamaCpp` (``serve_requests``,
    ``step_times``); a call during which the child dies raises
    :class:`~.child.ChildCrashed` ("llama.cpp crashed: signal 11 (SIGSEGV) in
    llama_decode"), kept in ``crashed``.
    """

    def __init__(self, path: Path, threads: int, max_num_seqs: int = 64, n_ctx: int = 16384, n_batch: int = 2048,
                 gpu: bool = False):
        self.child = Child("enginelib.bench.llama_cpp_native:LlamaCpp", str(path), threads, max_num_seqs, n_ctx,
                           n_batch, gpu, label="llama.cpp")
        about = self.child.call("describe")
        self.path = Path(about["path"])
        self.threads, self.max_num_seqs, self.device = about["threads"], about["max_num_seqs"], about["device"]
        self.n_ctx, self.n_batch, self.version = about["n_ctx"], about["n_batch"], about["version"]

    @property
    def crashed(self) -> ChildCrashed | None:
        return self.child.crashed

    def serve_requests(self, requests: list[tuple[list[int], int, float, int]], eos_token_id: int | None,
                       seats: int) -> tuple[float, list[tuple[float, list[float], list[int]]]]:
        return self.child.call("serve_requests", requests, eos_token_id, seats)

    def step_times(self, prompts: list[list[int]], new_tokens: int) -> list[float]:
        return self.child.call("step_times", prompts, new_tokens)

    def close(self) -> None:
        self.child.close()

    def __enter__(self) -> LlamaCppProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


Peer = LlamaCpp | LlamaCppProcess  # the same figures and methods, in this process or in a child


def open_peer(model: str | Path, threads: int, max_num_seqs: int, workloads: list[Workload],
              gpu: bool = False, isolated: bool = True) -> Peer:
    """llama.cpp on ``model``'s GGUF file, with room for ``workloads``: a KV cache for every request at once.

    ``isolated`` (the default) runs it in a child process (:class:`LlamaCppProcess`),
    so that a crash in llama.cpp is reported and the benchmark goes on. The
    cache is capped at 32768 tokens (about 750 MB for SmolLM2-135M in float16);
    past that, requests wait for room, as the engine's do for blocks.
    """
    reqs = [r for wl in workloads for r in wl.requests]
    want = max(sum(len(r.prompt_ids) + r.max_tokens for r in wl.requests) for wl in workloads)
    n_ctx = min(32768, max(4096, -(-want // 256) * 256))
    n_batch = min(n_ctx, max(2048, max(len(r.prompt_ids) for r in reqs) + max_num_seqs))
    return (LlamaCppProcess if isolated else LlamaCpp)(gguf_path(model), threads, max_num_seqs, n_ctx, n_batch, gpu)


def run_llama_cpp(peer: Peer, tok: Tokenizer, wl: Workload, max_num_seqs: int | None = None) -> SystemResult:
    """The workload through llama.cpp, continuous batching over sequence ids; greedy, the workload's token ids.

    Requests join at their ``arrival_s``, and those the workload injects at an
    engine step after that many of llama.cpp's steps (:meth:`LlamaCpp.serve_requests`,
    run where llama.cpp runs: no pipe inside a timed step).
    """
    seats = min(max_num_seqs or peer.max_num_seqs, peer.max_num_seqs)
    for r in wl.requests:
        if len(r.prompt_ids) + r.max_tokens > peer.n_ctx or len(r.prompt_ids) + seats > peer.n_batch:
            raise ValueError(f"a request of {len(r.prompt_ids)} prompt tokens and {r.max_tokens} new does not fit "
                             f"llama.cpp's n_ctx={peer.n_ctx} / n_batch={peer.n_batch}: make LlamaCpp larger")
    result = SystemResult(NAME, len(wl.requests), 0, 0.0,
                          note=f"llama.cpp {peer.version} on {peer.device}, {seats} sequences at most, no prefix cache")
    requests = [(list(r.prompt_ids), r.max_tokens, r.arrival_s, r.arrival_step) for r in wl.requests]
    result.seconds, served = peer.serve_requests(requests, None if wl.ignore_eos else tok.eos_token_id, seats)
    for arrival, times, tokens in served:
        result.output_tokens += len(tokens)
        result.outputs.append(tokens)
        result.texts.append(tok.decode(tokens))
        add_latencies(result, arrival, times)
        result.timings.append((arrival, times))
    return result


def decode_step_time(peer: Peer, tok: Tokenizer, batch: int, new_tokens: int) -> float:
    """Median time of llama.cpp's pure decode steps with ``batch`` sequences: :func:`roofline.decode_step_time`'s twin.

    The same prompts (the first ``batch`` chats of :data:`QUESTIONS`), prefilled
    together, then ``new_tokens`` greedy steps of one token per sequence.
    """
    prompts = [chat_prompt(tok, QUESTIONS[i % len(QUESTIONS)]) for i in range(batch)]
    return statistics.median(peer.step_times(prompts, new_tokens))


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


def llama_cpp_effect(peer: Peer, model: Transformer, tok: Tokenizer, quick: bool,
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
            "device": peer.device, "cpu": cpu_label(cpu_info()),
            "version": peer.version, "gguf": peer.path.name, "format": gguf_format(peer.path),
            "engine_format": engine_format(model),
            "fast_single_stream_tok_per_s": best.get("fast_b1"), "fast_format": fast_format,
            "fast_single_stream_ratio": best["fast_b1"] / best["llama_cpp_b1"] if "fast_b1" in best else None,
            "fast_decode_b32_tok_per_s": best.get("fast_b32"), "fast_b32_format": fast_b32_format,
            "fast_decode_b32_ratio": best["fast_b32"] / best["llama_cpp_b32"] if "fast_b32" in best else None}

