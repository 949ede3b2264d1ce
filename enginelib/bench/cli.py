"""``python -m enginelib.bench``: every system on the same workload, in one process.

The command line: parse the flags, load the model (and start our server for
the ``serve`` section), run every system on every workload, then the sections,
and write the report.

The core (the systems on the workloads, the machine's roofline, prefix cache,
chunked prefill, structured output's mask, KV waste) always runs. The slow sections (:data:`SLOW_SECTIONS`:
transformers, our server, speculative decoding, quantization, torch.compile,
llama.cpp) all run in a full run and none with ``--quick``; ``--sections`` picks
them either way.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import torch

from enginelib.baselines.generate import generate_cached, generate_naive
from enginelib.bench import llama_cpp as llama
from enginelib.bench import llama_cpp_tools as tools
from enginelib.bench.child import ChildCrashed
from enginelib.bench.compilation import compile_effect
from enginelib.bench.cpu import cpu_info, cpu_label
from enginelib.bench.endpoint import ENDPOINT, run_endpoint, served_model_name
from enginelib.bench.hf import load_hf, run_hf_static
from enginelib.bench.memory import concurrency, kv_waste
from enginelib.bench.quantization import int4_model, quant_effect
from enginelib.bench.report import print_summary, print_table, progress, throughput_ratios
from enginelib.bench.results import SystemResult, check_same_tokens, same_texts
from enginelib.bench.roofline import (decode_read_bytes, decode_step_time, engine_decode_step_time, read_bandwidth,
                                      roofline_figures)
from enginelib.bench.scheduling import chunked_prefill_effect, prefix_cache_effect
from enginelib.bench.serving import refused_flood_effect, serve_args, serve_effect, split_cpus
from enginelib.bench.spec_decode import spec_decode_effect
from enginelib.bench.structured import structured_effect
from enginelib.bench.systems import SYSTEMS, run_engine, run_one_at_a_time, run_static
from enginelib.bench.workloads import WORKLOADS, BenchRequest, Workload, chat_prompt, make_workload
from enginelib.config import CompileConfig, EngineConfig, SchedulerConfig
from enginelib.core.engine import Engine
from enginelib.model.device import PackedLinear, pick_device, set_threads
from enginelib.model.tokenizer import Tokenizer
from enginelib.model.transformer import Transformer
from enginelib.model.weights import DEFAULT_MODEL, load_model
from enginelib.speed import cpu_kernels
from enginelib.speed.compiled import compile_unavailable
from enginelib.speed.fused_step import fused_step_unavailable
from enginelib.speed.quant import kernel_unavailable, load_quantized, quant_info

T = TypeVar("T")
# Opt-in with --quick. "hf" is the hf_static system and transformers' single stream: loading transformers
# takes longer than all the rest of a quick run on a 2-core CPU.
SLOW_SECTIONS = ("hf", "serve", "spec_decode", "quant", "compile", llama.NAME)


def offered_sections() -> tuple[str, ...]:
    """The slow sections this machine can run: llama.cpp's only where llama-cpp-python imports."""
    return tuple(s for s in SLOW_SECTIONS if s != llama.NAME or llama.available())

