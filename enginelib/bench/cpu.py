"""The CPU a run measured on: its model and the instruction sets that decide who wins a ratio.

A speed ratio against llama.cpp means little without the CPU: on one Intel
Xeon with AMX, llama.cpp's native build ran 2.8x its own AVX-512 build, and
the engine went from 1.34x llama.cpp (an AMD EPYC without AMX) to 0.5x. So the
benchmark's JSON and report carry :func:`cpu_info`, and every ratio line names
:func:`cpu_label`. Read from ``/proc/cpuinfo`` on Linux, ``sysctl`` on macOS,
and :mod:`platform` elsewhere (the model only: flags unknown).
"""
from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path

# The flags that decide integer and float matmul speed, as /proc/cpuinfo spells them, with the report's names.
FLAGS = {
    "avx2": "AVX2", "fma": "FMA", "f16c": "F16C", "avx_vnni": "AVX-VNNI",
    "avx512f": "AVX-512", "avx512bw": "AVX-512BW", "avx512_vnni": "AVX-512 VNNI", "avx512_bf16": "AVX-512 BF16",
    "avx512_fp16": "AVX-512 FP16", "amx_tile": "AMX", "amx_int8": "AMX-INT8", "amx_bf16": "AMX-BF16",
    "asimddp": "NEON dotprod", "i8mm": "I8MM", "sve": "SVE",  # arm64 (Linux names)
}
# macOS (Intel) sysctl spellings of the same flags.
_MACOS = {"AVX2": "avx2", "FMA": "fma", "F16C": "f16c", "AVX512F": "avx512f", "AVX512BW": "avx512bw",
          "AVX512VNNI": "avx512_vnni", "AVX512BF16": "avx512_bf16"}


def parse_cpuinfo(text: str) -> tuple[str | None, set[str]]:
    """The model name and the flags of the first processor in ``/proc/cpuinfo``'s text (x86 or arm64)."""
    model, flags = None, set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip().lower()
        if key in ("model name", "hardware", "cpu model") and model is None and value.strip():
            model = value.strip()
        elif key in ("flags", "features") and not flags:
            flags = set(value.split())
    return model, flags


def _sysctl(name: str) -> str | None:
    try:
        out = subprocess.run(["sysctl", "-n", name], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else None


def cpu_info(cpuinfo: Path = Path("/proc/cpuinfo"), machine: str | None = None, cores: int | None = None) -> dict:
    """The CPU's model, its relevant flags (each True/False, or None where this OS does not say) and its cores.

    ``machine`` and ``cores`` default to this machine's (:func:`platform.machine`, :func:`os.cpu_count`).
    """
    model, flags, source = None, None, "platform"
    if cpuinfo.exists():
        model, flags = parse_cpuinfo(cpuinfo.read_text(errors="replace"))
        source = str(cpuinfo)
    elif platform.system() == "Darwin":
        model = _sysctl("machdep.cpu.brand_string")
        features = " ".join(filter(None, (_sysctl("machdep.cpu.features"), _sysctl("machdep.cpu.leaf7_features"))))
        if features:  # an Intel Mac; Apple silicon has none of these x86 flags to report
            flags = {_MACOS[f] for f in features.split() if f in _MACOS}
        source = "sysctl"
    if not model:
        model = platform.processor() or platform.machine() or "unknown CPU"
    return {"model": model, "machine": machine or platform.machine(), "cores": cores or os.cpu_count(),
            "source": source,
            "flags": {name: (name in flags) if flags is not None else None for name in FLAGS}}


def cpu_label(info: dict) -> str:
    """One line for a report: ``AMD EPYC (x86_64, 2 cores: AVX-512 VNNI, AVX-512 BF16, AVX2; no AMX)``.

    Names the widest integer-dot-product and matrix paths present and says
    "no AMX" / "no AVX-512" on x86 where they are absent, since those are
    what llama.cpp's best build and our kernels pick between.
    """
    flags = info["flags"]
    where = f"{info['machine']}, {info['cores']} cores"
    if all(v is None for v in flags.values()):
        return f"{info['model']} ({where}; CPU flags not read on this OS)"
    have = [FLAGS[f] for f in ("amx_int8", "amx_tile", "avx512_vnni", "avx_vnni", "avx512_fp16", "avx512_bf16",
                               "avx512f", "avx2", "i8mm", "asimddp", "sve") if flags.get(f)]
    if flags.get("amx_int8"):  # AMX-INT8 implies the tiles: name the one that matters
        have.remove("AMX")
    if flags.get("avx512_vnni") or flags.get("avx512_bf16") or flags.get("avx512_fp16"):
        have.remove("AVX-512")  # implied by the narrower names before it
    lacking = []
    if info["machine"] in ("x86_64", "AMD64", "i386", "i686"):
        lacking = [f"no {name}" for flag, name in (("amx_tile", "AMX"), ("avx512f", "AVX-512")) if not flags.get(flag)]
    return f"{info['model']} ({where}: {', '.join(have) or 'none of ' + ', '.join(FLAGS.values())}" \
           + (f"; {', '.join(lacking)}" if lacking else "") + ")"
