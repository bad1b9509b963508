"""`DecoderCache`: what the encoder-decoder keeps between decoding steps.

At inference the encoder runs once and the decoder generates one token per step. Two kinds of keys
and values make each step cheap:

- self-attention: the target's keys and values grow by one token per step. They are written into
  a `StaticKVCache` (one slot per target position), so the new token's query attends over them
  without recomputing the prefix: O(t) per step instead of O(t^2).
- cross-attention: the keys and values are projections of the encoder's memory, which never
  changes while decoding. Each layer's `CrossAttentionCache` computes them on the first step and
  reuses them on every later one (and for every beam).

Beam search reorders both with `reorder(index)`: one gather over the batch rows.
"""

from __future__ import annotations

import torch
from torch import nn

from qkv.layers.kv_cache import CrossAttentionCache, LayerCache, StaticKVCache
from qkv.validation import check_int

__all__ = ["DecoderCache"]


class DecoderCache:
    """The self-attention `StaticKVCache` of a decoder stack and one `CrossAttentionCache` per
    layer. Build it with `DecoderCache.for_decoder(...)`, pass it to `Transformer.decode(...,
    cache=)`, then feed only the new target tokens at each call."""

    def __init__(
        self, self_attention: StaticKVCache, cross_attention: list[CrossAttentionCache]
    ) -> None:
        if not isinstance(self_attention, StaticKVCache):
            raise TypeError(
                f"self_attention: expected a StaticKVCache, got {type(self_attention).__name__}"
            )
        num_layers = self_attention.num_layers
        if len(cross_attention) != num_layers or not all(
            isinstance(cache, CrossAttentionCache) for cache in cross_attention
        ):
            raise ValueError(
                f"cross_attention: expected {num_layers} CrossAttentionCache (one per layer of "
                f"self_attention), got {[type(cache).__name__ for cache in cross_attention]}"
            )
        self.self_attention = self_attention
        self.cross_attention = list(cross_attention)

    @classmethod
    def for_decoder(cls, decoder: nn.Module, *, batch_size: int, max_length: int) -> DecoderCache:
        """An empty cache for `decoder` (a `DecoderStack`): `batch_size` rows of up to
        `max_length` target tokens, in the dtype and on the device of its parameters."""
        check_int("batch_size", batch_size, minimum=1)
        check_int("max_length", max_length, minimum=1)
        attention = decoder.blocks[0].self_attn
        # Any parameter: its projections may be swapped for weightless modules
        # (qkv.acceleration.packed_linears), its norms keep theirs.
        weight = next(decoder.parameters())
        self_attention = StaticKVCache(
            num_layers=len(decoder.blocks),
            batch=batch_size,
            num_kv_heads=attention.num_kv_heads,
            head_dim=attention.head_dim,
            max_length=max_length,
            dtype=weight.dtype,
            device=weight.device,
        )
        return cls(self_attention, [CrossAttentionCache() for _ in decoder.blocks])

    @property
    def length(self) -> int:
        """Target tokens cached so far: the position of the next token."""
        return self.self_attention.length

    @property
    def batch_size(self) -> int:
        return self.self_attention.batch_size

    @property
    def max_length(self) -> int:
        return self.self_attention.max_length

    @staticmethod
    def check_step(cache: object, batch_size: int, num_new_tokens: int) -> int:
        """Refuse a cache that is no DecoderCache or has no room for the step; return the
        position of the step's first token (cache.length)."""
        if not isinstance(cache, DecoderCache):
            raise TypeError(f"cache: expected a DecoderCache or None, got {type(cache).__name__}")
        if cache.batch_size != batch_size or cache.length + num_new_tokens > cache.max_length:
            raise ValueError(
                f"cache: holds {cache.length} of at most {cache.max_length} tokens for "
                f"{cache.batch_size} rows; expected room for {num_new_tokens} more tokens in "
                f"{batch_size} rows (those of decoder_input_ids)"
            )
        return cache.length

    def layer(self, index: int) -> tuple[LayerCache, CrossAttentionCache]:
        """(self-attention cache, cross-attention cache) of decoder layer `index`."""
        return self.self_attention.layer(index), self.cross_attention[index]

    def advance(self, num_tokens: int) -> None:
        """Every layer has written `num_tokens` more target tokens."""
        self.self_attention.advance(num_tokens)

    def reorder(self, index: torch.Tensor) -> None:
        """Keep the batch rows `index` (B',), in that order, in both caches (one gather each).

        Beam search calls this to follow each surviving beam's parent; an index with repeats
        (e.g. `arange(B).repeat_interleave(K)`) expands B source rows into B * K beams.
        """
        self.reorder_self_attention(index)
        self.reorder_cross_attention(index)

    def reorder_self_attention(self, index: torch.Tensor) -> None:
        """Reorder only the target's keys and values. Enough when `index` maps every row to a
        row of the same source sentence (beams of one sentence share their cross-attention)."""
        self.self_attention.reorder(index)

    def reorder_cross_attention(self, index: torch.Tensor) -> None:
        """Reorder only the memory's keys and values (see `reorder`)."""
        for cache in self.cross_attention:
            cache.reorder(index)