if TYPE_CHECKING:
    from enginelib.serve import ServerProcess  # imported when used: the server stack is not needed offline


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m enginelib.bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="small workloads and the core sections only (under a minute on a 2-core CPU); "
                         "add slow sections with --sections")
    ap.add_argument("--workload", default="seed", help=f"comma-separated, from {', '.join(WORKLOADS)}, or 'all'")
    offered = SYSTEMS + ((llama.NAME,) if llama.available() else ())  # llama.cpp's only where it imports
    slow = offered_sections()
    ap.add_argument("--systems", default=None,
                    help=f"comma-separated, from {', '.join(offered)} (default: {', '.join(SYSTEMS)}"
                         + (f", and {llama.NAME} when its section runs)" if llama.NAME in offered else ")"))
    ap.add_argument("--sections", default=None, metavar="LIST",
                    help=f"the slow sections to run, comma-separated from {', '.join(slow)}, or 'all' or 'none' "
                         "(default: all in a full run, none with --quick); the core (systems, roofline, prefix "
                         "cache, chunked prefill, structured output, KV waste) always runs")
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    ap.add_argument("--dtype", default=None, choices=["float32", "float16", "bfloat16"])
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: $ENGINELIB_THREADS or <= 4)")
    ap.add_argument("--no-pack", action="store_true", help="keep torch's default CPU matmul (no oneDNN packing)")
    ap.add_argument("--decode-kernel", action="store_true",
                    help="decode steps attend in the fused kernel (C++ on a float32 CPU, Triton on a GPU)")
    ap.add_argument("--batch-size", type=int, default=8, help="B for the static systems")
    ap.add_argument("--max-num-seqs", type=int, default=64, help="the engine's running-request limit")
    ap.add_argument("--rate", type=float, default=2.0, help="Poisson arrivals per second")
    ap.add_argument("--max-len", type=int, default=2048, help="what a contiguous cache reserves per request")
    ap.add_argument("--naive-requests", type=int, default=None,
                    help="serve only this many requests with naive (twice as many with kv_cache: they are slow); "
                         "default 1 quick, 4 full")
    ap.add_argument("--no-prefix-caching", action="store_true", help="the engine without its prefix cache")
    ap.add_argument("--no-chunked-prefill", action="store_true", help="the engine prefills each prompt in one step")
    ap.add_argument("--chunk-budget", type=int, default=256,
                    help="the token budget per step in the chunked-prefill comparison")
    ap.add_argument("--endpoint", default=None, metavar="URL",
                    help="also run the workload through this OpenAI-compatible server (base URL, e.g. "
                         "http://127.0.0.1:8000/v1), reported as the system 'endpoint'")
    ap.add_argument("--served-model", default=None, metavar="NAME",
                    help="the model name to send to --endpoint (default: the first its /v1/models lists)")
    ap.add_argument("--text-prompts", action="store_true",
                    help="send --endpoint the prompts as text, not token ids (a server with another tokenizer)")
    ap.add_argument("--concurrency", type=int, default=32, help="streams in flight at most, for --endpoint and serve")
    ap.add_argument("--spec-k", type=int, default=4, help="guesses per step in the spec_decode section")
    ap.add_argument("--quant-kernel", default=None,
                    help="the kernel quantize() uses: auto (time the candidates per weight shape; the default "
                         "in full runs) or a name from enginelib.speed.quant.KERNELS; --quick defaults to cpp (our C++ "
                         "kernels) where they build, else reference, since timing the candidates takes about "
                         "10 s per format on a 2-core CPU")
    ap.add_argument("--llama-cpp-bin", type=Path, action="append", default=None, metavar="DIR",
                    help="also compare with llama.cpp's own llama-bench and llama-batched-bench in DIR (build them "
                         "with .ci/build_llama_cpp.sh), on the same GGUF and threads: single-stream and batch-32 "
                         "decode, with their build flags; needs no llama-cpp-python. Given more than once (several "
                         "builds), each batch size is compared with the build fastest at it")
    ap.add_argument("--json", type=Path, default=None, help="write every figure to this file")
    args = ap.parse_args(argv)
    if args.spec_k < 1:
        ap.error(f"--spec-k must be at least 1 (guesses per step), got {args.spec_k}")
    from enginelib.speed.quant import KERNELS

    if args.quant_kernel is not None and args.quant_kernel not in ("auto", *KERNELS):
        ap.error(f"unknown --quant-kernel {args.quant_kernel!r}; choose from auto, {', '.join(KERNELS)}")

    sections = parse_sections(ap, args.sections, args.quick)
    systems = tuple(args.systems.split(",")) if args.systems else (
        tuple(s for s in SYSTEMS if s != "hf_static" or "hf" in sections)
        + ((llama.NAME,) if llama.NAME in sections and llama.available() else ()))
    if args.endpoint and ENDPOINT not in systems:
        systems += (ENDPOINT,)
    for s in systems:
        if s == llama.NAME and (why := llama.import_error()):
            ap.error(f"--systems {llama.NAME} needs llama-cpp-python, which does not import here ({why}): "
                     f"{llama.INSTALL}")
        if s not in offered + (ENDPOINT,):
            ap.error(f"unknown system {s!r}; choose from {', '.join(offered + (ENDPOINT,))}")
    if llama.NAME in systems:  # the peer is its section: asked for as a system, its comparisons run too
        sections.add(llama.NAME)
    if "hf_static" in systems:  # the same for transformers
        sections.add("hf")
    if ENDPOINT in systems and not args.endpoint:
        ap.error("the endpoint system needs --endpoint URL (an OpenAI-compatible server's base URL)")
    if args.concurrency < 1:
        ap.error(f"--concurrency must be at least 1, got {args.concurrency}")
    for bin_dir in args.llama_cpp_bin or ():
        if why := tools.tools_missing(bin_dir):
            ap.error(f"--llama-cpp-bin: {why}")
        try:
            llama.gguf_path(args.model)
        except ValueError as err:
            ap.error(f"--llama-cpp-bin: {err}")
    served = (args.served_model or served_model_name(args.endpoint)) if args.endpoint else None
    threads = set_threads(args.threads)
    device = pick_device(args.device)
    if args.quant_kernel is None and (sections & {"spec_decode", "quant", llama.NAME} or args.llama_cpp_bin):
        # quick_kernel builds C++
        args.quant_kernel = quick_kernel(device) if args.quick else "auto"
    config = EngineConfig(enable_prefix_caching=not args.no_prefix_caching, cpu_decode_kernel=args.decode_kernel,
                          scheduler=SchedulerConfig(args.max_num_seqs, 4096, not args.no_chunked_prefill))
    workloads = WORKLOADS if args.workload == "all" else tuple(args.workload.split(","))
    server = peer = crash = None
    if "serve" in sections:  # our server loads its model while we load ours; it idles until the serve section
        from enginelib.serve import ServerProcess

        cpus = split_cpus(threads)  # the engine core on its CPUs from the start: the serve section's split
        flags = serve_args(args, device, threads, config, args.concurrency, cpus[0] if cpus else None)
        server = ServerProcess(flags).launch()
    try:
        with progress("load the model" + (" (and start our server)" if server is not None else "")):
            model, tok = load_model(args.model, device=device, progress=False, pack=False if args.no_pack else None,
                                    dtype=getattr(torch, args.dtype) if args.dtype else None)
            if llama.NAME in systems:  # the same GGUF file, the same threads, in a child process
                try:
                    peer = llama.open_peer(args.model, threads, args.max_num_seqs,
                                           [make_workload(name, tok, args.quick, args.rate) for name in workloads],
                                           gpu=device.type == "cuda")
                except ChildCrashed as err:  # it died loading the file: the run goes on without it
                    crash = err
            if server is not None:
                server.wait_ready()  # healthy before anything is timed: its loading must not slow our measurements
        return _measure(args, sections, systems, served, threads, device, config, model, tok, server,
                        _Peer(peer, crash), workloads)
    finally:
        if server is not None:
            server.stop()  # also when our own load failed: a half-started server is terminated
        if peer is not None:
            peer.close()


