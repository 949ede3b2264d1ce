"""A LLaMA-family decoder written to be read: RMSNorm, RoPE, grouped-query attention, SwiGLU. It knows nothing of
requests: each layer hands its queries, keys and values to a *cache* (``cache.attend``), which stores K/V as it likes
and returns the attention output; without one, attention is causal over the tokens given."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class ModelConfig:
    """The shape of a LLaMA-style model (defaults: SmolLM2-135M)."""
    vocab_size: int = 49152
    hidden_size: int = 576
    intermediate_size: int = 1536
    num_layers: int = 30
    num_heads: int = 9
    num_kv_heads: int = 3
    head_dim: int = 64
    rope_theta: float = 100000.0
    rms_norm_eps: float = 1e-5
    context_length: int = 8192
    tie_word_embeddings: bool = True
    qkv_bias: bool = False  # Qwen2 adds a bias to q, k and v

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")

    @classmethod
    def tiny(cls, **changes) -> "ModelConfig":
        """A random-weight toy for fast unit tests."""
        base = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
                    num_heads=4, num_kv_heads=2, head_dim=16, context_length=256)
        return cls(**{**base, **changes})

    def kv_bytes_per_token(self, dtype: torch.dtype = torch.float32) -> int:
        """K and V, for every layer and KV head: what one cached token costs."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype.itemsize


class Cache(Protocol):
    """What the model needs from a KV cache: store this layer's K/V, attend over what it holds."""

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor: ...


class SequenceCache(Cache, Protocol):
    """A cache that tracks its own length (Part I's contiguous cache): it knows the next positions."""

    def positions(self, num_tokens: int) -> torch.Tensor: ...
    def advance(self, num_tokens: int) -> None: ...


def attention_mask(allowed: torch.Tensor, num_groups: int, dtype: torch.dtype) -> torch.Tensor:
    """Turn a boolean mask [..., T, S] (True = may attend) into :func:`attention`'s additive one, once per step for all
    layers: 0 / -inf in the model's dtype, rows repeated for the ``num_groups`` query heads per KV head, stored 8-column
    aligned (GPU memory-efficient kernels copy a mask with an unaligned row stride on every call)."""
    t, s = allowed.shape[-2:]
    if num_groups > 1 and t > 1:
        allowed = allowed.repeat(*[1] * (allowed.dim() - 2), num_groups, 1)  # row (group j, query i) = row i
    width = -(-s // 8) * 8
    mask = torch.full((*allowed.shape[:-1], width), float("-inf"), dtype=dtype, device=allowed.device)
    return mask[..., :s].masked_fill_(allowed, 0.0)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              mask: torch.Tensor | None = None, causal: bool = False) -> torch.Tensor:
    """Scaled dot-product attention with grouped-query heads. q: [B, T, H, D]; k, v: [B, S, KV, D]; mask: broadcastable
    to [B, 1, T, S] (True = may attend), or from :func:`attention_mask`. Rather than copy each K/V head G = H // KV
    times, the G query heads of a group are folded into the query axis: [B, KV, G*T, D]."""
    b, t, h, d = q.shape
    kv = k.shape[2]
    g = h // kv
    if causal and mask is None:  # the last query sees every key; earlier ones one fewer each
        s = k.shape[1]
        mask = torch.ones(t, s, dtype=torch.bool, device=q.device).tril(s - t)
    if mask is not None and g > 1 and t > 1 and mask.shape[-2] == t:  # not yet folded (a boolean mask)
        mask = mask.repeat(*[1] * (mask.dim() - 2), g, 1)  # row (group j, query i) = mask row i
    q = q.reshape(b, t, kv, g, d).permute(0, 2, 3, 1, 4).reshape(b, kv, g * t, d)
    out = F.scaled_dot_product_attention(q, k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask)
    return out.reshape(b, kv, g, t, d).permute(0, 3, 1, 2, 4).reshape(b, t, h, d)


