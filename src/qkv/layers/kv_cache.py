"""KV caches: what autoregressive decoding keeps so each step costs O(t), not O(t^2).

At step t only the new token's q, k, v are computed; k and v are written into the cache and the new
query attends over everything cached. The cache is sized by the key/value heads, so GQA/MQA shrink
it by H / H_kv (Shazeer 2019; Ainslie et al. 2023):

    bytes per sample = L_ctx * layers * 2 (K and V) * H_kv * head_dim * bytes per element

A cache takes each layer's new q, k, v *before* RoPE and returns what attention should use, so
the two policies below can differ in where positions come from:
- `StaticKVCache`: preallocated, written at explicit slots; keys are rotated at their absolute
  positions once, when written.
- `SinkKVCache` (qkv.layers.sink_cache; attention sinks, Xiao et al. 2024): the first tokens
  and a window of recent ones, keys stored *before* RoPE and rotated by their place in the cache.
"""

from __future__ import annotations

import torch

from qkv.positional import RotaryEmbedding


class KVStorage:
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


class StaticKVCache(KVStorage):
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

    def kept_prefix(self, length: int, max_length: int) -> StaticKVCache:
        """A new cache holding this one's first `length` tokens, with at least `max_length`
        slots: this cache's tensors where they have that many (this cache is then not to be
        written again), else larger copies. Prefix caching (qkv.generation.prompt_cache)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"length: expected 0 <= length <= {self.length} (the tokens "
                             f"cached), got {length}")  # fmt: skip
        kept = StaticKVCache.__new__(StaticKVCache)
        kept.keys, kept.values, kept.length = self.keys, self.values, length
        kept.max_length = max(max_length, self.max_length)
        if max_length > self.max_length:
            kept.keys = tuple(_with_slots(keys, length, max_length) for keys in self.keys)
            kept.values = tuple(_with_slots(values, length, max_length) for values in self.values)
        return kept

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


def _with_slots(tensor: torch.Tensor, length: int, slots: int) -> torch.Tensor:
    """(B, H_kv, S, D) -> a new (B, H_kv, slots, D) holding its first `length` slots."""
    grown = tensor.new_zeros(*tensor.shape[:2], slots, tensor.shape[3])
    grown[:, :, :length] = tensor[:, :, :length]
    return grown


class LayerCache:
    """One layer's view of a model-wide cache: what `MultiHeadAttention` calls."""

    def __init__(self, cache: KVStorage, index: int) -> None:
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
