"""The engine core: torch-free scheduling side, incremental detokenization, metrics, sampling in the engine."""
from __future__ import annotations

import ast
import math
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

import enginelib
from enginelib.config import SamplingParams
from enginelib.core.engine import Engine, EngineConfig
from enginelib.core.output_processor import KEEP_FINISHED
from enginelib.core.scheduler import SchedulerConfig
from enginelib.model.sampling import filter_logits
from enginelib.model.tokenizer import IncrementalDetokenizer

from .conftest import tiny_tokenizer

PACKAGE = Path(enginelib.__file__).parent
SCHEDULING_SIDE = ["config", "core.request", "core.outputs", "core.block_pool", "core.kv_manager", "core.scheduler",
                   "structured_output"]  # a request's structured-output spec: plain data, as SamplingParams is
MAY_IMPORT = {  # what a folder's modules may import from enginelib, anywhere in them (inside functions too)
    "step": ["config", "env", "model", "step"],  # a step's Batch and attention: below both the core and the speed code
    "core": ["config", "env", "model", "step", "core"],  # the speed parts come through the runner's one factory
    "speed": ["baselines", "config", "env", "model", "step", "speed"],  # nothing of the core
}
ONE_SITTING = ["core/scheduler", "core/kv_manager", "core/block_pool", "step/batch", "core/request", "core/runner",
               "core/output_processor", "core/engine", "config", "model/transformer", "model/weights", "model/sampling",
               "model/tokenizer", "model/__init__"]  # the core a reader must understand, file by file


