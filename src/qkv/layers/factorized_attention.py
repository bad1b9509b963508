"""Attention over video tokens: joint space-time, or factorised into space then time.

A clip of T frames, each cut into N patches, is a grid of tokens (B, T, N, E). Joint space-time
attention treats them as one sequence of T * N tokens, each attending to all others: (T N)^2
scores per head. Factorised attention splits that in two (Bertasius et al. 2021, TimeSformer,
s3 "divided space-time attention"; Arnab et al. 2021, ViViT, s3.3 "Model 3: factorised
self-attention"):

    spatial   each frame on its own: (B, T, N, E) -> (B * T, N, E)        T N^2 scores
    temporal  each patch position on its own: (B, T, N, E) -> (B * N, T, E)    N T^2 scores

Each is one `MultiHeadAttention` over a reshaped batch. The same results come from full
attention over all T * N tokens (numbered frame by frame: token t * N + n is patch n of frame
t) under a block mask: `same_frame_mask` for the spatial step, `same_position_mask` for the
temporal one. The reshape computes only the scores the mask keeps; the mask computes all
(T N)^2 and throws most away (`qkv.analysis.cost.video` counts both).

`FactorizedBlock` is the pre-norm block of ViViT's model 3: x + spatial(LN(x)), then
x + temporal(LN(x)), then x + FFN(LN(x)) (TimeSformer puts the temporal step first).
`SpaceTimeBlock` is ViViT's model 1, a pre-norm `EncoderBlock` over all T * N tokens.
Both map (B, T, N, E) to (B, T, N, E).
"""

from __future__ import annotations

import torch
from torch import nn

from qkv.layers._dropout import make_dropout
from qkv.layers.attention import MultiHeadAttention
from qkv.layers.blocks import EncoderBlock
from qkv.layers.feedforward import FeedForward
from qkv.layers.norms import LayerNorm
from qkv.layers.residual import pre_norm
from qkv.validation import check_positive_int, describe

__all__ = [
    "FactorizedBlock",
    "SpaceTimeBlock",
    "same_frame_mask",
    "same_position_mask",
    "spatial_attention",
    "temporal_attention",
]


def _frame_and_position(
    num_frames: int, num_patches: int, device: torch.device | str | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(frame, patch position) of each of the T * N tokens, numbered frame by frame."""
    T = check_positive_int("num_frames", num_frames)
    N = check_positive_int("num_patches", num_patches)
    token = torch.arange(T * N, device=device)  # (T * N,)
    return token // N, token % N


def same_frame_mask(
    num_frames: int, num_patches: int, *, device: torch.device | str | None = None
) -> torch.Tensor:
    """(T N, T N) bool, True where query and key lie in the same frame: full attention under
    this mask is spatial attention (a block-diagonal mask of T blocks of N x N)."""
    frame, _ = _frame_and_position(num_frames, num_patches, device)
    return frame[:, None] == frame[None, :]


def same_position_mask(
    num_frames: int, num_patches: int, *, device: torch.device | str | None = None
) -> torch.Tensor:
    """(T N, T N) bool, True where query and key are the same patch position (in any frame):
    full attention under this mask is temporal attention."""
    _, position = _frame_and_position(num_frames, num_patches, device)
    return position[:, None] == position[None, :]


def spatial_attention(attention: MultiHeadAttention, x: torch.Tensor) -> torch.Tensor:
    """`attention` within each frame: x (B, T, N, E) -> (B, T, N, E), each token attending to
    the N tokens of its own frame."""
    B, T, N, E = _check_video_tokens(x, attention)
    frames = x.reshape(B * T, N, E)  # (B * T, N, E): one sequence per frame
    return attention(frames).view(B, T, N, E)


def temporal_attention(attention: MultiHeadAttention, x: torch.Tensor) -> torch.Tensor:
    """`attention` across frames: x (B, T, N, E) -> (B, T, N, E), each token attending to the
    T tokens at its own patch position."""
    B, T, N, E = _check_video_tokens(x, attention)
    tubes = x.transpose(1, 2).reshape(B * N, T, E)  # (B * N, T, E): one sequence per position
    return attention(tubes).view(B, N, T, E).transpose(1, 2)  # (B, T, N, E)


class FactorizedBlock(nn.Module):
    """Spatial attention, temporal attention, then the FFN, each pre-norm with a residual
    (Arnab et al. 2021, s3.3, model 3). x (B, T, N, E) -> (B, T, N, E).

    Args: embed_dim E, num_heads (of both attentions), ffn_dim, dropout (on attention weights,
    FFN activations and residual branches), activation (the FFN's), eps (the LayerNorms').

    Submodules: spatial_attn, temporal_attn (`MultiHeadAttention`), ffn, norm1, norm2, norm3,
    dropout.
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        ffn_dim: int,
        *,
        dropout: float = 0.0,
        activation: str = "gelu",
        eps: float = 1e-6,
    ) -> None:
        super().__init__()
        self.spatial_attn = MultiHeadAttention(embed_dim, num_heads, dropout=dropout)
        self.temporal_attn = MultiHeadAttention(embed_dim, num_heads, dropout=dropout)
        self.ffn = FeedForward(embed_dim, ffn_dim, activation=activation, dropout=dropout)
        self.norm1 = LayerNorm(embed_dim, eps=eps)
        self.norm2 = LayerNorm(embed_dim, eps=eps)
        self.norm3 = LayerNorm(embed_dim, eps=eps)
        self.dropout = make_dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (B, T, N, E) -> (B, T, N, E)."""
        x = pre_norm(x, lambda h: spatial_attention(self.spatial_attn, h), self.norm1,
                     self.dropout)  # fmt: skip
        x = pre_norm(x, lambda h: temporal_attention(self.temporal_attn, h), self.norm2,
                     self.dropout)  # fmt: skip
        return pre_norm(x, self.ffn, self.norm3, self.dropout)


class SpaceTimeBlock(nn.Module):
    """Joint space-time attention (Arnab et al. 2021, s3.3, model 1): a pre-norm
    `EncoderBlock` over all T * N tokens of a clip. x (B, T, N, E) -> (B, T, N, E).

    Arguments as `FactorizedBlock`'s. Submodule: block (the `EncoderBlock`).
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        ffn_dim: int,
        *,
        dropout: float = 0.0,
        activation: str = "gelu",
        eps: float = 1e-6,
    ) -> None:
        super().__init__()
        self.block = EncoderBlock(
            embed_dim, num_heads, ffn_dim, dropout=dropout, activation=activation,
            norm_first=True, eps=eps,
        )  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (B, T, N, E) -> (B, T, N, E)."""
        B, T, N, E = _check_video_tokens(x, self.block.self_attn)
        tokens = x.reshape(B, T * N, E)  # (B, T * N, E): frame by frame
        return self.block(tokens).view(B, T, N, E)


def _check_video_tokens(
    x: torch.Tensor, attention: MultiHeadAttention
) -> tuple[int, int, int, int]:
    if not isinstance(x, torch.Tensor) or x.dim() != 4 or x.shape[-1] != attention.embed_dim:
        raise ValueError(
            f"x: expected video tokens of shape (B, T, N, {attention.embed_dim}), got {describe(x)}"
        )
    B, T, N, E = x.shape
    return B, T, N, E
