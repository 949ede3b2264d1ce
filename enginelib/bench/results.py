"""What one system did on one workload (:class:`SystemResult`), how latencies are counted, and the
check that every system produced the same greedy tokens."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from enginelib.model.checks import check_greedy, float32_reference
from enginelib.model.transformer import Transformer

if TYPE_CHECKING:
    from enginelib.bench.workloads import Workload


@dataclass
class SystemResult:
    """What one system did on one workload: throughput and per-request latencies (seconds)."""

    name: str
    requests: int
    output_tokens: int
    seconds: float
    ttft: list[float] = field(default_factory=list)
    tpot: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)  # every gap between two tokens of a request
    e2e: list[float] = field(default_factory=list)
    note: str = ""
    prefix_hit_rate: float | None = None  # the engine's, when it caches prefixes
    outputs: list[list[int]] = field(default_factory=list, repr=False)
    texts: list[str] = field(default_factory=list, repr=False)  # the engine's and an endpoint's, to compare
    timings: list[tuple[float, list[float]]] = field(default_factory=list, repr=False)  # (arrival, token times)

    @property
    def tok_per_s(self) -> float:
        return self.output_tokens / self.seconds

    def goodput(self, ttft_s: float, tpot_s: float) -> float:
        """Requests per second that met both targets, as ``vllm bench serve --goodput ttft:MS tpot:MS``
        counts them: throughput says what the machine did, goodput what users were served within their
        patience. Needs ``timings`` (the engine and llama.cpp runners record them)."""
        met = 0
        for arrival, times in self.timings:
            tpot = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else 0.0
            met += times[0] - arrival <= ttft_s and tpot <= tpot_s
        return met / self.seconds

    def summary(self) -> dict:
        return {"tok_per_s": self.tok_per_s, "output_tokens": self.output_tokens, "seconds": self.seconds,
                "requests": self.requests,
                "ttft_p50_s": nearest_rank(self.ttft, 50), "ttft_p99_s": nearest_rank(self.ttft, 99),
                "tpot_p50_s": nearest_rank(self.tpot, 50), "tpot_p99_s": nearest_rank(self.tpot, 99),
                "itl_p99_s": nearest_rank(self.itl, 99), "prefix_hit_rate": self.prefix_hit_rate,
                "e2e_p50_s": nearest_rank(self.e2e, 50), "note": self.note}


def nearest_rank(values: list[float], q: float) -> float | None:
    """Nearest rank (:func:`loadgen.percentile`): every percentile reported is a latency that was measured."""
    from enginelib.bench.loadgen import percentile  # imported when used: the loader pulls in the openai client

    return percentile(values, q)


def add_latencies(result: SystemResult, arrival: float, token_times: list[float]) -> None:
    """Add one request's TTFT, TPOT and end-to-end latency (absolute perf_counter times)."""
    result.ttft.append(token_times[0] - arrival)
    if len(token_times) > 1:
        result.tpot.append((token_times[-1] - token_times[0]) / (len(token_times) - 1))
        result.itl += [b - a for a, b in zip(token_times, token_times[1:])]
    result.e2e.append(token_times[-1] - arrival)


def same_texts(a: SystemResult, b: SystemResult) -> float | None:
    """Fraction of requests whose texts are equal (greedy: the server must say what the engine says)."""
    n = min(len(a.texts), len(b.texts))
    return sum(x == y for x, y in zip(a.texts, b.texts)) / n if n else None


def sync_device(model: Transformer) -> None:
    """Wait for the model's device: a CUDA kernel still running must count in the time taken."""
    if model.device.type == "cuda":
        torch.cuda.synchronize()


def check_same_tokens(model: Transformer, wl: Workload, results: dict[str, SystemResult]) -> None:
    """Every system must produce the same greedy tokens per request: note any that differ.

    The oracle (``kv_cache``, else ``naive``) is slow, so it serves only the first few requests; the
    rest are checked against the static batcher (chapter 4), which serves them all. Identical, or
    diverging only at a near-tie of the float32 reference (:func:`checks.check_greedy`):
    transformers' kernels, or float16, may round a close call the other way. A real difference is
    noted ("differs").
    """
    oracle = results.get("kv_cache") or results.get("naive")
    if oracle is None:
        return
    wide = results.get("static")
    spans = []  # (system, against, first request, end)
    for r in results.values():
        n = min(len(oracle.outputs), len(r.outputs))
        if r is not oracle:
            spans.append((r, oracle, 0, n))
            if wide is not None and r is not wide and min(len(wide.outputs), len(r.outputs)) > n:
                spans.append((r, wide, n, min(len(wide.outputs), len(r.outputs))))
    reference = None  # a float32 copy, made once, only if some system diverges
    for r, ref, lo, hi in spans:
        if r.outputs[lo:hi] == ref.outputs[lo:hi]:
            continue
        if reference is None:
            reference = float32_reference(model)
        prompts = [req.prompt_ids for req in wl.requests[lo:hi]]
        try:
            verdict = check_greedy(model, prompts, r.outputs[lo:hi], ref.outputs[lo:hi], reference=reference)
            r.note += f"; {len(verdict.near_ties)} of {hi - lo} requests diverge from {ref.name} at a near-tie"
        except AssertionError as err:
            r.note += f"; differs from {ref.name}: {err}".split(". ")[0]