def parse_sections(ap: argparse.ArgumentParser, value: str | None, quick: bool) -> set[str]:
    """The slow sections ``--sections`` names ('all', 'none', or a list); by default all, none with --quick."""
    if value is None:
        value = "none" if quick else "all"
    if value in ("all", "none"):
        return set(offered_sections()) if value == "all" else set()
    names = {s.strip() for s in value.split(",") if s.strip()}
    for name in sorted(names):
        if name == llama.NAME and (why := llama.import_error()):
            ap.error(f"--sections {llama.NAME} needs llama-cpp-python, which does not import here ({why}): "
                     f"{llama.INSTALL}")
        if name not in SLOW_SECTIONS:
            ap.error(f"unknown section {name!r}; choose from {', '.join(SLOW_SECTIONS)}, or all or none")
    return names


def small_model(model: Transformer, kernel: str, source: str | Path = DEFAULT_MODEL) -> tuple[Transformer, str]:
    """The model llama.cpp runs, and its format: the GGUF ``source`` as stored (:func:`quant.load_quantized`: the
    shipped file's Q4_1 layers as int4, its Q8_0 head as q8_0, the very bytes llama.cpp reads), or, for a
    checkpoint that is not such a file, the model quantized to that mix (int4 layers, int8 head); with
    integer-product kernels (``cpp_q8``, llama.cpp's way) where they build, else ``kernel``."""
    q8 = kernel_unavailable("cpp_q8", "int4", (32, 32), model.device) is None
    try:
        small, _ = load_quantized(source, "cpp_q8" if q8 else kernel, device=model.device, progress=False)
    except ValueError:  # not a GGUF, or its layers are not Q4_1/Q8_0
        return int4_model(model, kernel)
    kernels = ", ".join(sorted(set(quant_info(small).kernels.values())))
    return small, f"the GGUF as stored: int4 layers, q8_0 head ({kernels} kernels)"


