"""llama.cpp as a peer in the benchmark: optional, on the same GGUF file, with clear errors where it cannot run."""
from __future__ import annotations

import pytest
import torch

from enginelib import EngineConfig, bench
from enginelib.bench import llama_cpp as llama

MISSING = "ModuleNotFoundError: No module named 'llama_cpp'"


def test_asking_for_llama_cpp_without_it_names_the_install_command(monkeypatch, capsys):
    monkeypatch.setattr(llama, "import_error", lambda: MISSING)
    with pytest.raises(SystemExit):
        bench.main(["--quick", "--systems", "engine,llama_cpp"])
    err = capsys.readouterr().err
    assert "--systems llama_cpp needs llama-cpp-python" in err and "pip install llama-cpp-python" in err
    assert MISSING in err
    with pytest.raises(SystemExit):  # and it is not offered
        bench.main(["--help"])
    assert "llama_cpp" not in capsys.readouterr().out
    with pytest.raises(ValueError, match="pip install llama-cpp-python"):
        llama.LlamaCpp(llama.gguf_path("smollm2-135m"), threads=1)


def test_llama_cpp_needs_a_gguf_file(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="needs a GGUF file"):
        llama.gguf_path(tmp_path)


def test_the_formats_say_what_each_side_computes_with(real):
    model, _ = real
    assert llama.gguf_format(llama.gguf_path("smollm2-135m")) == "Q4_1 (token_embd.weight Q8_0)"
    assert llama.engine_format(model) == str(model.dtype).removeprefix("torch.")


def test_llama_cpp_runs_two_requests_on_the_same_gguf(real):
    pytest.importorskip("llama_cpp")
    model, tok = real
    wl = bench.Workload("two", [bench.BenchRequest(bench.chat_prompt(tok, q), 8) for q in bench.QUESTIONS[:2]])
    with llama.open_peer("smollm2-135m", 1, 4, [wl]) as peer:
        result = llama.run_llama_cpp(peer, tok, wl)
        step = llama.decode_step_time(peer, tok, 2, 4)
    assert result.name == "llama_cpp" and result.requests == 2 and result.output_tokens == 16
    assert [len(o) for o in result.outputs] == [8, 8] and len(result.texts) == 2
    assert len(result.ttft) == 2 and all(0 < t for t in result.tpot) and result.tok_per_s > 0 and step > 0
    assert set(result.summary()) == set(bench.SystemResult("x", 1, 1, 1.0).summary())
    # Q4_1 against float32 (and llama.cpp against itself at another batch size) may part at a near-tie, so
    # the texts need not match; but read with the same ids at the same positions, each token llama.cpp
    # picks is one our model ranks near the top, given llama.cpp's own text so far. A wrong token id,
    # position or sequence would give tokens our model finds unlikely.
    for req, out in zip(wl.requests, result.outputs):
        with torch.inference_mode():
            logits = model(torch.tensor([req.prompt_ids + out]))[0, len(req.prompt_ids) - 1:-1]
        chosen = logits.gather(1, torch.tensor(out)[:, None])
        ranks = (logits > chosen).sum(1)
        assert (ranks < 5).float().mean() >= 0.9, (ranks.tolist(), tok.decode(out))
    engine = bench.run_engine(model, tok, wl, EngineConfig())
    same = llama.agreement(engine, result)
    assert 0 <= same["texts_equal"] <= 1 and 0 <= same["common_prefix_frac"] <= 1
