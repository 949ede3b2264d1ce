"""Shared fixtures: the real model is loaded once per test session."""
from __future__ import annotations

import pytest
import torch

import enginelib
from enginelib.model import ModelConfig, Transformer

enginelib.set_threads()


@pytest.fixture(scope="session")
def real():
    """SmolLM2-135M-Instruct on the CPU in float32: (model, tokenizer)."""
    return enginelib.load_model(device="cpu", dtype=torch.float32, progress=False)


@pytest.fixture
def tiny() -> Transformer:
    """A random-weight toy model: the same code, seconds instead of minutes."""
    torch.manual_seed(0)
    model = Transformer(ModelConfig.tiny())
    for p in model.parameters():  # random norms too, so a mix-up of weights shows
        torch.nn.init.normal_(p, std=0.2)
    return model.eval().requires_grad_(False)


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
