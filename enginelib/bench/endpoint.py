"""Any OpenAI-compatible server as one more system: the workload as streamed completions."""
from __future__ import annotations

from typing import TYPE_CHECKING

from enginelib.bench.results import SystemResult
from enginelib.bench.workloads import Workload
from enginelib.model.tokenizer import Tokenizer

if TYPE_CHECKING:
    from enginelib.bench.loadgen import LoadResult

ENDPOINT = "endpoint"  # an OpenAI-compatible server at --endpoint, run only when one is given


def run_endpoint(url: str, served_model: str, tok: Tokenizer, wl: Workload, concurrency: int,
                 text_prompts: bool = False, name: str = ENDPOINT) -> SystemResult:
    """The workload through an OpenAI-compatible server: streamed completions, timed as the client sees them.

    Prompts go to ``/v1/completions`` as the workload's own token ids, so the
    server computes exactly the tokens the other systems do (no chat template
    applied twice, no re-tokenizing drift); ours and vLLM take token-id prompts.
    ``text_prompts`` sends the decoded text instead, for a server whose
    tokenizer differs. Requests arrive at their ``arrival_s``; one the workload
    injects at an engine step cannot be timed so over HTTP and is sent at the
    start. At most ``concurrency`` are in flight; waiting for a free slot counts
    in a request's TTFT, as waiting in the engine's queue does.
    """
    from enginelib.bench.loadgen import run_load_sync  # imported when used: it pulls in the openai client

    prompts = [tok.decode(r.prompt_ids) if text_prompts else r.prompt_ids for r in wl.requests]
    arrivals = [r.arrival_s for r in wl.requests]
    extra = {"ignore_eos": True} if wl.ignore_eos else {}
    load = run_load_sync(url, served_model, prompts, [r.max_tokens for r in wl.requests], concurrency=concurrency,
                         arrivals=arrivals if any(arrivals) else None, **extra)
    return _endpoint_result(name, wl, load)


def _endpoint_result(name: str, wl: Workload, load: LoadResult) -> SystemResult:
    result = SystemResult(name, len(wl.requests), load.output_tokens, load.duration,
                          note=f"{load.concurrency} streams at most")
    result.texts = [t.text for t in load.timings]  # in request order; a failed request's is empty
    for t in load.ok:
        if t.token_times:  # latencies from when the request was due, as run_engine counts from arrival
            result.ttft.append(t.token_times[0] - t.due)
            result.e2e.append(t.token_times[-1] - t.due)
        if t.tpot is not None:  # a chunk may carry several tokens: TPOT is over the tokens the server counted
            result.tpot.append(t.tpot)
        result.itl += t.itl
    if stepped := sum(r.arrival_step > 0 for r in wl.requests):
        result.note += f"; {stepped} requests injected at an engine step were sent at the start"
    if load.errors:
        result.note += f"; {len(load.errors)} requests failed, first: {load.errors[0]}"
    return result


def served_model_name(url: str) -> str:
    """The model an OpenAI-compatible server serves (the first its ``/v1/models`` lists)."""
    import openai

    models = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=30).models.list().data
    if not models:
        raise ValueError(f"{url}/models lists no model: pass --served-model NAME")
    return models[0].id
