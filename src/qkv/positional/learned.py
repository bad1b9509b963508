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
    -> (*positions.shape, dim). A position outside that range raises ValueError where the
    lookup refuses it (on the CPU; a CUDA kernel stops at a device-side assertion instead).
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
        try:
            return F.embedding(positions, self.weight)  # (*positions.shape, dim)
        except IndexError:
            # The range is read back to the host only here, on the way to an error: a call
            # that succeeds (a compiled decoding step, too) never synchronises for it.
            raise self._out_of_range(positions) from None

    def _out_of_range(self, positions: torch.Tensor) -> ValueError:
        """The error for positions outside [0, max_positions), naming the value seen."""
        smallest, largest = int(positions.min()), int(positions.max())
        if smallest < 0:
            return ValueError(f"positions: expected positions >= 0, got a minimum of {smallest}")
        return ValueError(
            f"positions: got a maximum of {largest}, but the table has max_positions="
            f"{self.max_positions} rows (valid positions 0..{self.max_positions - 1}); "
            f"learned embeddings cannot extrapolate past the trained length"
        )

    def extra_repr(self) -> str:
        return f"max_positions={self.max_positions}, dim={self.dim}"