class RMSNorm(nn.Module):
    """Scale each vector to unit root-mean-square, then by a learned gain."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x * rsqrt(mean(x^2) + eps) * weight, computed in float32; torch's fused op does exactly that
        return F.rms_norm(x.float(), x.shape[-1:], eps=self.eps).to(x.dtype) * self.weight


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding tables for integer positions [B, T] -> cos, sin [B, T, 1, D]."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=positions.device).float() / head_dim)
    angles = positions.float()[..., None] * inv_freq
    angles = torch.cat([angles, angles], dim=-1)[:, :, None, :]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each (x_i, x_{i+D/2}) pair by its position's angle (the "half-split" layout)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    """Grouped-query self-attention; q, k and v come from one fused projection."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        h, kv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.split = [h * d, kv * d, kv * d]
        self.qkv_proj = nn.Linear(cfg.hidden_size, sum(self.split), bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(h * d, cfg.hidden_size, bias=False)

    def forward(self, x, cos, sin, layer: int, cache: Cache | None, mask: torch.Tensor | None = None) -> torch.Tensor:
        b, t, _ = x.shape
        cfg = self.cfg
        qk, v = self.qkv_proj(x).split([self.split[0] + self.split[1], self.split[2]], dim=-1)
        # q and k turn by the same angles: rotate all their heads in one go
        qk = apply_rope(qk.view(b, t, cfg.num_heads + cfg.num_kv_heads, cfg.head_dim), cos, sin)
        q, k = qk.split([cfg.num_heads, cfg.num_kv_heads], dim=2)
        v = v.view(b, t, cfg.num_kv_heads, cfg.head_dim)
        if cache is None:  # causal over the tokens given; ``mask`` is the forward pass's, built once
            out = attention(q, k, v, mask, causal=mask is None)
        else:
            out = cache.attend(layer, q, k, v)
        return self.o_proj(out.reshape(b, t, -1))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), gate and up fused into one matmul."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    """One decoder layer: pre-norm attention, then pre-norm MLP, each with a residual."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, layer: int, cache: Cache | None, mask: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, layer, cache, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class Transformer(nn.Module):
    """Token ids in, next-token logits out."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.packing = None  # load_model's timed verdict on oneDNN packing (model.packing.PackingChoice), if it timed

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    def forward(self, input_ids: torch.Tensor, cache: Cache | None = None, *, positions: torch.Tensor | None = None,
                last_only: bool = False, logits_indices: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids [B, T] -> logits [B, T, vocab] ([B, 1, vocab] with ``last_only``); positions default to the cache's
        (Part I) or 0..T-1. A *flat* batch (input_ids, positions: [N]) is sequences end to end, told apart by the cache.
        The LM head (the biggest matmul) runs only on rows to sample: ``logits_indices`` -> [R, vocab]."""
        flat = input_ids.dim() == 1
        if flat:
            if positions is None or cache is None:
                raise ValueError("a flat batch (input_ids [N]) needs its positions [N] and a cache that knows "
                                 "the sequences (PagedKVCache.bind(batch))")
            input_ids, positions = input_ids[None], positions[None]
        b, t = input_ids.shape
        if positions is None:
            positions = (cache.positions(t) if cache is not None
                         else torch.arange(t, device=input_ids.device).expand(b, t))
        x = self.embed_tokens(input_ids)
        cos, sin = rope_cos_sin(positions, self.cfg.head_dim, self.cfg.rope_theta, x.dtype)
        mask = None  # without a cache: one causal mask for every layer (a cache builds its own per step)
        if cache is None and t > 1:
            causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
            mask = attention_mask(causal, self.cfg.num_heads // self.cfg.num_kv_heads, x.dtype)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, i, cache, mask)
        if cache is not None and not flat:
            cache.advance(t)
        if last_only:
            x = x[:, -1:]
        if logits_indices is not None:
            x = x.reshape(-1, x.shape[-1])[logits_indices]
        return self.lm_head(self.norm(x))

    @classmethod
    def from_state_dict(cls, cfg: ModelConfig, weights: dict[str, torch.Tensor], *,
                        device: torch.device | str | None = None, dtype: torch.dtype | None = None,
                        consume: bool = False) -> "Transformer":
        """Build from Hugging Face-named tensors, fusing q/k/v and gate/up, on the ``meta`` device (no memory, no random
        init); each tensor is cast to ``dtype``/``device`` (default: as given) in turn, one already right used as is.
        With ``consume`` each is popped from ``weights`` when used, so the caller holds about one copy of the model (1B
        parameters in float32: 4.4 GB; Colab has 12.7 GB of RAM)."""
        with torch.device("meta"):
            model = cls(cfg)
        cast = {k: v for k, v in (("device", device), ("dtype", dtype)) if v is not None}

        def take(name: str) -> torch.Tensor:
            return (weights.pop(name) if consume else weights[name]).to(**cast)
        fused = {}
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            for kind in ("weight", "bias") if cfg.qkv_bias else ("weight",):
                names = [p + f"self_attn.{n}_proj.{kind}" for n in "qkv"]
                if all(n in weights for n in names):
                    fused[f"layers.{i}.self_attn.qkv_proj.{kind}"] = torch.cat([take(n) for n in names])
            names = [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"]
            if all(n in weights for n in names):
                fused[f"layers.{i}.mlp.gate_up_proj.weight"] = torch.cat([take(n) for n in names])
        for name in list(weights):
            if name == "lm_head.weight" and cfg.tie_word_embeddings:
                continue  # the embedding serves as the LM head
            if not any(f".{n}_proj." in name for n in ("q", "k", "v", "gate", "up")):
                fused[name.removeprefix("model.")] = take(name)
        missing, unexpected = model.load_state_dict(fused, strict=False, assign=True)
        if cfg.tie_word_embeddings:  # assign replaced the embedding's Parameter: tie the new one
            model.lm_head.weight = model.embed_tokens.weight
        missing = [m for m in missing if not (cfg.tie_word_embeddings and m == "lm_head.weight")]
        if missing or unexpected:
            raise ValueError(f"checkpoint does not fit the config: missing {missing[:5]}, unexpected {unexpected[:5]}")
        return model

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())
