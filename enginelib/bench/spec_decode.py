"""The ``spec_decode`` section: the engine with and without speculation, by a draft model and by n-gram lookup (chapter 15)."""
from __future__ import annotations

from dataclasses import dataclass, replace

from enginelib.bench.results import sync_device
from enginelib.bench.workloads import QUESTIONS, chat_prompt, extractive_prompts
from enginelib.config import CompileConfig, EngineConfig, SamplingParams, SchedulerConfig, SpeculativeConfig
from enginelib.core.engine import Engine
from enginelib.core.outputs import RequestOutput
from enginelib.core.runner import SpecStats
from enginelib.model.tokenizer import Tokenizer
from enginelib.model.transformer import Transformer
from enginelib.speed.compiled import compile_unavailable
from enginelib.speed.speculative import compile_draft_unavailable


def decode_seconds(token_times: list[list[float]]) -> float:
    """Seconds during which some request was decoding: the union of each request's [first token, last token].

    One request at a time, that is the sum of their decode spans; a batch
    decoding together counts its shared time once. Prefill (before a request's
    first token) and gaps between requests are left out, with or without speculation alike.
    """
    spans = sorted((t[0], t[-1]) for t in token_times if len(t) > 1)
    total, end = 0.0, -float("inf")
    for a, b in spans:
        if b > end:
            total += b - max(a, end)
            end = b
    return total


@dataclass
class SpecRun:
    """One engine run of a prompt set: its greedy texts, decode speed and guess counters."""

    texts: list[str]
    decode_tok_per_s: float
    stats: SpecStats


def run_spec(model: Transformer, tok: Tokenizer, prompts: list[list[int]], max_tokens: int, batch: int,
             speculative: SpeculativeConfig | None) -> SpecRun:
    """All ``prompts`` through one engine, at most ``batch`` running at once (1: one request at a time), greedy."""
    config = EngineConfig(speculative=speculative, scheduler=SchedulerConfig(max_num_seqs=batch))
    return run_on(Engine(model, tok, config), prompts, max_tokens)


def run_on(engine: Engine, prompts: list[list[int]], max_tokens: int) -> SpecRun:
    """All ``prompts`` through ``engine`` (built once, e.g. compiled, and run again), greedy; the guess
    counters are this run's alone."""
    before = replace(engine.runner.spec_stats)
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    ids = [engine.add_request(p, params) for p in prompts]
    finals: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests():
        finals |= {out.request_id: out for out in engine.step() if out.finished}
    sync_device(engine.model)
    outs = [finals[i] for i in ids]
    times = [o.metrics.token_times for o in outs]
    decoded = sum(len(t) - 1 for t in times)
    stats = engine.runner.spec_stats
    run_stats = SpecStats(stats.verifications - before.verifications, stats.proposed - before.proposed,
                          stats.accepted - before.accepted)
    return SpecRun([o.outputs[0].text for o in outs], decoded / decode_seconds(times), run_stats)


def _spec_compare(model: Transformer, tok: Tokenizer, prompts: list[list[int]], max_tokens: int, batch: int,
                  spec: SpeculativeConfig) -> tuple[SpecRun, SpecRun]:
    """The same prompts without, then with speculation."""
    return (run_spec(model, tok, prompts, max_tokens, batch, None),
            run_spec(model, tok, prompts, max_tokens, batch, spec))


def _pooled(a: SpecRun, b: SpecRun) -> SpecRun:
    """Two runs of the same prompts as one: their tokens over their seconds (equal tokens: the harmonic mean)."""
    return SpecRun(a.texts, 2 / (1 / a.decode_tok_per_s + 1 / b.decode_tok_per_s), a.stats)


def _spec_figures(plain: SpecRun, spec: SpecRun) -> dict:
    return {"speedup": spec.decode_tok_per_s / plain.decode_tok_per_s, "tok_per_s": spec.decode_tok_per_s,
            "tok_per_s_plain": plain.decode_tok_per_s, "acceptance": spec.stats.acceptance_rate,
            "mean_accepted_length": spec.stats.mean_accepted_length, "proposed": spec.stats.proposed,
            "accepted": spec.stats.accepted,
            "texts_equal": sum(a == b for a, b in zip(plain.texts, spec.texts)) / len(plain.texts)}


