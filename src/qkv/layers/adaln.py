"""Adaptive LayerNorm with a zero-initialised gate (adaLN-Zero; Peebles & Xie 2023, DiT, s3.2).

A diffusion Transformer is told the noise level through its normalisations: a conditioning
vector c (the timestep embedding) is mapped by SiLU + Linear to a shift, a scale and a gate
per sub-layer, and each sub-layer becomes

    x = x + gate * sublayer(LN(x) * (1 + scale) + shift)          (B, L, E)

with LN a LayerNorm without its own weight and bias (the modulation replaces them). The
linear map that produces (shift, scale, gate) starts at zero, so every gate is 0 and the block
is the identity at initialisation (DiT's "adaLN-Zero", s3.2, after Goyal et al. 2017's
zero-initialised last BatchNorm of each residual block).

`AdaLNZeroBlock` holds three such sub-layers: self-attention over the image tokens,
cross-attention to a text context (the prompt's tokens as keys and values: Rombach et al.
2022, s3.3; DiT's cross-attention variant, s3.2), and a feed-forward network.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from qkv.layers._dropout import make_dropout
from qkv.layers.attention import MultiHeadAttention
from qkv.layers.feedforward import FeedForward
from qkv.validation import check_positive_float, check_positive_int

__all__ = ["AdaLNModulation", "AdaLNZeroBlock", "layer_norm_without_affine", "modulate"]


def modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x * (1 + scale) + shift: x (B, L, E), shift and scale (B, 1, E) broadcast over L."""
    return x * (1 + scale) + shift


def layer_norm_without_affine(x: torch.Tensor, eps: float) -> torch.Tensor:
    """(x - mean) / sqrt(var + eps) over the last axis (biased var), computed in fp32 at least;
    no weight and no bias: adaLN's modulation supplies them."""
    compute_dtype = torch.promote_types(x.dtype, torch.float32)
    return F.layer_norm(x.to(compute_dtype), (x.shape[-1],), eps=eps).to(x.dtype)


class AdaLNModulation(nn.Module):
    """c (B, cond_dim) -> num_chunks tensors of shape (B, 1, E): SiLU, then one zero-initialised
    Linear(cond_dim -> num_chunks * E), split in order (DiT's adaLN-Zero, Peebles & Xie 2023,
    s3.2). Submodule `proj`."""

    def __init__(
        self,
        cond_dim: int,
        embed_dim: int,
        num_chunks: int,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        check_positive_int("cond_dim", cond_dim)
        self.embed_dim = check_positive_int("embed_dim", embed_dim)
        self.num_chunks = check_positive_int("num_chunks", num_chunks)
        self.proj = nn.Linear(cond_dim, num_chunks * embed_dim, device=device, dtype=dtype)
        nn.init.zeros_(self.proj.weight)
        nn.init.zeros_(self.proj.bias)

    def forward(self, cond: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if cond.dim() != 2:
            raise ValueError(f"cond: expected shape (B, cond_dim), got {tuple(cond.shape)}")
        chunks = self.proj(F.silu(cond)).unsqueeze(1)  # (B, 1, num_chunks * E)
        return chunks.chunk(self.num_chunks, dim=-1)  # num_chunks x (B, 1, E)


class AdaLNZeroBlock(nn.Module):
    """Self-attention, cross-attention and feed-forward, each gated by adaLN-Zero.

        x = x + g1 * SelfAttn(modulate(LN(x), b1, s1))
        x = x + g2 * CrossAttn(modulate(LN(x), b2, s2), context)
        x = x + g3 * FFN(modulate(LN(x), b3, s3))

    where (b1, s1, g1, b2, s2, g2, b3, s3, g3) = nn.Linear(SiLU(c)), zero at initialisation, so
    the block starts as the identity (Peebles & Xie 2023, s3.2).

    Args:
        embed_dim: E, the width of the tokens.
        num_heads: attention heads of both attentions.
        ffn_dim: the feed-forward hidden width.
        cond_dim: width of the conditioning vector c (default E).
        context_dim: width of the cross-attention context (default E).
        activation: the FFN's ("gelu" in DiT).
        dropout: on each sub-layer's output and inside the FFN, in training mode.
        eps: the LayerNorm epsilon (1e-6 in DiT).

    Submodules: self_attn, cross_attn (`MultiHeadAttention`), ffn (`FeedForward`),
    modulation (`AdaLNModulation` with 9 chunks), dropout.
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        ffn_dim: int,
        *,
        cond_dim: int | None = None,
        context_dim: int | None = None,
        activation: str = "gelu",
        dropout: float = 0.0,
        eps: float = 1e-6,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        self.eps = check_positive_float("eps", eps)
        self.self_attn = MultiHeadAttention(embed_dim, num_heads, **factory)
        self.cross_attn = MultiHeadAttention(
            embed_dim, num_heads, context_dim=context_dim, **factory
        )
        self.ffn = FeedForward(
            embed_dim, ffn_dim, activation=activation, dropout=dropout, **factory
        )
        cond_dim = embed_dim if cond_dim is None else cond_dim
        self.modulation = AdaLNModulation(cond_dim, embed_dim, 9, **factory)
        self.dropout = make_dropout(dropout)

    def forward(
        self,
        x: torch.Tensor,
        cond: torch.Tensor,
        context: torch.Tensor,
        *,
        context_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x (B, L, E), cond (B, cond_dim), context (B, S, context_dim) -> (B, L, E).

        context_mask: a qkv mask over the context's keys (True = may attend), e.g. the
        prompt's padding as (B, 1, 1, S) from `qkv.masks.padding`."""
        (shift_sa, scale_sa, gate_sa, shift_ca, scale_ca, gate_ca,
         shift_ff, scale_ff, gate_ff) = self.modulation(cond)  # fmt: skip  # each (B, 1, E)
        h = modulate(layer_norm_without_affine(x, self.eps), shift_sa, scale_sa)
        x = x + gate_sa * self.dropout(self.self_attn(h))
        h = modulate(layer_norm_without_affine(x, self.eps), shift_ca, scale_ca)
        x = x + gate_ca * self.dropout(self.cross_attn(h, context, mask=context_mask))
        h = modulate(layer_norm_without_affine(x, self.eps), shift_ff, scale_ff)
        return x + gate_ff * self.dropout(self.ffn(h))
