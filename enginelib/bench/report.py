"""What the run prints and the ratios it derives: a table per workload and a summary of every section."""
from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Iterator

from enginelib.bench.endpoint import ENDPOINT
from enginelib.bench.results import SystemResult
from enginelib.speed import paths


@contextlib.contextmanager
def progress(part: str) -> Iterator[None]:
    """A line to stderr as a part of the run starts and one as it ends, with its seconds: a run that takes
    minutes shows where it is, and which part took them (stdout keeps the report)."""
    print(f"bench: {part} ...", file=sys.stderr, flush=True)
    start = time.perf_counter()
    try:
        with paths.section(part):  # the kernels and compile modes that ran, by part (enginelib.speed.paths)
            yield
    except BaseException:
        print(f"bench: {part} failed after {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
        raise
    print(f"bench: {part} done in {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)


def throughput_ratios(systems: dict) -> dict:
    """tok/s of one system over another's on the same workload (None where either did not run)."""
    def ratio(a: str, b: str) -> float | None:
        return systems[a]["tok_per_s"] / systems[b]["tok_per_s"] if a in systems and b in systems else None

    return {"engine_vs_naive": ratio("engine", "naive"), "engine_vs_kv_cache": ratio("engine", "kv_cache"),
            "engine_vs_static": ratio("engine", "static"), "engine_vs_hf_static": ratio("engine", "hf_static"),
            "endpoint_vs_engine": ratio(ENDPOINT, "engine"),
            "engine_vs_llama_cpp": ratio("engine", "llama_cpp")}


def _fmt(x: float | None, scale: float = 1.0, digits: int = 1) -> str:
    return "-" if x is None else f"{x * scale:.{digits}f}"


def print_table(name: str, results: dict[str, SystemResult]) -> None:
    """One workload's systems side by side (printed as each workload ends, so a long run shows progress)."""
    base = results.get("naive")
    print(f"\nworkload {name}")
    print(f"{'system':<10} {'tok/s':>8} {'x naive':>8} {'TTFT p50':>9} {'TTFT p99':>9} {'TPOT p50':>9} "
          f"{'TPOT p99':>9} {'e2e p50':>8}  note")
    for r in results.values():
        s = r.summary()
        print(f"{r.name:<10} {r.tok_per_s:>8.1f} {_fmt(r.tok_per_s / base.tok_per_s if base else None):>8} "
              f"{_fmt(s['ttft_p50_s'], 1e3, 0):>7}ms {_fmt(s['ttft_p99_s'], 1e3, 0):>7}ms "
              f"{_fmt(s['tpot_p50_s'], 1e3, 0):>7}ms {_fmt(s['tpot_p99_s'], 1e3, 0):>7}ms "
              f"{_fmt(s['e2e_p50_s'], 1, 2):>7}s  {r.note.strip('; ')}")


def print_summary(report: dict) -> None:
    """Every section's headline figures in a few lines (the JSON holds the rest)."""
    r, m = report["ratios"], report["machine"]
    cpu = m.get("cpu_label") or "an unnamed CPU"  # every ratio holds for one CPU: it is named with them
    print(f"\nratios (on {cpu}): " + ", ".join(f"{k} {_fmt(v, 1, 2)}" for k, v in r.items()))
    device = m["device"] + (f" ({m['gpu']})" if m.get("gpu") else "")  # on a GPU, its name: "cuda (Tesla T4)"
    print(f"machine: {cpu}; {report['machine_peak_flops'] / 1e9:.0f} GFLOP/s matmul peak, "
          f"{report['machine_read_bandwidth'] / 1e9:.1f} GB/s read bandwidth "
          f"({m['threads']} threads, {device}, {m['dtype']})")
    print(f"decode MFU at batch 32: {report['mfu_decode_b32']:.1%}; single stream "
          f"{report['single_stream_tok_per_s']:.1f} tok/s = {report['single_stream_roofline_frac']:.0%} of the "
          f"bandwidth roofline ({report['single_stream_roofline_tok_per_s']:.1f} tok/s)")
    if "llama_cpp" in report:
        print_llama_cpp(report["llama_cpp"])
    if "llama_cpp_bin" in report:
        print_llama_cpp_tools(report["llama_cpp_bin"])
    if "prefix_cache" in report:
        p, c = report["prefix_cache"], report["chunked_prefill"]
        print(f"prefix cache (shared-prefix): TTFT p50 {_fmt(p['ttft_p50_on_s'], 1e3, 0)} ms with, "
              f"{_fmt(p['ttft_p50_off_s'], 1e3, 0)} ms without (ratio {p['ttft_ratio']:.2f}); "
              f"hit rate {p['hit_rate']:.0%}")
        scaled = f", {c['long_prompt_tokens']}-token prompts" if m.get("gpu") else ""  # scaled up to a GPU
        print(f"chunked prefill (long-prompt{scaled}, budget {c['budget']}): decode p99 gap "
              f"{_fmt(c['itl_p99_on_s'], 1e3, 0)} ms with, {_fmt(c['itl_p99_off_s'], 1e3, 0)} ms without "
              f"(ratio {c['itl_p99_ratio']:.2f})")
    if "structured" in report:
        g = report["structured"]
        j = g["jump_forward"]
        print(f"structured output ({g['requests']} greedy JSON-schema requests): a mask {_fmt(g['mask_ms'], 1, 3)} ms, "
              f"{g['mask_ms_per_step']:.2f} ms of masks a step, {g['mask_fraction']:.1%} of a {g['step_ms']:.1f} ms "
              f"decode step ({g['step_ms_plain']:.1f} ms unconstrained); {g['valid']:.0%} of outputs valid; "
              f"jump-forward {j['steps']} steps instead of {j['steps_plain']} ({j['forced_tokens']} tokens forced)")
    if "serve" in report:
        s = report["serve"]
        where = f", engine on CPUs {s['engine_cpus']}, client on {s['client_cpus']}" if s["engine_cpus"] else ""
        print(f"serve ({s['concurrency']} streams, {s['requests']} requests{where}): "
              f"server {s['server_tok_per_s']:.1f} tok/s "
              f"vs offline {s['offline_tok_per_s']:.1f} tok/s = {s['throughput_ratio']:.2f}x; TTFT p50 "
              f"{_fmt(s['ttft_p50'], 1e3, 0)} ms (alone: offline {s['ttft_overhead_ms']:+.0f} ms), p99 "
              f"{_fmt(s['ttft_p99'], 1e3, 0)} ms; TPOT p50 "
              f"{_fmt(s['tpot_p50'], 1e3, 0)} ms, p99 {_fmt(s['tpot_p99'], 1e3, 0)} ms; "
              f"{_fmt(s['texts_equal'], 100, 0)}% of texts equal the offline engine's")
        stolen = {k: v for k, v in s["steal"].items() if v is not None and v >= 0.01}
        if stolen:  # a shared VM: the hypervisor ran another guest on these CPUs meanwhile
            names = {"engine_cpus": "the engine's CPUs'", "client_cpus": "the client's CPUs'"}
            print("serve: the hypervisor took " + " and ".join(f"{v:.0%} of {names[k]} time" for k, v in stolen.items())
                  + " during the section (another guest ran there: timings are noisier)")
        if (flood := s.get("refused_flood")) is not None:
            print(f"serve: a live stream beside {flood['refused_per_s']:.0f} refused prompts/s runs at "
                  f"{flood['ratio']:.2f}x its speed without them (engine core on CPUs {flood['engine_cpus']})")
    if "spec_decode" in report:
        d = report["spec_decode"]
        g, e = d["ngram"], d["extractive"]
        print(f"spec decode (k={d['k']}), batch 1 on chats: draft ({d['draft']}) {d['speedup_b1']:.2f}x (acceptance "
              f"{d['acceptance']:.0%}, {d['mean_accepted_length']:.2f} kept per check), n-gram {g['speedup_b1']:.2f}x "
              f"(acceptance {g['acceptance']:.0%}); n-gram {g['speedup_b8']:.2f}x at batch 8, {e['speedup_b1']:.2f}x "
              f"copying a passage (acceptance {e['acceptance']:.0%}); {d['texts_equal']:.0%} of texts equal plain greedy's")
        if "compiled_target" in d:
            c = d["compiled_target"]
            print(f"spec decode with the target compiled on both sides: {c['speedup_b1']:.2f}x "
                  f"({c['tok_per_s']:.1f} vs {c['tok_per_s_plain']:.1f} tok/s), {c['texts_equal']:.0%} of texts equal")
    if "quant" in report:
        q = report["quant"]
        for fmt in ("int8", "int4"):
            r = q[fmt]
            print(f"{fmt}: {r['bytes_per_param']:.2f} bytes/param, {r['weight_bytes'] / 2**20:.0f} MiB, decode "
                  f"{r['tok_per_s_ratio']:.2f}x float, perplexity {r['ppl']:.2f} ({r['ppl_delta']:+.1%}), "
                  f"kernels {', '.join(sorted(set(r['kernels'].values())))}")
    if "compile" in report:
        c = report["compile"]
        if "unavailable" in c:
            print(f"compile: skipped ({c['unavailable']})")
        else:
            for name, sec in (("compile", c), ("compile + CUDA graphs", c.get("cuda_graphs"))):
                if sec is None:
                    continue
                line = ", ".join(f"{sec[f'speedup_b{b}']:.2f}x at batch {b}" for b in sec["batch_sizes"])
                print(f"{name}: decode {line} vs eager; compiling took "
                      f"{', '.join(f'{s:.0f} s (batch {b})' for b, s in sec['compile_seconds'].items())}; "
                      f"{sec['tokens_equal_b1']:.0%} of outputs equal eager's")
    if "kv_waste" in report:
        w, c = report["kv_waste"], report["concurrency"]
        print(f"KV waste: paged {w['paged']:.1%} vs reserve-{w['max_len']} {w['contiguous']:.1%}; "
              f"a {c['budget_tokens']}-token budget holds {c['paged']} requests paged vs {c['contiguous']} contiguous "
              f"({report['concurrency_ratio']:.1f}x)")


def _fastest_lines(p: dict, theirs: str) -> None:
    """The engine at its fastest single stream and batch 32 against ``theirs``, where they were measured."""
    if p.get("fast_single_stream_ratio") is not None:
        roof = (f", {p['fast_single_stream_roofline_frac']:.0%} of its bandwidth roofline: "
                f"{p['fast_single_stream_read_bandwidth'] / 1e9:.1f} GB/s reading a step's bytes"
                + (f"; {theirs} at {p['single_stream_roofline_frac']:.0%} of it"
                   if p.get("single_stream_roofline_frac") is not None else "")
                if p.get("fast_single_stream_roofline_frac") is not None else "")
        print(f"  the engine at its fastest single stream ({p['fast_format']}): "
              f"{p['fast_single_stream_tok_per_s']:.1f} tok/s ({p['fast_single_stream_ratio']:.2f}x {theirs}{roof})")
    if p.get("fast_decode_b32_ratio") is not None:
        print(f"  the engine at its fastest with 32 sequences ({p['fast_b32_format']}): "
              f"{p['fast_decode_b32_tok_per_s']:.1f} tok/s ({p['fast_decode_b32_ratio']:.2f}x {theirs})")


def print_llama_cpp(p: dict) -> None:
    """The in-process peer's comparison, or how it crashed (the run went on without it)."""
    if "crashed" in p:
        frame = f"; Python was at {p['python_frame']}" if p.get("python_frame") else ""
        print(f"{p['crashed']} (on {p['cpu']}){frame}; the rest of the benchmark ran without it")
        return
    b32 = (f"; batch 32 {p['engine_decode_b32_tok_per_s']:.1f} vs {p['decode_b32_tok_per_s']:.1f} tok/s "
           f"({p['decode_b32_ratio']:.2f}x)") if p["decode_b32_ratio"] is not None else ""
    print(f"llama.cpp {p['version']} on {p['device']} ({p['format']}, {p['threads']} threads, {p['cpu']}) vs the "
          f"engine ({p['engine_format']}): "
          f"single-stream decode {p['engine_single_stream_tok_per_s']:.1f} vs {p['single_stream_tok_per_s']:.1f} "
          f"tok/s ({p['single_stream_ratio']:.2f}x){b32}; {_fmt(p.get('texts_equal'), 100, 0)}% of greedy "
          f"outputs equal")
    _fastest_lines(p, "llama.cpp")


def print_llama_cpp_tools(p: dict) -> None:
    """llama.cpp's own tools (``--llama-cpp-bin``) against the engine, with the flags they were built with."""
    if "failed" in p:
        print(f"llama.cpp's tools in {p['bin']} failed (on {p['cpu']}): {p['failed']}; the rest of the benchmark ran")
        return
    other = p.get("batched_build") not in (None, p["build"])  # batch 32's figure from another build
    b32 = (f"; batch 32 {p['engine_decode_b32_tok_per_s']:.1f} vs {p['decode_b32_tok_per_s']:.1f} tok/s "
           f"({p['decode_b32_ratio']:.2f}x, {p['batched_test']}{', build ' + p['batched_build'] if other else ''})"
           ) if p["decode_b32_ratio"] is not None else "; batch 32 not compared (no build's llama-batched-bench ran)"
    print(f"llama.cpp's tools (commit {p['build_commit']}, {p['build']}; {p['threads']} threads, {p['cpu']}) vs the "
          f"engine ({p['engine_format']}): single-stream decode {p['engine_single_stream_tok_per_s']:.1f} vs "
          f"{p['single_stream_tok_per_s']:.1f} tok/s ({p['single_stream_ratio']:.2f}x, {p['single_stream_test']}, "
          f"best of flash attention {'/'.join(p['single_stream_by_flash_attn'])}){b32}")
    for b in p.get("builds", []) if len(p.get("builds", [])) > 1 or p.get("batched_failed") else ():
        figures = (f"single stream {b['single_stream_tok_per_s']:.1f} tok/s, batch 32 "
                   + (f"{b['decode_b32_tok_per_s']:.1f} tok/s" if b["decode_b32_tok_per_s"] else
                      f"failed: {b['batched_failed']}")) if "failed" not in b else f"failed: {b['failed']}"
        print(f"  build {b.get('build', b['bin'])}: {figures}")
    _fastest_lines(p, "llama.cpp's tools")
