"""The paged KV cache: attention through block tables equals dense attention, and the
block pool keeps its books straight under any schedule of arrivals and aborts."""
from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from enginelib.baselines import generate_cached
from enginelib.core.batch import Batch, SequenceWork
from enginelib.core.block_pool import BlockPool, NoFreeBlocks
from enginelib.core.engine import Engine, EngineConfig
from enginelib.core.paged_cache import PagedKVCache
from enginelib.core.scheduler import SchedulerConfig
from enginelib.model import ModelConfig, attention
from enginelib.model.checks import check_greedy
from enginelib.model.device import HostBuffer, default_dtype
from enginelib.model.sampling import SamplingParams

from .conftest import tiny_tokenizer


def test_block_pool_allocates_shares_and_frees():
    pool = BlockPool(4, 16)
    a = pool.allocate(3)
    assert pool.stats().used == 3 and pool.blocks_for(33) == 3
    with pytest.raises(NoFreeBlocks):
        pool.allocate(2)
    pool.share(a[:1])
    pool.free(a)
    assert pool.num_free == 3 and pool.ref_counts[a[0]] == 1
    pool.free(a[:1])
    with pytest.raises(ValueError, match="double free"):
        pool.free(a[:1])
    assert pool.num_free == 4 and pool.high_water == 3
    pool.check()