def fastest_single_stream(small: Transformer, small_format: str, tok: Tokenizer) -> tuple[Engine, str]:
    """The engine as fast as it goes at batch 1, for the llama.cpp comparison: :func:`small_model`'s, each
    decode step in one C++ call (``fused_step``, llama.cpp's way) where the model allows, else compiled for
    batch 1 (on a CPU with inductor's C++ wrapper and the weights frozen into the graph) where compiling is
    available."""
    if fused_step_unavailable(small) is None:
        engine = Engine(small, tok, EngineConfig(scheduler=SchedulerConfig(1, 2048), fused_step=True))
        return engine, small_format + ", one C++ call a step"
    compile = None
    if compile_unavailable(small.device) is None:
        compile = CompileConfig(batch_sizes=(1,), cpp_wrapper=True, freeze=True)
    engine = Engine(small, tok, EngineConfig(scheduler=SchedulerConfig(1, 2048), compile=compile))
    return engine, small_format + (", compiled" if compile else "")


def fastest_batch32(model: Transformer, tok: Tokenizer, small: Transformer, small_format: str) -> tuple[Engine, str]:
    """The engine as fast as it goes with 32 sequences decoding, for the llama.cpp comparison: of the model as
    loaded (float32: at batch 32 the matmuls are compute-bound, where oneDNN is strong), decode compiled for
    batch 32 (on a CPU with the C++ wrapper and frozen weights) where compiling is available, and
    :func:`small_model` in one C++ call a step (integer products, 4 per VNNI instruction) where that runs,
    whichever decodes faster here: which one wins depends on the CPU, so both are timed (a short run each to
    warm up, then the better of two medians of 3 decode steps) and the format says by how much."""
    compile = None
    if compile_unavailable(model.device) is None:
        compile = CompileConfig(batch_sizes=(32,), cpp_wrapper=True, freeze=True)
    scheduler = SchedulerConfig(32, 2048)
    engine = Engine(model, tok, EngineConfig(scheduler=scheduler, compile=compile))
    float_side = engine, llama.engine_format(model) + (", compiled" if compile else "")
    if fused_step_unavailable(small) is not None:
        return float_side
    fused_side = Engine(small, tok, EngineConfig(scheduler=scheduler, fused_step=True)), small_format + \
        ", one C++ call a step"
    timed = []
    for engine, fmt in (float_side, fused_side):
        engine_decode_step_time(engine, tok, 32, 2)  # warm up (and compile)
        timed.append((min(engine_decode_step_time(engine, tok, 32, 4)[0] for _ in range(2)), fmt, engine))
    (fast, fast_format, engine), (slow, slow_format, _) = sorted(timed, key=lambda t: t[0])
    return engine, f"{fast_format}; faster here than {slow_format}: {fast * 1e3:.1f} vs {slow * 1e3:.1f} ms a step"


