"""Transformer encoder and decoder blocks: sub-layers wrapped in "Add & Norm".

Every sub-layer (self-attention, cross-attention, feed-forward) sits inside a residual connection
with a LayerNorm, post-norm or pre-norm (qkv.layers.residual); a block picks one of the two once,
at construction, instead of branching in every forward. The encoder block has self-attention
then FFN; the decoder block has masked (causal) self-attention, cross-attention to the
encoder's memory, then FFN (Vaswani et al. 2017, s3.1).
"""

from __future__ import annotations

import torch
from torch import nn

from qkv.attention.sparse import SparsePattern
from qkv.layers import torch_interop
from qkv.layers._dropout import make_dropout
from qkv.layers.attention import MultiHeadAttention
from qkv.layers.feedforward import FeedForward
from qkv.layers.kv_cache import CrossAttentionCache, LayerCache
from qkv.layers.norms import LayerNorm
from qkv.layers.residual import post_norm, pre_norm

__all__ = ["DecoderBlock", "EncoderBlock"]


class EncoderBlock(nn.Module):
    """Self-attention then feed-forward, each wrapped in Add & Norm.

    Submodules: self_attn, ffn, norm1, norm2, and `dropout` on each sub-layer's output. The
    attention weights and the FFN's hidden layer use the same p by default, as in
    `nn.TransformerEncoderLayer`; `attention_dropout` / `ffn_dropout` set them apart (BERT drops
    attention weights at its own rate and has no dropout inside the FFN). Input/output (B, L, E).
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        ffn_dim: int,
        *,
        num_kv_heads: int | None = None,
        dropout: float = 0.0,
        attention_dropout: float | None = None,
        ffn_dropout: float | None = None,
        activation: str = "relu",
        norm_first: bool = False,
        eps: float = 1e-5,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        factory = {"bias": bias, "device": device, "dtype": dtype}
        attention_dropout = dropout if attention_dropout is None else attention_dropout
        ffn_dropout = dropout if ffn_dropout is None else ffn_dropout
        self.self_attn = MultiHeadAttention(
            embed_dim, num_heads, num_kv_heads, dropout=attention_dropout, **factory
        )
        self.ffn = FeedForward(
            embed_dim, ffn_dim, activation=activation, dropout=ffn_dropout, **factory
        )
        self.norm1 = LayerNorm(embed_dim, eps=eps, **factory)
        self.norm2 = LayerNorm(embed_dim, eps=eps, **factory)
        self.dropout = make_dropout(dropout)
        self.norm_first = _check_bool("norm_first", norm_first)
        self.residual = pre_norm if norm_first else post_norm

    def forward(
        self,
        x: torch.Tensor,
        *,
        mask: torch.Tensor | None = None,
        causal: bool = False,
        pattern: SparsePattern | None = None,
    ) -> torch.Tensor:
        """x (B, L, E) -> (B, L, E). mask: a qkv mask (True = may attend), e.g. padding.
        pattern: a sparse pattern (`qkv.sparse`), e.g. `Packed` for sequences packed along L."""

        def attend(h: torch.Tensor) -> torch.Tensor:
            return self.self_attn(h, mask=mask, causal=causal, pattern=pattern)

        x = self.residual(x, attend, self.norm1, self.dropout)
        return self.residual(x, self.ffn, self.norm2, self.dropout)

    @classmethod
    def from_torch(cls, layer: nn.TransformerEncoderLayer) -> EncoderBlock:
        """The same block as `nn.TransformerEncoderLayer` (activation relu or gelu), weights
        copied. The result is batch-first whatever `layer` uses (the weights do not depend on it).
        """
        block = cls(**_block_config(layer, layer.self_attn))
        torch_interop.load_mha_from_torch(block.self_attn, layer.self_attn)
        _load_ffn_and_norms(block, layer, ("norm1", "norm2"))
        return block


class DecoderBlock(nn.Module):
    """Causal self-attention, cross-attention to memory, feed-forward; each in Add & Norm.

    Submodules: self_attn, cross_attn, ffn, norm1, norm2, norm3 and `dropout` on each
    sub-layer's output, as in `nn.TransformerDecoderLayer`. The memory (the encoder's output)
    has width E. Input and output (B, L, E).
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        ffn_dim: int,
        *,
        num_kv_heads: int | None = None,
        dropout: float = 0.0,
        activation: str = "relu",
        norm_first: bool = False,
        eps: float = 1e-5,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        factory = {"bias": bias, "device": device, "dtype": dtype}
        self.self_attn = MultiHeadAttention(
            embed_dim, num_heads, num_kv_heads, dropout=dropout, **factory
        )
        self.cross_attn = MultiHeadAttention(
            embed_dim, num_heads, num_kv_heads, dropout=dropout, **factory
        )
        self.ffn = FeedForward(
            embed_dim, ffn_dim, activation=activation, dropout=dropout, **factory
        )
        self.norm1 = LayerNorm(embed_dim, eps=eps, **factory)
        self.norm2 = LayerNorm(embed_dim, eps=eps, **factory)
        self.norm3 = LayerNorm(embed_dim, eps=eps, **factory)
        self.dropout = make_dropout(dropout)
        self.norm_first = _check_bool("norm_first", norm_first)
        self.residual = pre_norm if norm_first else post_norm

    def forward(
        self,
        x: torch.Tensor,
        memory: torch.Tensor,
        *,
        mask: torch.Tensor | None = None,
        memory_mask: torch.Tensor | None = None,
        causal: bool = True,
        self_cache: LayerCache | None = None,
        cross_cache: CrossAttentionCache | None = None,
    ) -> torch.Tensor:
        """x (B, L, E) attends to itself (causally by default) and to memory (B, L_mem, E).

        mask: a qkv mask over x's own keys (e.g. target padding); memory_mask: over the memory's
        keys, (B, 1, 1, L_mem) from `qkv.masks.padding`, or (L, L_mem). Returns (B, L, E).

        Incremental (autoregressive) decoding: with `self_cache` x holds only the new tokens, whose
        keys and values join the cached ones (mask then covers every cached key, causal aligns the
        new queries bottom-right); with `cross_cache` the memory's keys and values are projected on
        the first call and reused after.
        """
        _check_caches(self_cache, cross_cache)
        x = self.residual(
            x,
            lambda h: self.self_attn(h, mask=mask, causal=causal, cache=self_cache),
            self.norm1,
            self.dropout,
        )
        x = self.residual(
            x,
            lambda h: self.cross_attn(h, memory, mask=memory_mask, cache=cross_cache),
            self.norm2,
            self.dropout,
        )
        return self.residual(x, self.ffn, self.norm3, self.dropout)

    @classmethod
    def from_torch(cls, layer: nn.TransformerDecoderLayer) -> DecoderBlock:
        """The same block as `nn.TransformerDecoderLayer` (activation relu or gelu), weights
        copied; `multihead_attn` becomes `cross_attn`. Batch-first whatever `layer` uses.
        """
        block = cls(**_block_config(layer, layer.self_attn))
        torch_interop.mha_config_from_torch(layer.multihead_attn)  # refuses what qkv lacks
        torch_interop.load_mha_from_torch(block.self_attn, layer.self_attn)
        torch_interop.load_mha_from_torch(block.cross_attn, layer.multihead_attn)
        _load_ffn_and_norms(block, layer, ("norm1", "norm2", "norm3"))
        return block


