"""The model and what it needs to run: the transformer (chapter 1), its weights and tokenizer,
sampling, the device and the greedy-equality checks."""
from enginelib.model.transformer import (
    MLP,
    Attention,
    Cache,
    DecoderLayer,
    ModelConfig,
    RMSNorm,
    SequenceCache,
    Transformer,
    apply_rope,
    attention,
    attention_mask,
    rope_cos_sin,
)

__all__ = ["MLP", "Attention", "Cache", "DecoderLayer", "ModelConfig", "RMSNorm", "SequenceCache", "Transformer",
           "apply_rope", "attention", "attention_mask", "rope_cos_sin"]
