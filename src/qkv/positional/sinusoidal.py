"""Sinusoidal absolute positional encodings (Vaswani et al. 2017, section 3.5).

    PE[pos, 2i]     = sin(pos / base^(2i / dim))
    PE[pos, 2i + 1] = cos(pos / base^(2i / dim))

Each pair (2i, 2i + 1) is a point on a circle turning at its own frequency, so PE[pos + k] is
PE[pos] rotated pair by pair by angles that depend only on k: a fixed linear map, which is why
the paper expects the model to "easily learn to attend by relative positions". The encoding is
defined for every position, so nothing here has a hard length limit.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from qkv.positional._checks import (
    check_base,
    check_even_dim,
    check_floating_dtype,
    check_positions,
)
from qkv.validation import check_int

__all__ = ["SinusoidalPositionalEncoding", "sinusoidal_table"]


def sinusoidal_table(
    num_positions: int,
    dim: int,
    *,
    base: float = 10000.0,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """The encodings of positions 0 .. num_positions - 1 (Vaswani et al. 2017, section 3.5).

    Returns a (num_positions, dim) tensor with sin at even and cos at odd columns; row 0 is
    [0, 1, 0, 1, ...]. Angles are computed in float64 and then cast to `dtype`, so that large
    positions keep their digits. `dim` must be even.
    """
    check_int("num_positions", num_positions, minimum=0)
    check_even_dim("dim", dim)
    base = check_base(base)
    check_floating_dtype("dtype", dtype)
    positions = torch.arange(num_positions, device=device)  # (num_positions,)
    return _sinusoids(positions, dim, base=base, dtype=dtype)


class SinusoidalPositionalEncoding(nn.Module):
    """Looks up the sinusoidal encoding of integer positions (Vaswani et al. 2017, section 3.5).

    The first `max_positions` rows are precomputed in a non-persistent buffer `table` (it is not
    saved in state dicts: it is a function of `dim` and `base`, not learned). Positions at or beyond
    `max_positions` are computed on the fly rather than refused, because sinusoids are defined for
    any position (the encoding extrapolates, even if a model trained on shorter inputs may not).
    Negative positions raise ValueError.

    forward(positions): integer tensor of any shape -> (*positions.shape, dim), in the dtype of
    the table (float32 unless the module was cast). Add it to the token embeddings.
    """

    def __init__(self, dim: int, max_positions: int = 4096, *, base: float = 10000.0) -> None:
        super().__init__()
        self.dim = check_even_dim("dim", dim)
        self.max_positions = check_int("max_positions", max_positions, minimum=0)
        self.base = check_base(base)
        table = sinusoidal_table(max_positions, dim, base=self.base)  # (max_positions, dim)
        self.register_buffer("table", table, persistent=False)

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        check_positions(positions, integer=True)
        if positions.numel() == 0:
            return self.table.new_empty((*positions.shape, self.dim))
        smallest, largest = int(positions.min()), int(positions.max())
        if smallest < 0:
            raise ValueError(f"positions: expected positions >= 0, got a minimum of {smallest}")
        if largest < self.max_positions:
            return F.embedding(positions, self.table)  # (*positions.shape, dim)
        return _sinusoids(positions, self.dim, base=self.base, dtype=self.table.dtype)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, max_positions={self.max_positions}, base={self.base}"


def _sinusoids(
    positions: torch.Tensor, dim: int, *, base: float, dtype: torch.dtype
) -> torch.Tensor:
    """PE[positions] computed from the formula: (*positions.shape, dim)."""
    pair_index = torch.arange(0, dim, 2, dtype=torch.float64, device=positions.device)  # (dim/2,)
    frequencies = base ** (-pair_index / dim)  # (dim/2,): 1 / base^(2i / dim)
    angles = positions.to(torch.float64).unsqueeze(-1) * frequencies  # (*P, dim/2)
    pairs = torch.stack((angles.sin(), angles.cos()), dim=-1)  # (*P, dim/2, 2)
    return pairs.flatten(-2).to(dtype)  # (*P, dim): sin at column 2i, cos at 2i + 1
