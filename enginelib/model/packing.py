"""Whether oneDNN's packed weights pay on this CPU: measured once per CPU model, not assumed.

Packing (:class:`device.PackedLinear`) made a decode step faster at batch 1 on an AMD EPYC (1.48x, later 1.52x)
and slower on an Intel Xeon (0.79x), both with 2 threads: the winner depends on the CPU. So
``load_model`` times every linear layer of the model, plain and packed, at batch 1 and 32, and packs only
where the packed pass is not slower at either; a steady verdict is kept in ``$ENGINELIB_CACHE/packing.json``
under the CPU's model name, torch's version, the thread count and the model's shapes, so a machine pays
for the timing once (two to three seconds for SmolLM2-135M on 2 cores). ``load_model(pack=True/False)`` still forces either way.
"""
from __future__ import annotations

import datetime
import json
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from enginelib.model.device import PackedLinear, pack_linears

BATCHES = (1, 32)  # a lone stream and a full decode batch: packing must not lose at either
PASSES = 3  # timed passes in a row, twice for each kind (see measure_speedups)


@dataclass
class PackingChoice:
    """The verdict, and the timings it came from."""

    pack: bool
    speedup: dict[str, float]  # batch -> plain pass time / packed pass time (above 1: packing is faster)
    cpu: str
    measured: str  # when: the date, or "forced" when the caller chose (load_model(pack=...): nothing timed)


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what ``platform`` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:  # no /proc (macOS, Windows)
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def _linears(model: nn.Module) -> list[nn.Linear]:
    return [m for m in model.modules() if type(m) is nn.Linear]


def _key(linears: list[nn.Linear]) -> str:
    shapes = sorted({(m.out_features, m.in_features) for m in linears})
    return f"{cpu_model()} | torch {torch.__version__} | {torch.get_num_threads()} threads | {len(linears)} linears {shapes}"


def _cache() -> Path:
    from enginelib.model.weights import cache_dir  # weights imports this module

    return cache_dir() / "packing.json"


def measure_speedups(linears: list[nn.Linear], packed: list[PackedLinear]) -> tuple[dict[str, float], bool]:
    """Plain pass time / packed pass time over all ``linears`` (each weight read once a pass, as in a decode
    step), per batch size; and whether the timing was steady (each kind's two blocks within 25%).

    Each kind runs a few passes in a row, twice, taking turns in blocks, and the fastest pass counts. Not pass
    by pass: the two run on different thread pools (the BLAS library's, oneDNN's), and the pool just left keeps
    spinning a moment; the first pass after a switch is not timed. Another busy process makes this unsteady: on
    2 cores a packed pass then ran 20x slower, as oneDNN's threads wait for each other at every layer."""
    speedup, steady = {}, True
    with torch.inference_mode():
        for batch in BATCHES:
            xs = {m.in_features: torch.randn(batch, m.in_features) for m in linears}
            passes = {"plain": lambda: [F.linear(xs[m.in_features], m.weight, m.bias) for m in linears],
                      "packed": lambda: [p(xs[p.in_features]) for p in packed]}
            blocks: dict[str, list[float]] = {name: [] for name in passes}
            for _ in range(2):
                for name, run in passes.items():
                    run()  # the switch
                    times = []
                    for _ in range(PASSES):
                        start = time.perf_counter()
                        run()
                        times.append(time.perf_counter() - start)
                    blocks[name].append(min(times))
            speedup[str(batch)] = min(blocks["plain"]) / min(blocks["packed"])
            steady &= all(max(b) <= 1.25 * min(b) for b in blocks.values())
    return speedup, steady


def pack_if_it_pays(model: nn.Module) -> PackingChoice:
    """Pack ``model``'s linear layers in place where that is not slower on this CPU at any of :data:`BATCHES`;
    the verdict from the cache when this CPU, torch, thread count and model shape were timed before, steadily."""
    linears = _linears(model)
    key, path = _key(linears), _cache()
    cache = json.loads(path.read_text()) if path.exists() else {}
    if key in cache:
        choice = PackingChoice(**cache[key])
        if choice.pack:
            pack_linears(model)
        return choice
    speedup, steady = measure_speedups(linears, [PackedLinear(m) for m in linears])  # the copies go after it
    choice = PackingChoice(min(speedup.values()) >= 1.0, speedup, cpu_model(), datetime.date.today().isoformat())
    if choice.pack:
        pack_linears(model)
    if steady:  # an unsteady timing (another process was busy) decides this load only: the next one times again
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(cache | {key: asdict(choice)}, indent=1))
    return choice
