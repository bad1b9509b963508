"""The checks of `MultiHeadAttention`'s sizes and rotary embedding, made once when a layer (or a
config that builds layers) is constructed; `qkv.layers.attention` calls them."""

from __future__ import annotations

from torch import nn

from qkv.positional import RotaryEmbedding
from qkv.validation import check_positive_int

__all__ = ["check_heads", "check_rope", "check_sizes"]


def check_sizes(embed_dim: int, num_heads: int, num_kv_heads: int, context_dim: int | None) -> None:
    """Positive sizes (context_dim: None or positive) and heads that fit them."""
    check_positive_int("embed_dim", embed_dim)
    check_positive_int("num_heads", num_heads)
    check_positive_int("num_kv_heads", num_kv_heads)
    if context_dim is not None:
        check_positive_int("context_dim", context_dim)
    check_heads(embed_dim, num_heads, num_kv_heads)


def check_heads(embed_dim: int, num_heads: int, num_kv_heads: int) -> None:
    """Heads that split embed_dim evenly, and K/V heads that each serve the same number of query
    heads (MHA: as many, GQA: a divisor, MQA: one; Ainslie et al. 2023)."""
    if embed_dim % num_heads:
        raise ValueError(
            f"embed_dim: {embed_dim} is not divisible by num_heads={num_heads}; expected a "
            f"multiple of num_heads (head_dim = embed_dim // num_heads)"
        )
    if num_heads % num_kv_heads:
        raise ValueError(
            f"num_kv_heads: {num_kv_heads} does not divide num_heads={num_heads}; expected a "
            f"divisor (MHA: equal, GQA: a divisor, MQA: 1)"
        )


def check_rope(
    rope: RotaryEmbedding | None, head_dim: int, *, size: str = "embed_dim // num_heads"
) -> RotaryEmbedding | None:
    """`rope` is None or a rotary embedding built for `head_dim` (`size` says what that is)."""
    if rope is None:
        return None
    if not isinstance(rope, nn.Module):
        raise TypeError(
            f"rope: expected a qkv.positional.RotaryEmbedding or None, got {type(rope).__name__}"
        )
    rope_dim = getattr(rope, "head_dim", head_dim)
    if rope_dim != head_dim:
        raise ValueError(
            f"rope: built for head_dim={rope_dim}, expected head_dim={head_dim} ({size})"
        )
    return rope
