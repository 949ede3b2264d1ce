"""Shared fixtures: the real model is loaded once per test session.

``ENGINELIB_TEST_DEVICE=cuda`` puts the engine tests' models on that device (default: cpu):
``real``, ``real_f32``, ``tiny_dt`` and ``tiny``, except in the modules of :data:`TINY_ON_CPU`, whose
tests mix ``tiny`` with tensors they make on the CPU or test CPU-only code with it.
``ENGINELIB_DTYPE=float16`` (or bfloat16) runs the engine tests in that dtype:
``real`` follows it, ``real_f32`` and ``tiny`` stay float32 for the tests that are
float32 by nature (the transformers oracle, tolerances of 1e-5). Greedy tokens
compared across batch shapes go through ``agree`` (:func:`enginelib.model.checks.check_greedy`),
which also tallies identical vs near-tie requests for the session's summary.
"""
from __future__ import annotations

import copy
import os

import pytest
import torch
from hypothesis import settings

import enginelib
from enginelib.model import ModelConfig, Transformer
from enginelib.model.checks import Agreement, check_greedy
from enginelib.model.device import default_dtype
from enginelib.model.tokenizer import Tokenizer

enginelib.set_threads()
DEVICE = torch.device(os.environ.get("ENGINELIB_TEST_DEVICE", "cpu"))

# CI runs the property tests with a fixed seed: a red CI is then reproducible, never a lucky draw.
settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")

# `slow`: the real model, a server, a compiler, a browser or a notebook. `pytest -m "not slow"` is the
# developer's quick answer (the tiny model, pure logic); plain `pytest` runs everything.
SLOW_FIXTURES = {"real", "server", "site", "browser"}
SLOW_MODULES = {"test_bench", "test_compiled", "test_cpu_kernels", "test_engine_core", "test_llama_cpp_peer", "test_site"}


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: needs the real model, a server, a compiler, a browser or a notebook")


def pytest_collection_modifyitems(config, items):
    for item in items:
        module = getattr(item, "module", None)
        if (item.path.suffix == ".ipynb" or SLOW_FIXTURES & set(getattr(item, "fixturenames", ()))
                or (module is not None and module.__name__.rsplit(".", 1)[-1] in SLOW_MODULES)):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def real():
    """SmolLM2-135M-Instruct on DEVICE in the default dtype (float32 unless $ENGINELIB_DTYPE): (model, tokenizer)."""
    return enginelib.load_model(device=DEVICE, progress=False)


@pytest.fixture(scope="session")
def real_f32(real):
    """The same model in float32 (the very same object when that is the default)."""
    if real[0].dtype == torch.float32:
        return real
    return enginelib.load_model(device=DEVICE, dtype=torch.float32, progress=False)


_TALLY: list[Agreement] = []  # every check_greedy verdict of the session, for the terminal summary


@pytest.fixture
def agree(real_f32):
    """``agree(model, prompts, got, expected)``: check_greedy against the float32 model, tallied."""
    def check(model, prompts, got, expected) -> Agreement:
        reference = real_f32[0] if model.cfg == real_f32[0].cfg else None
        verdict = check_greedy(model, prompts, got, expected, reference=reference)
        _TALLY.append(verdict)
        return verdict
    return check


def pytest_terminal_summary(terminalreporter):
    if _TALLY:
        identical = sum(a.identical for a in _TALLY)
        ties = [d for a in _TALLY for d in a.near_ties]
        terminalreporter.write_line(
            f"greedy comparisons (check_greedy): {identical} requests identical, {len(ties)} near-tie "
            f"divergences {[round(d.margin, 4) for d in ties]}")


# Test modules where ``tiny`` stays on the CPU whatever DEVICE is, and why (the GPU check runs the rest on the GPU).
TINY_ON_CPU = {
    "test_model": "its tests feed the model token ids they make on the CPU",
    "test_quant": "its tests feed CPU token ids and register CPU-only stand-in kernels",
    "test_compiled": "inductor's C++ wrapper, oneDNN linears and random caches made on the CPU",
    "test_cpu_kernels": "our C++ kernels run on the CPU only",
    "test_fused_step": "the whole step is one of our C++ kernels, which run on the CPU only",
    "test_fake_cuda": "it makes fake CUDA tensors from the CPU model's (FakeTensorMode, no GPU needed)",
}


