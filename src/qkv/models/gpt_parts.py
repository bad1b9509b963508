"""What each of a `GPTConfig`'s component choices builds: the norm, the FFN, the rotary
embedding, the position table and T5's bias of a `qkv.models.GPT`, made once as it is built
(and T5's bias, computed once per forward for all the layers)."""

from __future__ import annotations

import torch
from torch import nn

from qkv.layers import FeedForward, LayerNorm, RMSNorm, SwiGLU
from qkv.models.gpt_config import GPTConfig
from qkv.positional import (
    LearnedPositionalEmbedding,
    RotaryEmbedding,
    SinusoidalPositionalEncoding,
    T5RelativeBias,
)

__all__ = [
    "make_ffn",
    "make_norm",
    "make_position_embedding",
    "make_relative_bias",
    "make_rope",
    "once_per_shape",
]


def make_norm(config: GPTConfig) -> nn.Module:
    """The norm a config asks for: LayerNorm (GPT-2) or RMSNorm (Llama), over E features."""
    if config.norm == "layernorm":
        return LayerNorm(config.embed_dim, eps=config.norm_eps, bias=config.bias)
    return RMSNorm(config.embed_dim, eps=config.norm_eps)


def make_ffn(config: GPTConfig) -> nn.Module:
    """The feed-forward sub-layer: GELU(tanh) MLP (GPT-2) or SwiGLU (Llama; Shazeer 2020)."""
    if config.ffn == "gelu_tanh":
        return FeedForward(
            config.embed_dim, config.ffn_dim, activation="gelu_tanh", bias=config.bias
        )
    return SwiGLU(config.embed_dim, config.ffn_dim, bias=config.bias)


def make_rope(config: GPTConfig) -> RotaryEmbedding | None:
    """RoPE for the attention layers when positions are rotary, else None (learned positions
    are added to the embeddings instead). Half-split layout: that of Hugging Face's Llama."""
    if config.position == "rope":
        return RotaryEmbedding(
            config.head_dim, base=config.rope_base, layout="half", scaling=config.rope_scaling
        )
    return None


def make_position_embedding(config: GPTConfig) -> nn.Module | None:
    """What is added to the token embeddings: a learned table (GPT-2) or the sinusoids of
    Vaswani et al. 2017 (s3.5, computed past the table on the fly); None for the kinds that act
    inside attention (rope, alibi, t5) and for "none"."""
    if config.position == "learned":
        return LearnedPositionalEmbedding(config.max_positions, config.embed_dim)
    if config.position == "sinusoidal":
        return SinusoidalPositionalEncoding(config.embed_dim, config.max_positions)
    return None


def make_relative_bias(config: GPTConfig) -> T5RelativeBias | None:
    """T5's causal bucketed bias (Raffel et al. 2020, s2.1), one table for all the layers."""
    if config.position != "t5":
        return None
    return T5RelativeBias(
        config.num_heads, bidirectional=False, num_buckets=config.relative_buckets,
        max_distance=config.relative_max_distance,
    )  # fmt: skip


def once_per_shape(bias):
    """`bias(L_q, L_k)` computed once per shape and shared by every layer of one forward (T5's
    table is one for all layers; each layer learns L_k only from its cache)."""
    computed: dict[tuple[int, int], torch.Tensor] = {}

    def shared(L_q: int, L_k: int) -> torch.Tensor:
        if isinstance(L_q, torch.SymInt) or isinstance(L_k, torch.SymInt):
            return bias(L_q, L_k)  # a symbolic size (torch.export) has no hash: one per layer
        if (L_q, L_k) not in computed:
            computed[L_q, L_k] = bias(L_q, L_k)
        return computed[L_q, L_k]

    return shared
