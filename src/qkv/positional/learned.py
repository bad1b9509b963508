"""Learned absolute position embeddings (BERT, Devlin et al. 2019; GPT-2, Radford et al. 2019).

Position p gets row p of a trained table that is added to the token embeddings. The table has
a fixed number of rows, which is a hard limit on the sequence length (a trained table cannot
extrapolate to rows it never had), so a position outside it is an error here rather than an
index that wraps around or reads garbage.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from qkv.positional._checks import check_positions
from qkv.validation import check_int

__all__ = ["LearnedPositionalEmbedding"]


class LearnedPositionalEmbedding(nn.Module):
    """A trainable (max_positions, dim) table `weight`, looked up by integer positions.

    `weight` is initialised from N(0, 0.02^2), as GPT-2 and BERT do (their `initializer_range`).
    The parameter name matches `nn.Embedding.weight`, so its state dict entry is `weight`.

    forward(positions): integer tensor of any shape, values in [0, max_positions)
    -> (*positions.shape, dim). A position outside that range raises ValueError.
    """

    def __init__(self, max_positions: int, dim: int) -> None:
        super().__init__()
        self.max_positions = check_int("max_positions", max_positions, minimum=1)
        self.dim = check_int("dim", dim, minimum=1)
        self.weight = nn.Parameter(torch.empty(max_positions, dim))  # (max_positions, dim)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """N(0, 0.02^2), the `initializer_range` of GPT-2 and BERT."""
        nn.init.normal_(self.weight, mean=0.0, std=0.02)

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        check_positions(positions, integer=True)
        # The range check reads two values back to the host; a compiled decoding step skips it
        # (qkv.generate checks prompt + new tokens against the context before decoding).
        if positions.numel() and not torch.compiler.is_compiling():
            smallest, largest = int(positions.min()), int(positions.max())
            if smallest < 0:
                raise ValueError(f"positions: expected positions >= 0, got a minimum of {smallest}")
            if largest >= self.max_positions:
                raise ValueError(
                    f"positions: got a maximum of {largest}, but the table has max_positions="
                    f"{self.max_positions} rows (valid positions 0..{self.max_positions - 1}); "
                    f"learned embeddings cannot extrapolate past the trained length"
                )
        return F.embedding(positions, self.weight)  # (*positions.shape, dim)

    def extra_repr(self) -> str:
        return f"max_positions={self.max_positions}, dim={self.dim}"
