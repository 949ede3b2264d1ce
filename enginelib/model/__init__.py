"""The model (chapter 1) and what it runs with: weights, tokenizer, sampling, device, greedy-equality checks."""
from enginelib.model.transformer import (MLP, Attention, Cache, DecoderLayer, ModelConfig, RMSNorm, SequenceCache,
                                         Transformer, apply_rope, attention, attention_mask, rope_cos_sin)

__all__ = ["MLP", "Attention", "Cache", "DecoderLayer", "ModelConfig", "RMSNorm", "SequenceCache", "Transformer",
           "apply_rope", "attention", "attention_mask", "rope_cos_sin"]