def quick_kernel(device: torch.device) -> str:
    """--quick's quantized kernel, untimed: our C++ one where it builds (on a CPU), else the reference."""
    return "cpp" if kernel_unavailable("cpp", "int8", (32, 32), device) is None else "reference"


def _measure(args: argparse.Namespace, sections: set[str], systems: tuple[str, ...], served: str | None,
             threads: int, device: torch.device, config: EngineConfig, model: Transformer, tok: Tokenizer,
             server: ServerProcess | None, peer: _Peer, workloads: tuple[str, ...]) -> dict:
    """Every system on every workload, then the sections; the report as a dict (and a JSON file)."""
    with progress("warm-up" + (" (loading transformers)" if "hf_static" in systems else "")):
        hf = load_hf(device, model.dtype) if "hf_static" in systems else None
        warm = Workload("warm-up", [BenchRequest(chat_prompt(tok, "hi"), 4)])
        run_engine(model, tok, warm, config)
        run_one_at_a_time("warm-up", generate_cached, model, tok, warm)
        peer.run(llama.run_llama_cpp, tok, warm)
    few = args.naive_requests or (1 if args.quick else 4)

    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None  # the GPU's name, in the summary too
    cpu = cpu_info()  # every ratio below holds for this CPU: the report names it with them
    report: dict = {"machine": {"torch": torch.__version__, "threads": threads, "device": str(device), "gpu": gpu,
                                "cpu": cpu, "cpu_label": cpu_label(cpu),
                                "dtype": str(model.dtype).removeprefix("torch."), "model": str(args.model),
                                "packed_linears": any(isinstance(m, PackedLinear) for m in model.modules()),
                                "quick": args.quick, "sections": sorted(sections),
                                "formats": {"engine": llama.engine_format(model),
                                            llama.NAME: llama.gguf_format(peer.peer.path) if peer.peer else None}},
                    "workloads": {}}
    for name in workloads:
        with progress(f"workload {name} ({', '.join(systems)})"):
            results = _run_systems(args, systems, served, config, model, tok, hf, peer, name, few)
        report["workloads"][name] = {s: r.summary() for s, r in results.items()}
        if name == workloads[0]:
            report["systems"] = report["workloads"][name]
            first = results
        print_table(name, results)

    report["ratios"] = throughput_ratios(report["systems"])
    if hf is None and "hf_static" in systems:
        report["notes"] = ["transformers is not installed: hf_static skipped"]
    with progress("roofline"):
        report |= roofline_figures(model, tok, hf, device, args.quick)
    if "engine" in systems:
        with progress("prefix_cache"):
            report["prefix_cache"] = prefix_cache_effect(model, tok, config, args.quick)
        with progress("chunked_prefill"):
            report["chunked_prefill"] = chunked_prefill_effect(model, tok, config, args.quick, args.chunk_budget)
        with progress("structured"):
            start = time.perf_counter()
            report["structured"] = structured_effect(model, tok, config, args.quick)
            report["structured"]["seconds"] = time.perf_counter() - start
    if server is not None:
        with progress("serve"):
            wl0 = make_workload(workloads[0], tok, args.quick, args.rate)
            cpus = split_cpus(threads)  # the split the server was started with
            report["serve"] = serve_effect(server, model, tok, wl0, config, args.concurrency, cpus)
            report["serve"]["refused_flood"] = refused_flood_effect(server, cpus, 16 if args.quick else 48)
        if args.no_pack:
            report["serve"]["note"] += "; the server packs its linears (serve has no --no-pack)"
    report["ratios"]["single_stream_vs_hf"] = report.pop("single_stream_vs_hf")
    report["ratios"] |= {"single_stream_vs_llama_cpp": None, "decode_b32_vs_llama_cpp": None}
    sides = _EngineSides(args, model, tok)  # the engine's side of the llama.cpp comparisons, built once
    if peer.alive:
        with progress(llama.NAME):
            peer.run(lambda p: _llama_cpp_section(args, report, tok, p, first, sides))
    if peer.crash is not None:  # reported, and the rest of the run went on without it
        report[llama.NAME] = peer.crash.summary() | {"cpu": report["machine"]["cpu_label"]}
        report.setdefault("notes", []).append(f"{peer.crash}; the rest of the benchmark ran without it")
    if args.llama_cpp_bin is not None:
        with progress(f"llama.cpp's tools ({', '.join(map(str, args.llama_cpp_bin))})"):
            _llama_cpp_tools_section(args, report, tok, threads, sides)
    if "spec_decode" in sections:
        with progress("spec_decode"):
            start = time.perf_counter()
            draft, draft_format = int4_model(model, args.quant_kernel)
            report["spec_decode"] = spec_decode_effect(model, tok, args.quick, args.spec_k, draft, draft_format)
            report["spec_decode"]["seconds"] = time.perf_counter() - start
    if "quant" in sections:
        with progress("quant"):
            start = time.perf_counter()
            report["quant"] = quant_effect(model, tok, args.quick, args.quant_kernel)
            report["quant"]["seconds"] = time.perf_counter() - start
    if "compile" in sections:
        with progress("compile"):
            start = time.perf_counter()
            report["compile"] = compile_effect(model, tok, args.quick)
            report["compile"]["seconds"] = time.perf_counter() - start
    engine_outputs = first["engine"].outputs if "engine" in first else None
    if engine_outputs:
        wl0 = make_workload(workloads[0], tok, args.quick, args.rate)
        report["kv_waste"] = kv_waste(wl0, config.block_size, args.max_len, engine_outputs)
        budget = concurrency(wl0, engine_outputs, config.block_size, args.max_len, budget_tokens=32 * args.max_len)
        report["concurrency"] = budget
        report["concurrency_ratio"] = budget["paged"] / budget["contiguous"]
    print_summary(report)
    if skipped := [s for s in offered_sections() if s not in sections]:
        print(f"slow sections not run: {', '.join(skipped)} (add them with --sections NAME,... or --sections all)")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2))
        print(f"wrote {args.json}")
    return report