def _block_config(layer: nn.Module, self_attn: nn.MultiheadAttention) -> dict:
    """Constructor arguments of a qkv block equivalent to a PyTorch Transformer layer."""
    attn = torch_interop.mha_config_from_torch(self_attn)
    return {
        "embed_dim": attn["embed_dim"],
        "num_heads": attn["num_heads"],
        "ffn_dim": layer.linear1.out_features,
        "dropout": float(layer.dropout.p),
        "activation": torch_interop.activation_name(layer.activation),
        "norm_first": bool(layer.norm_first),
        "eps": float(layer.norm1.eps),
        "bias": layer.linear1.bias is not None,
        "device": attn["device"],
        "dtype": attn["dtype"],
    }


def _load_ffn_and_norms(block: nn.Module, layer: nn.Module, norms: tuple[str, ...]) -> None:
    torch_interop.copy_weight_and_bias(block.ffn.up_proj, layer.linear1)
    torch_interop.copy_weight_and_bias(block.ffn.down_proj, layer.linear2)
    for name in norms:
        torch_interop.copy_weight_and_bias(getattr(block, name), getattr(layer, name))


def _check_caches(self_cache: object, cross_cache: object) -> None:
    """Each attention layer takes its own kind of cache: swapping them would silently attend
    to the wrong keys (a LayerCache in cross-attention appends the memory to the target's)."""
    if self_cache is not None and not isinstance(self_cache, LayerCache):
        raise TypeError(
            f"self_cache: expected a qkv.layers.LayerCache (e.g. StaticKVCache.layer(i)) or "
            f"None, got {type(self_cache).__name__}"
        )
    if cross_cache is not None and not isinstance(cross_cache, CrossAttentionCache):
        raise TypeError(
            f"cross_cache: expected a qkv.layers.CrossAttentionCache or None, got "
            f"{type(cross_cache).__name__}"
        )


def _check_bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name}: expected a bool, got {type(value).__name__} {value!r}")
    return value
