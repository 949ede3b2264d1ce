"""Tensor parallelism (chapter 16): the split covers every head and column once, and two processes
generate the single process's greedy tokens."""
from __future__ import annotations

import itertools

import pytest
import torch

from enginelib import LLM, SamplingParams, parallel
from enginelib.model.transformer import ModelConfig, Transformer
from tests.conftest import tiny_tokenizer


def test_the_shards_cover_every_head_and_column_once_and_keep_groups_together():
    cfg = ModelConfig()  # SmolLM2: 9 query heads, 3 KV heads, 1536 MLP columns
    for world in (1, 2, 3):
        shards = parallel.plan_shards(cfg, world)
        assert [s.rank for s in shards] == list(range(world))
        for field, total in (("heads", 9), ("kv_heads", 3), ("columns", 1536)):
            ranges = [getattr(s, field) for s in shards]
            assert ranges[0][0] == 0 and ranges[-1][1] == total
            assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))  # no gap, no overlap
        for s in shards:  # a KV head travels with the 3 query heads that share it
            assert s.heads == (s.kv_heads[0] * 3, s.kv_heads[1] * 3)
            assert s.config(cfg).num_heads // s.config(cfg).num_kv_heads == 3
    assert [s.kv_heads for s in parallel.plan_shards(cfg, 2)] == [(0, 2), (2, 3)]  # uneven: 2 + 1


@pytest.mark.parametrize("world", [0, 4])
def test_a_world_the_heads_cannot_fill_is_refused(world):
    with pytest.raises(ValueError, match="KV heads"):
        parallel.plan_shards(ModelConfig(), world)


def test_the_shards_partial_sums_add_up_to_the_whole_layer():
    torch.manual_seed(0)
    model = Transformer(ModelConfig.tiny(num_heads=6, num_kv_heads=3)).eval()
    layer = model.layers[0]
    x = torch.randn(1, 5, model.cfg.hidden_size)
    shards = parallel.plan_shards(model.cfg, 2)
    mlp_parts, attn_parts = [], []
    for s in shards:
        w = parallel.shard_weights(model, s)
        gate, up = (x @ w["layers.0.mlp.gate_up_proj.weight"].T).chunk(2, dim=-1)
        mlp_parts.append((torch.nn.functional.silu(gate) * up) @ w["layers.0.mlp.down_proj.weight"].T)
        assert w["embed_tokens.weight"].data_ptr() == model.embed_tokens.weight.data_ptr()  # replicated, not copied
        attn_parts.append(w["layers.0.self_attn.o_proj.weight"].shape[1])
    torch.testing.assert_close(sum(mlp_parts), layer.mlp(x))
    assert sum(attn_parts) == model.cfg.num_heads * model.cfg.head_dim


def test_two_processes_generate_the_single_process_tokens_with_the_tiny_model():
    torch.manual_seed(0)
    model = Transformer(ModelConfig.tiny(num_heads=6, num_kv_heads=3))
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.2)
    model = model.eval().requires_grad_(False)
    tok = tiny_tokenizer(model.cfg.vocab_size)
    prompts = [[1, 2, 3, 4, 5], [9, 8, 7], list(range(10, 40))]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    expected = [list(o.outputs[0].token_ids) for o in LLM.from_model(model, tok).generate(prompts, params)]
    reports = parallel.generate(model, tok, prompts, params, world_size=2, timeout=120)
    assert reports[0].token_ids == expected
    # 12 steps x 2 layers x 2 all-reduces on every rank, in lockstep
    assert [r.comm.calls for r in reports] == [12 * 2 * 2] * 2


def test_the_real_model_split_in_two_generates_the_engines_greedy_tokens(real, agree):
    model, tok = real
    prompts = [tok.encode(p) for p in ("The capital of France is", "def fibonacci(n):")]
    params = SamplingParams(max_tokens=16, temperature=0.0)
    expected = [list(o.outputs[0].token_ids) for o in LLM.from_model(model, tok).generate(prompts, params)]
    reports = parallel.generate(model, tok, prompts, params, world_size=2)
    agree(model, prompts, reports[0].token_ids, expected)


def test_a_failing_rank_is_reported_not_waited_for():
    model = Transformer(ModelConfig.tiny(num_heads=6, num_kv_heads=3)).eval()
    tok = tiny_tokenizer(model.cfg.vocab_size)
    with pytest.raises(RuntimeError, match="rank 0 failed"):  # an engine argument no rank accepts
        parallel.generate(model, tok, [[1, 2]], SamplingParams(max_tokens=2), world_size=2, no_such_arg=1)