def spec_decode_effect(model: Transformer, tok: Tokenizer, quick: bool, k: int, draft: Transformer,
                       draft_format: str) -> dict:
    """Decode speed with speculation ÷ without, greedy, same prompts and max_tokens.

    The headline: batch 1 (one request at a time) on the seed workload's chats,
    with ``draft`` (our model quantized, chapter 13) proposing, its one-token steps
    compiled where they can be (``compile_draft``: a CPU with a C++ compiler; eager in a quick run). Then n-gram
    lookup on the same chats, the same at batch 8, where a plain step is no
    longer bound by reading the weights, so the extra verified rows cost more and
    the gain shrinks, and on extractive prompts (copy a passage), the case prompt
    lookup is made for.
    """
    ngram = SpeculativeConfig(method="ngram", num_speculative_tokens=k)
    # the draft's one-token steps compiled, where they can be; not in a quick run, where compiling them would take
    # most of the section's time (tests/test_speculative.py and chapter 15 compile them)
    compiled = not quick and compile_draft_unavailable(draft) is None
    drafted = SpeculativeConfig(method="draft", num_speculative_tokens=k, draft_model=draft, compile_draft=compiled)
    draft_format += ", compiled" if compiled else ""
    n, new, new8, n_ext = (2, 24, 12, 1) if quick else (8, 128, 64, 4)
    chats = [chat_prompt(tok, q) for q in QUESTIONS[:max(n, 8)]]
    copy = extractive_prompts(tok, n_ext)
    for cfg in (None, ngram, drafted):  # one-off costs out of the measurement: a short run of each, guesses included
        run_spec(model, tok, copy[:1], 6, 1, cfg)
    before = run_spec(model, tok, chats[:n], new, 1, None)
    with_draft = run_spec(model, tok, chats[:n], new, 1, drafted)
    with_ngram = run_spec(model, tok, chats[:n], new, 1, ngram)
    plain = _pooled(before, run_spec(model, tok, chats[:n], new, 1, None))  # before and after: a slow spell counts on both sides
    b1, lookup = _spec_figures(plain, with_draft), _spec_figures(plain, with_ngram)
    plain8, fast8 = _spec_compare(model, tok, chats[:8], new8, 8, ngram)
    b8 = _spec_figures(plain8, fast8)
    ext_plain, ext_fast = _spec_compare(model, tok, copy, new, 1, ngram)
    extractive = _spec_figures(ext_plain, ext_fast)
    compiled_target = None
    if not quick and compile_unavailable(model.device) is None:
        compiled_target = compiled_target_effect(model, tok, chats[:n], new, drafted)
    return {"speedup_b1": b1.pop("speedup"), **b1, "k": k, "method": "draft", "draft": draft_format,
            "prompts": n, "max_tokens": new,
            "ngram": {"speedup_b1": lookup.pop("speedup"), **lookup, "speedup_b8": b8["speedup"],
                      "texts_equal_b8": b8["texts_equal"], "acceptance_b8": b8["acceptance"]},
            "extractive": {"speedup_b1": extractive.pop("speedup"), **extractive, "method": "ngram",
                           "prompts": n_ext},
            **({"compiled_target": compiled_target} if compiled_target else {}),
            "note": "seed-workload chats, greedy, stop at EOS; the draft is the target quantized, with a KV cache "
                    "of its own; n-gram lookup finds little to copy in a chat answer, so its gain there is small: "
                    "'extractive' (copy a passage) is the case it is made for"}


def compiled_target_effect(model: Transformer, tok: Tokenizer, prompts: list[list[int]], max_tokens: int,
                           speculative: SpeculativeConfig) -> dict:
    """The batch-1 speedup again with the target's steps compiled on both sides, so that speculation is
    weighed against the fastest plain decode of the same model rather than the eager one.

    Plain decode compiles one bucket of 1 token; the speculative engine one of ``k + 1`` tokens (a
    verification; a shorter one near ``max_tokens`` pads up to it). Both with the C++ wrapper and frozen
    weights (the bench's fastest single stream's settings). Plain runs before and after, as above.
    """
    k = speculative.num_speculative_tokens
    built = {}
    for name, spec, size in (("plain", None, 1), ("spec", speculative, k + 1)):
        compile = CompileConfig(batch_sizes=(size,), cpp_wrapper=True, freeze=True)
        built[name] = Engine(model, tok, EngineConfig(speculative=spec, compile=compile,
                                                      scheduler=SchedulerConfig(max_num_seqs=1)))
        run_on(built[name], prompts[:1], 6)  # compiles, and the other one-off costs, out of the measurement
    before = run_on(built["plain"], prompts, max_tokens)
    fast = run_on(built["spec"], prompts, max_tokens)
    plain = _pooled(before, run_on(built["plain"], prompts, max_tokens))
    figures = _spec_figures(plain, fast)
    return {"speedup_b1": figures.pop("speedup"), **figures,  # (a compile that failed ran eagerly: None, 0)
            "compile_seconds": {name: e.runner.compile_report and sum(e.runner.compile_report.seconds.values())
                                for name, e in built.items()},
            "compiled_steps": {name: e.runner.compiled and sum(e.runner.compiled.calls.values()) or 0 for name, e in built.items()}}