def tiny_device(module: str, device: torch.device = DEVICE) -> torch.device:
    """Where the ``tiny`` fixture puts the model for a test of ``module`` (its name, e.g. "test_paged")."""
    return torch.device("cpu") if module in TINY_ON_CPU else device


@pytest.fixture
def tiny(request) -> Transformer:
    """A random-weight toy model in float32, on DEVICE (the CPU for :data:`TINY_ON_CPU`): the same code, seconds
    instead of minutes. Its weights are drawn on the CPU, so they are the same on every device."""
    torch.manual_seed(0)
    model = Transformer(ModelConfig.tiny())
    for p in model.parameters():  # random norms too, so a mix-up of weights shows
        torch.nn.init.normal_(p, std=0.2)
    return model.eval().requires_grad_(False).to(tiny_device(request.module.__name__.rsplit(".", 1)[-1]))


@pytest.fixture
def tiny_dt(tiny):
    """The tiny model in the default dtype ($ENGINELIB_DTYPE) on DEVICE, for the engine; ``tiny`` stays float32."""
    return copy.deepcopy(tiny).to(device=DEVICE, dtype=default_dtype())


def tiny_tokenizer(vocab_size: int) -> Tokenizer:
    """A word-level tokenizer "t0 t1 ..." for the tiny model; the last id is EOS."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, pre_tokenizers

    backend = HFTokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return Tokenizer(backend, eos_token_id=vocab_size - 1)


def chat_ids(tokenizer, question: str) -> list[int]:
    return tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": question}]))


def hf_weights(model: Transformer) -> dict[str, torch.Tensor]:
    """The model's weights under Hugging Face names, q/k/v and gate/up split again."""
    weights = {"model.embed_tokens.weight": model.embed_tokens.weight, "model.norm.weight": model.norm.weight}
    if not model.cfg.tie_word_embeddings:
        weights["lm_head.weight"] = model.lm_head.weight
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        attn = layer.self_attn
        for kind in ("weight", "bias") if model.cfg.qkv_bias else ("weight",):
            q, k, v = getattr(attn.qkv_proj, kind).split(attn.split)
            weights |= {p + f"self_attn.q_proj.{kind}": q, p + f"self_attn.k_proj.{kind}": k,
                        p + f"self_attn.v_proj.{kind}": v}
        gate, up = layer.mlp.gate_up_proj.weight.chunk(2)
        weights |= {p + "self_attn.o_proj.weight": attn.o_proj.weight,
                    p + "mlp.gate_proj.weight": gate, p + "mlp.up_proj.weight": up,
                    p + "mlp.down_proj.weight": layer.mlp.down_proj.weight,
                    p + "input_layernorm.weight": layer.input_layernorm.weight,
                    p + "post_attention_layernorm.weight": layer.post_attention_layernorm.weight}
    return {name: t.detach().clone().contiguous() for name, t in weights.items()}


def batched_equals_alone(model: Transformer, tokenizer, prompts: list[list[int]], params) -> list[list[int]]:
    """Run ``prompts`` through one engine, batched together; assert each request's tokens equal the plain
    single-request reference's (the oracle) and that every block came back; return the tokens."""
    from enginelib.baselines import generate_cached
    from enginelib.core.engine import Engine, EngineConfig

    alone = [generate_cached(model, p, params, tokenizer.eos_token_id).token_ids for p in prompts]
    engine = Engine(model, tokenizer, EngineConfig(num_blocks=64, block_size=16))
    ids = [engine.add_request(p, params) for p in prompts]
    while engine.has_unfinished_requests():
        engine.step()
    got = [engine.request(i).output_token_ids for i in ids]
    assert got == alone  # batched together, the same tokens as each alone
    assert engine.pool.num_used == 0
    return got
