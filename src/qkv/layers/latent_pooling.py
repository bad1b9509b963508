"""Learned-query cross-attention: N trained latent vectors read a long input (the Perceiver).

    latents = z                                            (N, E), trained
    z = z + CrossAttention(LN(z), LN(x))                   queries from z, keys/values from x
    z = z + FFN(LN(z))
    z = LatentBlock_k(z), k = 1 .. num_blocks              self-attention among the latents
    output LN(z)                                           (B, N, E)

Jaegle et al. 2021 ("Perceiver: General Perception with Iterative Attention", s2): a small
latent array attends to an input of L elements, so the cross-attention costs O(N L) instead of
self-attention's O(L^2), and the deeper processing runs on the N latents alone (O(N^2) per
block), whatever L is. With one latent and no latent blocks this is attention pooling: a learned
query weighs the input's elements, an alternative to a [CLS] token or the mean as a
classification head. The residual sub-layers are pre-norm (Xiong et al. 2020), as in the
Perceiver's; the attention is qkv's `MultiHeadAttention`, the latent blocks qkv's
`EncoderBlock`.
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
from qkv.validation import check_int, check_positive_int, describe

__all__ = ["LatentPooling"]


class LatentPooling(nn.Module):
    """N learned queries cross-attend to x (B, L, input_dim) -> latents (B, N, E).

    Args:
        embed_dim: E, the width of the latents and of the output.
        num_heads: heads of the cross-attention and of the latent blocks.
        num_latents: N, the learned queries (1: attention pooling).
        input_dim: width of the input x (default E).
        ffn_dim: hidden width of the FFNs (default 4 * E).
        num_blocks: pre-norm self-attention blocks over the latents after the cross-attention.
        dropout: on attention weights, FFN activations and residual branches (training only).
        activation: the FFNs' ("gelu", "gelu_tanh" or "relu").
        eps: the LayerNorms' epsilon.

    Parameters and submodules: `latents` (N, E), initialised from a normal of std 0.02
    truncated at +-2 (the Perceiver's); `latent_norm`, `input_norm`, `cross_attn`
    (`MultiHeadAttention` with context_dim = input_dim), `ffn_norm`, `ffn`, `blocks`
    (`EncoderBlock`s, pre-norm), `output_norm`.
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        *,
        num_latents: int = 1,
        input_dim: int | None = None,
        ffn_dim: int | None = None,
        num_blocks: int = 0,
        dropout: float = 0.0,
        activation: str = "gelu",
        eps: float = 1e-5,
    ) -> None:
        super().__init__()
        E = check_positive_int("embed_dim", embed_dim)
        self.num_latents = check_positive_int("num_latents", num_latents)
        self.input_dim = E if input_dim is None else check_positive_int("input_dim", input_dim)
        ffn_dim = 4 * E if ffn_dim is None else check_positive_int("ffn_dim", ffn_dim)
        check_int("num_blocks", num_blocks, minimum=0)
        self.latents = nn.Parameter(torch.empty(num_latents, E))  # (N, E)
        self.latent_norm = LayerNorm(E, eps=eps)
        self.input_norm = LayerNorm(self.input_dim, eps=eps)
        self.cross_attn = MultiHeadAttention(
            E, num_heads, context_dim=self.input_dim, dropout=dropout
        )
        self.ffn_norm = LayerNorm(E, eps=eps)
        self.ffn = FeedForward(E, ffn_dim, activation=activation, dropout=dropout)
        self.dropout = make_dropout(dropout)
        self.blocks = nn.ModuleList(
            EncoderBlock(E, num_heads, ffn_dim, dropout=dropout, activation=activation,
                         norm_first=True, eps=eps)
            for _ in range(num_blocks)
        )  # fmt: skip
        self.output_norm = LayerNorm(E, eps=eps)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """The latents from N(0, 0.02^2) truncated at +-2, as the Perceiver initialises them."""
        nn.init.trunc_normal_(self.latents, std=0.02, a=-2.0, b=2.0)

    def forward(
        self,
        x: torch.Tensor,
        *,
        mask: torch.Tensor | None = None,
        return_weights: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """x (B, L, input_dim) -> LN(latents) (B, N, E).

        mask: (B, L), 1/True on the elements of x to read and 0/False on padding (the polarity
        of `qkv.masks`). With return_weights, also the cross-attention weights (B, H, N, L):
        how much each latent reads from each element of x, per head.
        """
        key_mask = self._key_mask(x, mask)  # (B, 1, 1, L) or None
        captured: list[torch.Tensor] = []
        context = self.input_norm(x)  # (B, L, input_dim)

        def read(queries: torch.Tensor) -> torch.Tensor:
            result = self.cross_attn(queries, context, mask=key_mask,
                                     return_weights=return_weights)  # fmt: skip
            if not return_weights:
                return result
            captured.append(result[1])  # (B, H, N, L)
            return result[0]

        latents = self.latents.expand(x.shape[0], -1, -1)  # (B, N, E)
        latents = pre_norm(latents, read, self.latent_norm, self.dropout)
        latents = pre_norm(latents, self.ffn, self.ffn_norm, self.dropout)
        for block in self.blocks:
            latents = block(latents)
        latents = self.output_norm(latents)  # (B, N, E)
        return (latents, captured[0]) if return_weights else latents

    def extra_repr(self) -> str:
        return f"num_latents={self.num_latents}, input_dim={self.input_dim}"

    def _key_mask(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor | None:
        if not isinstance(x, torch.Tensor) or x.dim() != 3 or x.shape[-1] != self.input_dim:
            raise ValueError(f"x: expected shape (B, L, {self.input_dim}), got {describe(x)}")
        if mask is None:
            return None
        if not isinstance(mask, torch.Tensor) or tuple(mask.shape) != tuple(x.shape[:2]):
            raise ValueError(
                f"mask: expected shape {tuple(x.shape[:2])} (B, L), 1/True on the elements to "
                f"read, got {describe(mask)}"
            )
        return (mask != 0)[:, None, None, :]  # (B, 1, 1, L): True = may attend
