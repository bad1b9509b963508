"""KV caches: what autoregressive decoding keeps so each step costs O(t), not O(t^2).

At step t only the new token's q, k, v are computed; k and v are written into the cache and the new
query attends over everything cached. The cache is sized by the key/value heads, so GQA/MQA shrink
it by H / H_kv (Shazeer 2019; Ainslie et al. 2023):

    bytes per sample = L_ctx * layers * 2 (K and V) * H_kv * head_dim * bytes per element

A cache takes each layer's new q, k, v *before* RoPE and returns what attention should use, so
the two policies below can differ in where positions come from:
- `StaticKVCache`: preallocated, written at explicit slots; keys are rotated at their absolute
  positions once, when written.
- `SinkKVCache` (attention sinks: StreamingLLM, Xiao et al. 2024): keeps the first
  `num_sinks` tokens and a window of the most recent ones, stores keys *before* RoPE and rotates
  them by their position inside the cache at every step, so a model generates far past its
  cache size with constant memory and positions that never exceed what it was trained on.
"""

from __future__ import annotations

import torch

from qkv.positional import RotaryEmbedding, apply_rope, rope_cos_sin


class _KVStorage:
    """Keys and values of every layer, one (B, H_kv, slots, D) tensor per layer in `keys` and
    `values`, and their size: the part both cache policies share.

    One allocation per layer, not one (layers, B, H_kv, slots, D) tensor: under torch.compile a
    write into a slice of one tensor shared by every layer is traced as a new copy of the whole
    tensor (functionalization) at every layer, and inductor made those copies, plus a copy of
    each layer's keys and values for attention, at every step (O(layers^2 x slots)); a write
    into a layer's own tensor compiles to an in-place store of the new token's slot."""

    def __init__(self, num_layers: int, shape: tuple[int, ...], dtype: torch.dtype, device) -> None:
        layers = range(num_layers)
        self.keys = tuple(torch.zeros(shape, dtype=dtype, device=device) for _ in layers)
        self.values = tuple(torch.zeros(shape, dtype=dtype, device=device) for _ in layers)
        self.length = 0  # tokens written so far, shared by every layer (a host-side int)

    @property
    def num_layers(self) -> int:
        return len(self.keys)

    @property
    def batch_size(self) -> int:
        return self.keys[0].shape[0]

    @property
    def nbytes(self) -> int:
        return sum(tensor.nbytes for tensor in self.keys + self.values)

    @property
    def bytes_per_sample(self) -> int:
        """L_ctx * layers * 2 * H_kv * head_dim * bytes per element."""
        return self.nbytes // self.batch_size

    def layer(self, index: int) -> LayerCache:
        """The cache of one attention layer, as `MultiHeadAttention(..., cache=)` takes it."""
        return LayerCache(self, index)

    def advance(self, num_tokens: int) -> None:
        """Every layer has written `num_tokens` more: move the write slot."""
        self.length += num_tokens

    def reorder(self, index: torch.Tensor) -> None:
        """Beam search: keep the batch rows `index` (B',), in that order (one gather per
        tensor); repeats expand B prompts into B * num_beams rows."""
        self.keys = tuple(keys.index_select(0, index) for keys in self.keys)
        self.values = tuple(values.index_select(0, index) for values in self.values)


class StaticKVCache(_KVStorage):
    """Preallocated keys and values for every layer: (B, H_kv, max_length, D) each."""

    def __init__(
        self,
        *,
        num_layers: int,
        batch: int,
        num_kv_heads: int,
        head_dim: int,
        max_length: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        shape = (batch, num_kv_heads, max_length, head_dim)
        super().__init__(num_layers, shape, dtype, device)
        self.max_length = max_length

    def check_room(self, num_tokens: int) -> None:
        """Raise ValueError where `num_tokens` more tokens would not fit in the slots."""
        end = self.length + num_tokens
        if end > self.max_length:
            raise ValueError(
                f"cache: {end} tokens exceed max_length={self.max_length}; expected a longer "
                f"cache or a SinkKVCache"
            )

    def attend_inputs(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        rope: RotaryEmbedding | None,
        positions: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rotate q and the new k at `positions` (B, T), write k, v at slots [length, length + T),
        return (q, all cached keys, all cached values) for attention."""
        T = k.shape[2]
        end = self.length + T
        self.check_room(T)
        if rope is not None:
            if positions is None:  # one sequence, no padding: the slots are the positions
                positions = torch.arange(self.length, end, device=k.device)
            q, k = rope(q, k, positions=positions)
        keys, values = self.keys[layer], self.values[layer]
        keys[:, :, self.length : end] = k
        values[:, :, self.length : end] = v
        return q, keys[:, :, :end], values[:, :, :end]


class SinkKVCache(_KVStorage):
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


class LayerCache:
    """One layer's view of a model-wide cache: what `MultiHeadAttention` calls."""

    def __init__(self, cache: _KVStorage, index: int) -> None:
        self.cache, self.index = cache, index

    def attend_inputs(self, q, k, v, rope, positions):
        """New q, k, v (B, H|H_kv, T, D), before RoPE -> (q, keys, values) for attention."""
        return self.cache.attend_inputs(self.index, q, k, v, rope, positions)


class CrossAttentionCache:
    """Cross-attention keys and values of one decoder layer: computed from the encoder's
    memory on the first step and reused by every later step (and every beam)."""

    def __init__(self) -> None:
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None

    def keys_values(self, compute) -> tuple[torch.Tensor, torch.Tensor]:
        if self.keys is None:
            self.keys, self.values = compute()
        return self.keys, self.values

    def reorder(self, index: torch.Tensor) -> None:
        """Beam search: keep the rows `index` (B',) of the batch, in that order."""
        if self.keys is not None:
            self.keys = self.keys.index_select(0, index)
            self.values = self.values.index_select(0, index)
