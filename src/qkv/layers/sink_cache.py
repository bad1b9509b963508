"""`SinkKVCache`: attention sinks and a sliding window (StreamingLLM, Xiao et al. 2024).

The cache keeps the first `num_sinks` tokens and a window of the most recent ones, stores keys
*before* RoPE and rotates them by their position inside the cache at every step, so a model
generates far past its cache size with constant memory and positions that never exceed what it
was trained on. It shares its storage with `StaticKVCache` (qkv.layers.kv_cache).
"""

from __future__ import annotations

import torch

from qkv.layers.kv_cache import KVStorage
from qkv.positional import RotaryEmbedding, apply_rope, rope_cos_sin

__all__ = ["SinkKVCache"]


class SinkKVCache(KVStorage):
    """Attention sinks + a sliding window of recent tokens, keys stored before RoPE.

    Slots [0, num_sinks) hold the first tokens forever; the remaining `window` slots are a ring
    buffer of the most recent ones. At each step the cached keys are gathered oldest to newest
    and rotated by their position in that order (0 .. n - 1), and the new query by n - 1.
    """

    def __init__(
        self,
        *,
        num_layers: int,
        batch: int,
        num_kv_heads: int,
        head_dim: int,
        num_sinks: int,
        window: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        if num_sinks < 0 or window < 1:
            raise ValueError(
                f"num_sinks, window: expected >= 0 and >= 1, got {num_sinks}, {window}"
            )
        shape = (batch, num_kv_heads, num_sinks + window, head_dim)
        # length: tokens seen, which may exceed the capacity
        super().__init__(num_layers, shape, dtype, device)
        self.num_sinks, self.window = num_sinks, window

    @property
    def capacity(self) -> int:
        return self.num_sinks + self.window

    def _slot(self, token_index: int) -> int:
        """Where the token_index-th token of the sequence lives."""
        if token_index < self.num_sinks:
            return token_index
        return self.num_sinks + (token_index - self.num_sinks) % self.window

    def _order(self, count: int) -> list[int]:
        """Slots of the cached tokens, oldest first, once `count` tokens have been seen."""
        first_recent = max(self.num_sinks, count - self.window)
        return [self._slot(i) for i in range(min(count, self.num_sinks))] + [
            self._slot(i) for i in range(first_recent, count)
        ]

    def attend_inputs(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        rope: RotaryEmbedding | None,
        positions: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One new token (T = 1): store its k, v unrotated, then return q and the cached keys
        rotated by their cache positions. `positions` is ignored: positions come from the cache.
        """
        if k.shape[2] != 1:
            raise ValueError(f"k: a SinkKVCache takes one token per step, got {k.shape[2]}")
        slot = self._slot(self.length)
        self.keys[layer][:, :, slot] = k[:, :, 0]
        self.values[layer][:, :, slot] = v[:, :, 0]
        order = torch.tensor(self._order(self.length + 1), device=k.device)
        keys = self.keys[layer].index_select(2, order)  # (B, H_kv, n, D), oldest first
        values = self.values[layer].index_select(2, order)
        if rope is not None:
            cache_positions = torch.arange(keys.shape[2], device=k.device)  # 0 .. n - 1
            cos, sin = rope_cos_sin(
                cache_positions,
                rope.head_dim,
                base=rope.base,
                layout=rope.layout,
                dtype=torch.promote_types(keys.dtype, torch.float32),
                scaling=rope.scaling,
            )
            keys = apply_rope(keys, cos, sin, layout=rope.layout)
            q = apply_rope(q, cos[-1:], sin[-1:], layout=rope.layout)  # the newest position
        return q, keys, values