def _run_systems(args: argparse.Namespace, systems: tuple[str, ...], served: str | None, config: EngineConfig,
                 model: Transformer, tok: Tokenizer, hf, peer: _Peer, name: str,
                 few: int) -> dict[str, SystemResult]:
    """Every system on workload ``name``, each checked against the kv_cache oracle's tokens."""
    wl = make_workload(name, tok, args.quick, args.rate)
    results: dict[str, SystemResult] = {}
    for system in systems:
        if system == "naive":
            results[system] = run_one_at_a_time("naive", generate_naive, model, tok, wl, few)
        elif system == "kv_cache":
            results[system] = run_one_at_a_time("kv_cache", generate_cached, model, tok, wl, 2 * few)
        elif system == "static":
            results[system] = run_static(model, tok, wl, args.batch_size)
        elif system == "hf_static" and hf is not None:
            results[system] = run_hf_static(hf, tok, wl, args.batch_size, model.device)
        elif system == "engine":
            results[system] = run_engine(model, tok, wl, config)
        elif system == ENDPOINT:
            results[system] = run_endpoint(args.endpoint, served, tok, wl, args.concurrency, args.text_prompts)
            if "engine" in results:
                same = same_texts(results[system], results["engine"])
                results[system].note += f"; {same:.0%} of texts equal the engine's"
        elif system == llama.NAME:
            if (ran := peer.run(llama.run_llama_cpp, tok, wl, args.max_num_seqs)) is None:
                continue  # llama.cpp crashed, now or before: the report says so
            results[system] = ran
            if "engine" in results:
                same = llama.agreement(results["engine"], results[system])["texts_equal"]
                results[system].note += (f"; {same:.0%} of outputs equal the engine's (llama.cpp computes in "
                                         "the file's quantized format)")
    # llama.cpp computes in the file's quantized format: its tokens are compared, not checked.
    check_same_tokens(model, wl, {s: r for s, r in results.items() if s != llama.NAME})
    return results