def _imports(module: str) -> set[str]:
    tree = ast.parse((PACKAGE / f"{module.replace('.', '/')}.py").read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            names.add("." * node.level + (node.module or ""))
    return names


@pytest.mark.parametrize("module", SCHEDULING_SIDE)
def test_the_scheduling_side_imports_no_torch(module):
    """Configs, requests, blocks and scheduling are plain data: no torch, and only modules of the same side."""
    for name in _imports(module):
        assert not name.startswith(("torch", ".")), f"{module}.py imports {name}"
        if name.startswith("enginelib."):
            assert name.removeprefix("enginelib.") in SCHEDULING_SIDE, f"{module}.py imports {name}"


def _enginelib_imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of each import of enginelib anywhere in the file: a lazy import inside a function, or one
    under ``if TYPE_CHECKING:``, is an arrow all the same."""
    package = ["enginelib", *path.relative_to(PACKAGE).parent.parts]  # where a relative import starts
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) + 1 - node.level] if node.level else []
            found.append((node.lineno, ".".join(base + ([node.module] if node.module else []))))
    return [(line, name) for line, name in found if name.split(".")[0] == "enginelib"]


def _layer(module: str) -> str:
    """The folder (or top-level module) of enginelib that ``module`` is in: "core" for enginelib.core.runner."""
    return module.split(".")[1] if "." in module else ""


@pytest.mark.parametrize("path", [p.relative_to(PACKAGE).as_posix() for folder in MAY_IMPORT
                                  for p in sorted((PACKAGE / folder).rglob("*.py"))])
def test_the_core_and_the_speed_code_import_only_what_lies_below_them(path):
    """No arrow from the core up to the speed code, serving, pictures or benchmark, nor from the speed code to the
    core, not even inside a function: both build on step/, and the runner gets the speed code through one factory."""
    allowed = MAY_IMPORT[path.split("/")[0]]
    for line, name in _enginelib_imports(PACKAGE / path):
        assert _layer(name) in allowed, f"{path}:{line} imports {name}"


def test_no_folders_import_each_other_in_a_circle():
    """No folder (or top-level module) of enginelib reaches itself again through imports at any depth, lazy ones
    included. The package's __init__, above them all, is left out: it hands the speed code to the runner."""
    arrows: dict[str, dict[str, str]] = {}  # folder -> folder it imports -> the first file:line that does
    for path in sorted(PACKAGE.rglob("*.py")):
        where = path.relative_to(PACKAGE)
        if where.parts == ("__init__.py",):
            continue
        here = where.parts[0].removesuffix(".py")
        for line, name in _enginelib_imports(path):
            if _layer(name) not in ("", here):
                arrows.setdefault(here, {}).setdefault(_layer(name), f"{where.as_posix()}:{line}")

    def circle(trail: list[str]) -> list[str] | None:
        for there in sorted(arrows.get(trail[-1], {})):
            if there in trail:
                return trail[trail.index(there):] + [there]
            found = circle(trail + [there])
            if found:
                return found
        return None
    for start in sorted(arrows):
        found = circle([start])
        assert found is None, "a circle of folders: " + " -> ".join(
            f"{a} ({arrows[a][b]})" for a, b in zip(found, found[1:])) + f" -> {found[-1]}"


def _loaded_after(code: str) -> list[str]:
    out = subprocess.run([sys.executable, "-c", code + "\nimport sys; print(' '.join(sorted(sys.modules)))"],
                         capture_output=True, text=True, check=True).stdout.split()
    return [m for m in out if m.startswith("enginelib.")]


def test_a_plain_engine_loads_no_speed_code():
    loaded = _loaded_after("import enginelib, enginelib.core.engine")
    assert "enginelib.core.engine" in loaded
    assert not [m for m in loaded if m.startswith(("enginelib.speed", "enginelib.serve", "enginelib.viz",
                                                   "enginelib.bench"))], loaded
    configs = _loaded_after("import enginelib.config")
    assert "torch" not in " ".join(configs) and "enginelib.config" in configs


def test_the_runner_loads_the_speed_code_a_config_asks_for():
    code = ("import torch, enginelib\n"
            "from enginelib.model import ModelConfig, Transformer\n"
            "from tests.conftest import tiny_tokenizer\n"
            "model = Transformer(ModelConfig.tiny())\n"
            "engine = enginelib.Engine(model, tiny_tokenizer(model.cfg.vocab_size), enginelib.EngineConfig("
            "num_blocks=8, speculative=enginelib.SpeculativeConfig()))")
    loaded = _loaded_after(code)
    assert "enginelib.speed.speculative" in loaded


def test_the_core_reads_in_one_sitting():
    """The core a reader must understand (scheduler, KV manager, block pool, batch, request, runner, output processor,
    engine, configs, model) stays readable in one sitting: at most 2,300 physical lines in all (2,200 until prompt
    logprobs came in), no file over 300. What is left out lives outside the core on purpose: the speed code, serving,
    pictures and benchmark."""
    lines = {name: (PACKAGE / f"{name}.py").read_text().count("\n") for name in ONE_SITTING}  # as wc -l counts
    assert sum(lines.values()) <= 2300, f"the core is {sum(lines.values())} lines: {lines}"
    assert all(n <= 300 for n in lines.values()), {name: n for name, n in lines.items() if n > 300}


def test_engine_stats_are_a_copy(tiny_dt):
    engine = Engine(tiny_dt, tiny_tokenizer(tiny_dt.cfg.vocab_size), EngineConfig(num_blocks=32, block_size=4))
    before = engine.stats()
    engine.add_request([3, 4, 5, 6, 7], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    after = engine.stats()
    assert (before.steps, before.generated_tokens, before.prefix_cache.lookups) == (0, 0, 0)
    assert after.generated_tokens == 3 and after.prefix_cache.lookups == 1
    assert after.prefix_cache is not engine.kv.stats and after.spec_decode is not engine.runner.spec_stats


@pytest.mark.parametrize("text", [
    "Hello, world! The planets are Mercury, Venus, Earth and Mars.",
    "Unicode: héllo wörld, 世界 你好, emoji 🌍🚀 and ümlauts — done.",
    "  leading spaces,\n\nnew lines\tand tabs  ",
])
def test_incremental_detokenization_equals_decoding_everything(real, text):
    _, tok = real
    ids = tok.encode(text)
    detok, ids_so_far, pieces = IncrementalDetokenizer(tok), [], []
    for token in ids:
        ids_so_far.append(token)
        pieces.append(detok.step(ids_so_far))
        assert "\ufffd" not in pieces[-1], "a partial character was sent"
        assert tok.decode(ids_so_far, skip_special_tokens=True).startswith(detok.text)
    pieces.append(detok.flush(ids_so_far))
    assert "".join(pieces) == detok.text == tok.decode(ids, skip_special_tokens=True)
    assert detok.read_offset == len(ids)


def test_an_engine_answer_is_detokenized_incrementally_and_equals_a_full_decode(real):
    model, tok = real
    out = enginelib.LLM.from_model(model, tok).generate(["Write three words in Chinese and one emoji."],
                                                        SamplingParams(temperature=0, max_tokens=24))[0]
    assert out.outputs[0].text == tok.decode(out.outputs[0].token_ids, skip_special_tokens=True)


def test_metrics_are_consistent_and_blocks_come_back(tiny_dt):
    tok = tiny_tokenizer(tiny_dt.cfg.vocab_size)
    engine = Engine(tiny_dt, tok, EngineConfig(num_blocks=32, block_size=4))
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    ids = [engine.add_request([3, 4, 5, 6, 7][: 2 + i], params) for i in range(3)]
    finals = {}
    while engine.has_unfinished_requests():
        finals |= {o.request_id: o for o in engine.step() if o.finished}
    assert engine.pool.num_used == 0
    for rid in ids:
        m = finals[rid].metrics
        assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.last_token_time <= m.finished_time
        assert all(a < b for a, b in zip(m.token_times, m.token_times[1:])), "token times must increase"
        assert m.num_output_tokens == len(finals[rid].outputs[0].token_ids) == 6
        assert 0 < m.time_to_first_token <= m.finished_time - m.arrival_time
        assert m.time_per_output_token == pytest.approx(sum(m.inter_token_latencies) / 5)
    stats = engine.stats()
    assert (stats.finished, stats.generated_tokens, stats.running, stats.waiting) == (3, 18, 0, 0)


def test_the_engine_forgets_finished_requests_but_keeps_counting(tiny_dt, monkeypatch):
    monkeypatch.setattr("enginelib.core.output_processor.KEEP_FINISHED", 2)
    tok = tiny_tokenizer(tiny_dt.cfg.vocab_size)
    engine = Engine(tiny_dt, tok, EngineConfig(num_blocks=32, block_size=4, record=True))
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    for i in range(4):
        engine.add_request([5, 6, 7 + i], params)
        while engine.has_unfinished_requests():
            engine.step()
    assert not engine.output.live and len(engine.output.finished) == 2  # only the last two are kept for engine.request()
    assert engine.request("3").output_token_ids and engine.stats().finished == 4
    with pytest.raises(ValueError, match="finished more than"):
        engine.request("0")
    assert all(len(r.states) <= 1 for r in engine.history)  # a step records the live requests, not every past one
    assert KEEP_FINISHED >= 1000  # the default keeps enough for a chapter's runs


def _first_tokens(model, tok, params: dict, n: int = 400) -> Counter:
    """The first sampled token of ``n`` seeded requests on one prompt, sampled in the engine (batched)."""
    engine = Engine(model, tok, EngineConfig(num_blocks=256, block_size=4,
                                             scheduler=SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=512)))
    for seed in range(n):
        engine.add_request([3, 4, 5], SamplingParams(max_tokens=1, seed=seed, **params))
    tokens = Counter()
    while engine.has_unfinished_requests():
        tokens.update(o.outputs[0].token_ids[0] for o in engine.step() if o.finished)
    return tokens


def test_top_k_and_top_p_in_the_engine_sample_the_filtered_distribution(tiny_dt):
    """Statistically: the engine's samples follow softmax(filtered logits), and the filters change them."""
    tok = tiny_tokenizer(tiny_dt.cfg.vocab_size)
    with torch.inference_mode():
        logits = tiny_dt(torch.tensor([[3, 4, 5]], device=tiny_dt.device))[:, -1].float()
    n = 400
    plain = _first_tokens(tiny_dt, tok, {"temperature": 1.0}, n)
    for params in ({"temperature": 1.0, "top_k": 3}, {"temperature": 0.7, "top_p": 0.6}):
        probs = filter_logits(logits, SamplingParams(**params)).softmax(-1)[0]
        got = _first_tokens(tiny_dt, tok, params, n)
        allowed = set(torch.nonzero(probs).flatten().tolist())
        assert set(got) <= allowed, f"{params}: sampled outside the filtered set"
        assert len(set(plain)) > len(allowed), "the filter should narrow the choice"
        for token in allowed:  # each frequency within 4.5 standard deviations of its probability
            p = float(probs[token])
            assert abs(got[token] / n - p) <= 4.5 * math.sqrt(p * (1 - p) / n) + 1e-9, (params, token, got, p)