@pytest.mark.parametrize("block_size", [1, 3, 4, 16])
def test_paged_attention_equals_dense_attention_across_block_boundaries(block_size):
    torch.manual_seed(block_size)
    cfg = ModelConfig.tiny(num_layers=1)
    dtype = default_dtype()
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # bfloat16 keeps 8 bits of mantissa: ~4e-3 per rounding
    # Three sequences: a decode with a long past, a prefill continuing a past, a fresh prefill.
    past, new = [13, 5, 0], [1, 6, 9]
    total = [p + n for p, n in zip(past, new)]
    cache = PagedKVCache(cfg, num_blocks=40, block_size=block_size, dtype=dtype)
    order = list(range(40))
    random.Random(block_size).shuffle(order)  # blocks scattered through the pool
    tables, dense_k, dense_v = [], [], []
    for t in total:
        blocks = [order.pop() for _ in range(-(-t // block_size))]
        tables.append(blocks)
        k, v = (torch.randn(t, cfg.num_kv_heads, cfg.head_dim, dtype=dtype) for _ in "kv")
        dense_k.append(k)
        dense_v.append(v)
        for pos in range(t):  # what earlier steps would have written
            cache.k[0, blocks[pos // block_size], pos % block_size] = k[pos]
            cache.v[0, blocks[pos // block_size], pos % block_size] = v[pos]
    batch = Batch.build([SequenceWork([0] * n, p, tb) for n, p, tb in zip(new, past, tables)], block_size)
    q = torch.randn(1, sum(new), cfg.num_heads, cfg.head_dim, dtype=dtype)
    k_new = torch.cat([k[p:] for k, p in zip(dense_k, past)])[None]
    v_new = torch.cat([v[p:] for v, p in zip(dense_v, past)])[None]
    out = cache.bind(batch).attend(0, q, k_new, v_new)[0]
    row = 0
    for p, n, k, v in zip(past, new, dense_k, dense_v):
        causal = torch.arange(p + n)[None, :] <= torch.arange(p, p + n)[:, None]
        expected = attention(q[:, row:row + n], k[None], v[None], causal[None, None])
        torch.testing.assert_close(out[row:row + n], expected[0], atol=tol, rtol=tol)
        row += n


def test_batch_slot_mapping_follows_the_block_table():
    batch = Batch.build([SequenceWork([7, 8, 9], 3, [5, 2])], block_size=4)
    # positions 3, 4, 5 -> block 5 offset 3, block 2 offsets 0 and 1
    assert batch.slot_mapping.tolist() == [23, 8, 9]
    assert batch.context_lens.tolist() == [6] and batch.logits_indices.tolist() == [2]
    with pytest.raises(ValueError, match="cannot hold"):
        Batch.build([SequenceWork([1] * 5, 4, [0, 1])], block_size=4)


def test_a_tiny_pool_forces_preemption_and_outputs_stay_exact(tiny, tiny_dt):
    tok = tiny_tokenizer(tiny.cfg.vocab_size)
    engine = Engine(tiny_dt, tok, EngineConfig(num_blocks=8, block_size=2, scheduler=SchedulerConfig(max_num_seqs=4)))
    rng = random.Random(0)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    prompts = {engine.add_request(p, params): p for p in
               ([rng.randrange(tiny.cfg.vocab_size) for _ in range(4)] for _ in range(5))}
    while engine.has_unfinished_requests():
        engine.step()
        engine.pool.check({r.request_id: r.block_table for r in engine.scheduler.running})
    assert engine.stats().preemptions > 0
    assert engine.pool.num_used == 0
    got = [engine.request(rid).output_token_ids for rid in prompts]
    expected = [generate_cached(tiny_dt, prompt, params).token_ids for prompt in prompts.values()]
    print(check_greedy(tiny_dt, list(prompts.values()), got, expected, reference=tiny))


def test_a_batch_crosses_to_the_device_in_one_copy():
    """Every field of a Batch is a view of one tensor: one host-to-device copy per step, not six."""
    batch = Batch.build([SequenceWork([7, 8, 9], 3, [5, 2]), SequenceWork([4], 9, [1, 3, 6])], block_size=4)
    fields = (batch.token_ids, batch.positions, batch.slot_mapping, batch.block_tables, batch.context_lens,
              batch.logits_indices)
    assert len({t.untyped_storage().data_ptr() for t in fields}) == 1
    assert batch.block_tables.tolist() == [[5, 2, 0], [1, 3, 6]]
    assert batch.positions.tolist() == [3, 4, 5, 9] and batch.logits_indices.tolist() == [2, 3]


def test_a_cpu_batch_reuses_one_host_buffer_and_its_views():
    """With a HostBuffer (the runner's on a CPU) the next step's batch is written into the same tensor, through the
    same views when its sizes repeat: the numbers are the fresh batch's, and a buffer too small grows."""
    host = HostBuffer(size=8)
    seqs = [SequenceWork([7, 8, 9], 3, [5, 2]), SequenceWork([4], 9, [1, 3, 6])]
    first = Batch.build(seqs, 4, host=host)
    fresh = Batch.build(seqs, 4)
    for got, want in zip(dataclasses.astuple(first), dataclasses.astuple(fresh)):
        assert (got.tolist() if isinstance(got, torch.Tensor) else got) == \
            (want.tolist() if isinstance(want, torch.Tensor) else want)
    assert len(host.array) >= 20 and first.token_ids.untyped_storage().data_ptr() == host.tensor.data_ptr()
    again = Batch.build([SequenceWork([1, 2, 3], 0, [4]), SequenceWork([5], 2, [0, 1, 2])], 4, host=host)
    assert again.token_ids is first.token_ids and again.token_ids.tolist() == [1, 2, 3, 5]  # the same view, new values
    assert again.block_tables.tolist() == [[4, 0, 0], [0, 1, 2]] and again.slot_mapping.tolist() == [16, 17, 18, 2]


class _HostReads(torch.overrides.TorchFunctionMode):
    """Counts the calls that read tensor values back to Python (on a GPU, each one waits for the device)."""

    READS = {torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.__int__, torch.Tensor.__bool__,
             torch.Tensor.__float__, torch.Tensor.__index__, torch.Tensor.nonzero, torch.nonzero}

    def __init__(self):
        super().__init__()
        self.reads = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in self.READS:
            self.reads.append(getattr(func, "__name__", str(func)))
        return func(*args, **(kwargs or {}))


def test_a_step_reads_back_from_the_device_once_whatever_the_sampling(tiny_dt):
    tok = tiny_tokenizer(tiny_dt.cfg.vocab_size)
    engine = Engine(tiny_dt, tok, EngineConfig(num_blocks=32, block_size=4))
    for i, params in enumerate([SamplingParams(temperature=0, max_tokens=6),
                                SamplingParams(temperature=0.8, top_p=0.9, seed=1, max_tokens=6),
                                SamplingParams(temperature=1.0, top_k=5, seed=2, max_tokens=6),
                                SamplingParams(temperature=0.7, max_tokens=6)]):
        engine.add_request([3 + i, 4, 5, 6 + i][: 2 + i], params)
    engine.step()  # four prefills
    engine.add_request([9, 10, 11], SamplingParams(temperature=0, max_tokens=3))
    for _ in range(3):  # a mixed step (one prefill, four decodes), then pure decodes
        with _HostReads() as mode:
            engine.step()
        assert mode.reads == ["tolist"], f"one read per step expected, got {mode.reads}"
