"""``python -m enginelib.bench``: every system on the same workload, in one process.

Ratios measured side by side in one process hold on a noisy machine where
absolute numbers do not. The run also measures the machine itself (matmul
peak, memory bandwidth) so the engine can be placed against its limits.

    python -m enginelib.bench --quick --json bench.json        # the core, under a minute on 2 cores
    python -m enginelib.bench --quick --sections quant,compile   # plus two slow sections
    python -m enginelib.bench --workload seed --systems naive,static,engine
    python -m enginelib.bench --endpoint http://127.0.0.1:8000/v1 --systems engine,endpoint

``--endpoint`` drives any OpenAI-compatible server (ours, vLLM, llama.cpp's)
with the same workload, as one more system. The ``serve`` section starts our
own server on the same engine config and compares its throughput under
concurrent streams with the offline engine's: the cost of HTTP and SSE.
The ``spec_decode`` section runs the engine with and without speculation (an int4 draft, n-gram lookup;
chapter 15), the ``quant`` section the int8 and int4 models
against the float one (chapter 13): speed ratios and perplexity.
These slow sections (and ``hf``: transformers' ``hf_static`` system and its
single stream, ``compile``, ``llama_cpp``) all run in a full run and
none with ``--quick``, which keeps the core (systems, roofline, prefix cache,
chunked prefill, structured output's mask, KV waste); ``--sections`` picks them. Each part of the run
prints a progress line with its seconds to stderr.

The package, in the order a run uses it:

- :mod:`.workloads`: the request lists (same token ids for every system);
- :mod:`.results`: :class:`SystemResult`, latencies, the same-tokens check;
- :mod:`.systems`: naive, contiguous cache, static batches, the engine;
  :mod:`.hf` (transformers), :mod:`.endpoint` (any OpenAI-compatible server, driven by :mod:`.loadgen`, the
  load generator that chapter 11 points at servers too);
- :mod:`.roofline`: the machine's limits and decode against them;
  :mod:`.profile`: where a step's time goes; :mod:`.memory`: KV waste;
- sections: :mod:`.scheduling` (prefix cache, chunked prefill, latency curve), :mod:`.structured` (a
  grammar's token mask against the step), :mod:`.serving`, :mod:`.spec_decode`, :mod:`.quantization` (with :mod:`.quality`: perplexity, greedy
  agreement, bytes per weight), :mod:`.compilation`, :mod:`.llama_cpp`;
- :mod:`.report` (tables, ratios) and :mod:`.cli` (``main``; ``__main__`` calls it).
"""
from enginelib.bench.cli import main
from enginelib.bench.endpoint import ENDPOINT, run_endpoint, served_model_name
from enginelib.bench.hf import hf_single_stream, load_hf, run_hf_static
from enginelib.bench.memory import concurrency, kv_waste
from enginelib.bench.profile import OP_KINDS, PHASES, REST, profile_steps
from enginelib.bench.quantization import int4_model, quant_effect
from enginelib.bench.results import SystemResult
from enginelib.bench.roofline import decode_flops_per_token, decode_step_time, matmul_peak, read_bandwidth
from enginelib.bench.scheduling import chunked_prefill_effect, latency_curve, prefix_cache_effect
from enginelib.bench.serving import serve_args, serve_effect
from enginelib.bench.spec_decode import SpecRun, decode_seconds, run_spec, spec_decode_effect
from enginelib.bench.systems import SYSTEMS, run_engine, run_one_at_a_time, run_static
from enginelib.bench.workloads import (
    QUESTIONS,
    WORKLOADS,
    BenchRequest,
    Workload,
    chat_prompt,
    extractive_prompts,
    make_workload,
)
from enginelib.config import EngineConfig

__all__ = [
    "ENDPOINT", "OP_KINDS", "PHASES", "QUESTIONS", "REST", "SYSTEMS", "WORKLOADS", "BenchRequest", "EngineConfig",
    "SpecRun", "SystemResult", "Workload", "chat_prompt", "chunked_prefill_effect", "concurrency",
    "decode_flops_per_token", "decode_seconds", "decode_step_time", "extractive_prompts", "hf_single_stream",
    "int4_model", "kv_waste", "latency_curve", "load_hf", "main", "make_workload", "matmul_peak", "prefix_cache_effect",
    "profile_steps", "quant_effect", "read_bandwidth", "run_endpoint", "run_engine", "run_hf_static",
    "run_one_at_a_time", "run_spec", "run_static", "serve_args", "serve_effect", "served_model_name",
    "spec_decode_effect",
]
