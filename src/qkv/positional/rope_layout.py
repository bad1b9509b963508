"""Moving a checkpoint between RoPE's two layouts (qkv.positional.rotary): "interleaved" pairs
(2i, 2i + 1), as in RoFormer and Meta's original Llama code and llama.cpp's GGUF files, and
"half" pairs (i, i + D/2), as in Hugging Face's Llama.

The layouts differ only by a permutation of each head's coordinates, so the permutation is
folded into the q and k projection weights once, and both give the same attention scores.
"""

from __future__ import annotations

import torch

from qkv.validation import check_int

__all__ = ["half_split_to_interleaved", "interleaved_to_half_split"]


def interleaved_to_half_split(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Reorder the output rows of a q or k projection from the interleaved to the half layout.

    weight: (num_heads * head_dim, in_features), or a bias (num_heads * head_dim,). Within each
    head, output row 2j + c (pair j, component c) moves to row c * head_dim/2 + j. A model that
    applies interleaved RoPE to the original projections then produces exactly the attention
    scores of half-layout RoPE on the converted ones: this is the `permute` of Hugging Face's
    `convert_llama_weights_to_hf.py`. Apply it to q_proj and k_proj (never to v or out).
    """
    head_dim = _check_projection(weight, num_heads)
    rows = weight.reshape(num_heads, head_dim // 2, 2, -1)  # (H, D/2, 2, in): row 2j + c
    return rows.transpose(1, 2).reshape(weight.shape)  # (H, 2, D/2, in): row c * D/2 + j


def half_split_to_interleaved(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """The inverse of `interleaved_to_half_split`: within each head, row c * head_dim/2 + j
    moves back to row 2j + c. weight: (num_heads * head_dim, in_features) or a 1-D bias."""
    head_dim = _check_projection(weight, num_heads)
    rows = weight.reshape(num_heads, 2, head_dim // 2, -1)  # (H, 2, D/2, in): row c * D/2 + j
    return rows.transpose(1, 2).reshape(weight.shape)  # (H, D/2, 2, in): row 2j + c


def _check_projection(weight: object, num_heads: int) -> int:
    """Validate a q/k projection weight or bias and return its head_dim."""
    if not isinstance(weight, torch.Tensor) or weight.dim() not in (1, 2):
        got = tuple(weight.shape) if isinstance(weight, torch.Tensor) else type(weight).__name__
        raise ValueError(
            f"weight: expected shape (num_heads * head_dim, in_features) or a bias "
            f"(num_heads * head_dim,), got {got}"
        )
    check_int("num_heads", num_heads, minimum=1)
    out_features = weight.shape[0]
    if out_features % num_heads or (out_features // num_heads) % 2:
        raise ValueError(
            f"num_heads: expected a divisor of weight.shape[0]={out_features} leaving an even "
            f"head_dim, got num_heads={num_heads}"
        )
    return out_features // num_heads
