"""The ``compile`` section: decode steps through torch.compile against the eager engine (chapter 14)."""
from __future__ import annotations

from enginelib.bench.results import sync_device
from enginelib.bench.spec_decode import decode_seconds
from enginelib.bench.workloads import QUESTIONS, chat_prompt
from enginelib.config import CompileConfig, EngineConfig, SamplingParams
from enginelib.core.engine import Engine
from enginelib.core.outputs import RequestOutput
from enginelib.model.tokenizer import Tokenizer
from enginelib.model.transformer import Transformer
from enginelib.speed.compiled import compile_unavailable


def _decode(engine: Engine, prompts: list[list[int]], max_tokens: int, batch: int) -> tuple[float, list[list[int]]]:
    """Greedy decode tok/s (the union of the requests' decode spans) and the tokens, ``batch`` requests at a time."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    finals: dict[str, RequestOutput] = {}
    ids: list[str] = []
    for start in range(0, len(prompts), batch):
        ids += [engine.add_request(p, params) for p in prompts[start:start + batch]]
        while engine.has_unfinished_requests():
            finals |= {out.request_id: out for out in engine.step() if out.finished}
    sync_device(engine.model)
    outs = [finals[i] for i in ids]
    times = [o.metrics.token_times for o in outs]
    return sum(len(t) - 1 for t in times) / decode_seconds(times), [o.outputs[0].token_ids for o in outs]


def compile_effect(model: Transformer, tok: Tokenizer, quick: bool) -> dict:
    """Compiled decode tok/s ÷ eager, greedy, same prompts: at batch 1, and at batch 8 in the full run.

    Both run the model as loaded; the eager one with its oneDNN-packed linears
    on a CPU (the fastest eager path), the compiled one with the weights frozen
    and packed by inductor for the same oneDNN kernels (unfrozen, its float32
    matmuls are torch's default ones, slower than eager on the book's CPU), built
    for batch 1 (and 8) when the engine is: ``compile_seconds``.
    On a GPU the same is measured again with CUDA graphs (``cuda_graphs``).
    """
    reason = compile_unavailable(model.device)
    if reason:
        return {"unavailable": reason}
    n, new = (2, 16) if quick else (4, 64)
    sizes = (1,) if quick else (1, 8)
    chats = [chat_prompt(tok, q) for q in QUESTIONS[:8]]
    eager = Engine(model, tok, EngineConfig())
    _decode(eager, chats[:1], 4, 1)  # one-off costs out of the measurement
    report = _against_eager(eager, Engine(model, tok, EngineConfig(compile=CompileConfig(batch_sizes=sizes, freeze=True))),
                            chats, n, new)
    if model.device.type == "cuda":
        graphs = CompileConfig(batch_sizes=sizes, mode="reduce-overhead")
        report["cuda_graphs"] = _against_eager(eager, Engine(model, tok, EngineConfig(compile=graphs)), chats, n, new)
    return report


def _against_eager(eager: Engine, fast: Engine, chats: list[list[int]], n: int, new: int) -> dict:
    sizes = fast.runner.compiled.config.batch_sizes
    _decode(fast, chats[:1], 4, 1)
    report: dict = {"batch_sizes": list(sizes), "mode": fast.runner.compiled.config.mode, "max_tokens": new,
                    "compile_seconds": {str(b): s for b, s in fast.runner.compile_report.seconds.items()}}
    for batch, prompts in ((1, chats[:n]), (8, chats[:8])):
        if batch not in sizes:
            continue
        eager_rate, eager_tokens = _decode(eager, prompts, new, batch)
        fast_rate, fast_tokens = _decode(fast, prompts, new, batch)
        report[f"speedup_b{batch}"] = fast_rate / eager_rate
        report[f"tok_per_s_b{batch}"] = fast_rate
        report[f"tok_per_s_eager_b{batch}"] = eager_rate
        report[f"tokens_equal_b{batch}"] = sum(a == b for a, b in zip(eager_tokens, fast_tokens)) / len(prompts)
    report["compiled_steps"] = sum(fast.runner.compiled.calls.values())
    return report