class _Peer:
    """llama.cpp (in its child process) while it lives, and how it died if it did: a crash ends its use, not the run."""

    def __init__(self, peer: llama.Peer | None, crash: ChildCrashed | None = None):
        self.peer, self.crash = peer, crash

    @property
    def alive(self) -> bool:
        return self.peer is not None and self.crash is None

    def run(self, fn: Callable[..., T], *args: object) -> T | None:
        """``fn(peer, *args)``; None, with the crash kept for the report, when llama.cpp has died (now or before)."""
        if not self.alive:
            return None
        try:
            return fn(self.peer, *args)
        except ChildCrashed as err:
            self.crash = err
            print(f"bench: {err}; the benchmark goes on without it", file=sys.stderr, flush=True)
            return None


class _EngineSides:
    """The engine's side of both llama.cpp comparisons: as loaded, and at its fastest single stream and batch 32.

    The fastest engines are built (and compiled) on first use and shared by
    the in-process peer's section and the tools' section.
    """

    def __init__(self, args: argparse.Namespace, model: Transformer, tok: Tokenizer):
        self.args, self.model, self.tok = args, model, tok
        # on a CPU in float32, decode steps attend in our C++ kernel (keys read where they lie, no gather for SDPA)
        self.decode_kernel = cpu_kernels.unavailable(model.device, model.dtype) is None
        self.engine_format = llama.engine_format(model) + (", C++ decode attention" if self.decode_kernel else "")
        self._fast: tuple[Engine, str] | None = None
        self._fast32: tuple[Engine, str] | None = None
        self._small: tuple[Transformer, str] | None = None  # the GGUF's own model, shared by both fastest engines
        self._step_bandwidth: float | None = None  # bytes/s reading a step's worth, measured once

    def engine_step(self, batch: int, new_tokens: int) -> float:
        return decode_step_time(self.model, self.tok, batch, new_tokens, self.decode_kernel)[0]

    @property
    def small(self) -> tuple[Transformer, str]:
        if self._small is None:
            self._small = small_model(self.model, self.args.quant_kernel, self.args.model)
        return self._small

    @property
    def fast(self) -> tuple[Engine, str]:
        if self._fast is None:
            self._fast = fastest_single_stream(*self.small, self.tok)
        return self._fast

    @property
    def fast32(self) -> tuple[Engine, str]:
        if self._fast32 is None:
            self._fast32 = fastest_batch32(self.model, self.tok, *self.small)
        return self._fast32

    def fast_step(self, batch: int, new_tokens: int) -> float:
        return engine_decode_step_time(self.fast[0], self.tok, batch, new_tokens)[0]

    def fast_b32_step(self, batch: int, new_tokens: int) -> float:
        return engine_decode_step_time(self.fast32[0], self.tok, batch, new_tokens)[0]

    def roofline(self, report: dict, section: dict) -> None:
        """The fastest single stream against the bandwidth roof: the read bandwidth over a buffer as big as
        what a step reads, over those bytes (``fast_single_stream_roofline_frac``), and llama.cpp's single stream
        against the same roof (``single_stream_roofline_frac``: the same GGUF, the same bytes a token). Not the
        core's 512 MiB probe: a step reads the same 92 MiB again and again, and a CPU whose last-level cache
        holds them (480 MiB on one Xeon) reads them from there, faster than from memory."""
        tok_s = section.get("fast_single_stream_tok_per_s")
        if tok_s is None:
            return
        step_bytes = decode_read_bytes(self.fast[0].model)
        if self._step_bandwidth is None:
            self._step_bandwidth = read_bandwidth(self.model.device, megabytes=-(-step_bytes // 2**20))
        roof = self._step_bandwidth / step_bytes
        section |= {"fast_single_stream_read_bandwidth": self._step_bandwidth,
                    "fast_single_stream_roofline_tok_per_s": roof, "fast_single_stream_roofline_frac": tok_s / roof}
        if section.get("single_stream_tok_per_s"):  # llama.cpp's
            section["single_stream_roofline_frac"] = section["single_stream_tok_per_s"] / roof


def _llama_cpp_section(args: argparse.Namespace, report: dict, tok: Tokenizer, peer: llama.Peer,
                       first: dict[str, SystemResult], sides: _EngineSides) -> None:
    """llama.cpp against the engine at batch 1 and 32: as loaded, and each side at its fastest."""
    section = llama.llama_cpp_effect(
        peer, sides.model, tok, args.quick, sides.engine_step, fast_step=sides.fast_step,
        fast_format=sides.fast[1], fast_b32_step=sides.fast_b32_step, fast_b32_format=sides.fast32[1])
    section["engine_format"] = sides.engine_format
    section["cpu"] = report["machine"]["cpu_label"]
    sides.roofline(report, section)
    if "engine" in first and llama.NAME in first:
        section |= llama.agreement(first["engine"], first[llama.NAME])
    report[llama.NAME] = section
    report["ratios"]["single_stream_vs_llama_cpp"] = section["single_stream_ratio"]
    report["ratios"]["decode_b32_vs_llama_cpp"] = section["decode_b32_ratio"]
    report["ratios"]["single_stream_fastest_vs_llama_cpp"] = section["fast_single_stream_ratio"]
    report["ratios"]["decode_b32_fastest_vs_llama_cpp"] = section["fast_decode_b32_ratio"]


def _llama_cpp_tools_section(args: argparse.Namespace, report: dict, tok: Tokenizer, threads: int,
                             sides: _EngineSides) -> None:
    """llama.cpp's own llama-bench and llama-batched-bench against the engine at batch 1 and 32, alternated;
    a tool that crashes or prints nothing we can read is reported, and the run goes on."""
    gguf = llama.gguf_path(args.model)
    base = {"bin": ", ".join(map(str, args.llama_cpp_bin)), "gguf": gguf.name, "cpu": report["machine"]["cpu_label"]}
    try:
        section = tools.tools_effect(lambda: tools.run_builds(args.llama_cpp_bin, gguf, threads, args.quick),
                                     sides.engine_step, args.quick, fast_step=sides.fast_step,
                                     fast_b32_step=sides.fast_b32_step)
    except (tools.ToolFailed, subprocess.TimeoutExpired) as err:
        report[tools.NAME] = base | {"failed": f"{type(err).__name__}: {err}"}
        report.setdefault("notes", []).append(f"llama.cpp's tools failed ({err}); the rest of the benchmark ran")
        print(f"bench: llama.cpp's tools failed: {err}", file=sys.stderr, flush=True)
        return
    sides.roofline(report, section)
    report[tools.NAME] = base | section | {
        "format": llama.gguf_format(gguf), "engine_format": sides.engine_format,
        "fast_format": sides.fast[1], "fast_b32_format": sides.fast32[1]}
    report["ratios"]["single_stream_vs_llama_cpp_bin"] = section["single_stream_ratio"]
    report["ratios"]["decode_b32_vs_llama_cpp_bin"] = section["decode_b32_ratio"]
    report["ratios"]["single_stream_fastest_vs_llama_cpp_bin"] = section["fast_single_stream_ratio"]
    report["ratios"]["decode_b32_fastest_vs_llama_cpp_bin"] = section["fast_decode_b32_ratio"]
