"""A whole decode step in one C++ call, as llama.cpp runs its graph: the model as the GGUF stores it (int4 layers, an
int8 or q8_0 head, :func:`enginelib.speed.quant.load_quantized` with the ``cpp_q8`` kernel), every layer's norms,
matvecs, RoPE, paged attention and residuals in ``enginelib::q8_decode_step`` (csrc/q8.cpp).

A compiled step (chapter 14) already runs its kernels from C++, but each of its 151 operator calls still goes
through torch's dispatcher with fresh tensor handles and an output allocated, and Python builds the call's 430
arguments each step. This step passes the weights as one object, made once, and allocates a handful of buffers;
its threads run the whole step in one parallel region, meeting at barriers between its phases (where each matvec
would open and close its own), and note each row's argmax as they write the logits: the greedy token, returned
beside them. It serves decode steps only (one new token per sequence); the runner runs the others as before.
"""
from __future__ import annotations

import torch

from enginelib.model.transformer import Transformer
from enginelib.speed.huge_pages import move_to_huge_pages
from enginelib.step.attention import PagedPools
from enginelib.step.batch import Batch


def fused_step_unavailable(model: Transformer) -> str | None:
    """Why ``model`` cannot decode through :class:`FusedDecodeStep` (None: it can)."""
    from enginelib.speed import cpu_kernels
    from enginelib.speed.quant.kernels import QuantLinear

    if model.device.type != "cpu" or model.dtype != torch.float32:
        return f"the fused step runs float32 models on a CPU, not {model.dtype} on {model.device.type}"
    if model.cfg.qkv_bias:
        return "the fused step has no biases (a LLaMA-family model without qkv_bias)"
    layers = [m for layer in model.layers for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                                     layer.mlp.gate_up_proj, layer.mlp.down_proj)]
    if not all(isinstance(m, QuantLinear) and m.kernel.name == "cpp_q8" and m.fmt == "int4" for m in layers):
        return "the fused step needs every layer int4 with the cpp_q8 kernel (load_quantized(..., 'cpp_q8'))"
    head = model.lm_head
    if not (isinstance(head, QuantLinear) and head.kernel.name == "cpp_q8" and head.fmt in ("int8", "q8_0")):
        return "the fused step needs an int8 or q8_0 head with the cpp_q8 kernel"
    return cpu_kernels.build_failure(model.device)


class FusedDecodeStep:
    """Decode steps of ``model`` through ``enginelib::q8_decode_step``: ``serves(batch)``, ``__call__(batch, cache)``
    -> (logits [N, vocab], each row's argmax [N]), as :class:`enginelib.speed.compiled.CompiledDecoder` returns
    logits, which the runner takes it for; the argmax is the greedy token, taken by the threads that wrote the row."""

    def __init__(self, model: Transformer) -> None:
        reason = fused_step_unavailable(model)
        if reason:
            raise ValueError(reason)
        self.model = model
        move_to_huge_pages(model)  # the weights every step streams, on 2 MiB pages (huge_pages.py: why)
        head = model.lm_head.prepared
        weights = [model.embed_tokens.weight, model.norm.weight, head.data, head.scale]
        for layer in model.layers:
            for norm, pair in ((layer.input_layernorm, (layer.self_attn.qkv_proj, layer.self_attn.o_proj)),
                               (layer.post_attention_layernorm, (layer.mlp.gate_up_proj, layer.mlp.down_proj))):
                weights.append(norm.weight)
                for linear in pair:
                    w = linear.prepared
                    weights += [w.data, w.scale, w.minimum]
        self.tensors = [w.detach() for w in weights]
        self.weights = torch.classes.enginelib.DecodeWeights(self.tensors)  # passed as one object: no list to convert
        self.path = model.lm_head.prepared.path
        # the operator's one overload, called directly: the packet's call looks through every argument for a
        # stand-in of a torchbind object first (``DecodeWeights`` is one), a dozen checks a step
        self.op = torch.ops.enginelib.q8_decode_step.default
        self.steps = 0  # decode steps run here: a test can tell them from eager ones

    def serves(self, batch: Batch) -> bool:
        """A decode step: one new token per sequence, each sampled."""
        return batch.num_tokens == batch.num_seqs == len(batch.logits_indices)

    def __call__(self, batch: Batch, cache: PagedPools) -> tuple[torch.Tensor, torch.Tensor]:
        batch.check_pool(cache.num_blocks)  # the kernel trusts the tables
        self.steps += 1
        cfg = self.model.cfg
        return self.op(
            batch.token_ids, batch.positions, batch.block_tables, batch.context_lens, cache.k, cache.v, self.weights,
            cfg.num_heads, cfg.num_kv_heads, cfg.rms_norm_eps, cfg.rope_theta, self.path)
