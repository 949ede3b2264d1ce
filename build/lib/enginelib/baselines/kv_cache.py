"""The contiguous KV cache of Part I: one slab of ``max_len`` slots per sequence, reserved up front
whether or not the sequence ever uses them (chapters 3 and 4). Part II replaces it with
:class:`enginelib.core.paged_cache.PagedKVCache`."""
from __future__ import annotations

import torch

from enginelib.model.transformer import ModelConfig, attention, attention_mask


class ContiguousKVCache:
    """K/V for a batch of sequences, each in its own preallocated row of ``max_len`` slots.

    Sequences are left-padded so that they all end at the same column: row ``b``
    holds ``pad[b]`` padding slots, then its tokens. Padding slots are never
    attended to, and positions count from each row's first real token.
    """

    def __init__(self, cfg: ModelConfig, batch_size: int, max_len: int, *,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                 pad: list[int] | None = None) -> None:
        shape = (cfg.num_layers, batch_size, max_len, cfg.num_kv_heads, cfg.head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.max_len = max_len
        self.length = 0  # columns filled so far, the same for every row
        self.pad = torch.tensor(pad or [0] * batch_size, device=device)
        self._mask: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def positions(self, num_tokens: int) -> torch.Tensor:
        """Positions of the next ``num_tokens`` columns, per row: [B, T]."""
        cols = torch.arange(self.length, self.length + num_tokens, device=self.pad.device)
        return (cols[None, :] - self.pad[:, None]).clamp(min=0)

    def _build_mask(self, num_tokens: int) -> torch.Tensor | None:
        """[B, 1, T, S]: a query sees earlier columns that are not padding (and itself)."""
        end = self.length + num_tokens
        if num_tokens == 1 and not bool(self.pad.any()):
            return None  # one new token, no padding: it may see everything
        q_cols = torch.arange(self.length, end, device=self.pad.device)[:, None]
        k_cols = torch.arange(end, device=self.pad.device)[None, :]
        causal = k_cols <= q_cols
        real = k_cols[None] >= self.pad[:, None, None]
        # A padding query still sees itself, so no row of the softmax is empty (no NaN).
        return ((causal[None] & real) | (k_cols == q_cols)[None])[:, None]

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Store this step's K/V in the next columns, then attend over all filled columns."""
        t = q.shape[1]
        end = self.length + t
        if end > self.max_len:
            raise ValueError(f"KV cache is full: {end} tokens do not fit in max_len={self.max_len}")
        if layer == 0:  # one additive mask per step, shared by every layer
            allowed = self._build_mask(t)
            groups = q.shape[2] // k.shape[2]
            self._mask = None if allowed is None else attention_mask(allowed, groups, q.dtype)
        self.k[layer, :, self.length:end] = k
        self.v[layer, :, self.length:end] = v
        return attention(q, self.k[layer, :, :end], self.v[layer, :, :end], self._mask)

    def advance(self, num_tokens: int) -> None:
        self.length += num_tokens
