"""Two-dimensional sinusoidal positions for a grid of image patches.

A patch at row r and column c of a height x width grid gets

    PE[r, c] = concat(PE_1d[r], PE_1d[c])        each PE_1d of dim / 2 channels

where PE_1d is the sinusoid of Vaswani et al. 2017, section 3.5 (sin at even, cos at odd
channels, wavelengths from 2 pi to base * 2 pi): the first half of the channels encodes the row,
the second half the column. Patches of one row share the first half, patches of one column the
second, so offsets along each axis are the fixed rotations of the 1-D encoding. Dosovitskiy et
al. 2021 (Appendix D.4) compare such "2-D-aware" embeddings, built from one half per axis, with
learned 1-D ones; the fixed sinusoidal form is the one MAE uses (He et al. 2022).

Positions are numbered row-major, patch (r, c) at index r * width + c: the order in which
`qkv.layers.PatchEmbedding` (like `torch.nn.functional.unfold`) lays patches out.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from qkv.positional._checks import check_base, check_floating_dtype, check_positions
from qkv.positional.sinusoidal import sinusoidal_table
from qkv.validation import check_positive_int

__all__ = ["Sinusoidal2DPositionalEncoding", "sinusoidal_2d_table"]


def sinusoidal_2d_table(
    height: int,
    width: int,
    dim: int,
    *,
    base: float = 10000.0,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """The encodings of a height x width grid, row-major: (height * width, dim).

    Channels 0 .. dim/2 - 1 hold the 1-D sinusoid of the row, channels dim/2 .. dim - 1 that of
    the column (Vaswani et al. 2017 s3.5 on each axis). dim must be a multiple of 4 (each half
    holds sin/cos pairs).
    """
    check_positive_int("height", height)
    check_positive_int("width", width)
    check_positive_int("dim", dim)
    if dim % 4:
        raise ValueError(
            f"dim: expected a multiple of 4 (half the channels per axis, in sin/cos pairs), "
            f"got {dim}"
        )
    base = check_base(base)
    check_floating_dtype("dtype", dtype)
    half = dim // 2
    rows = sinusoidal_table(height, half, base=base, dtype=dtype, device=device)  # (h, dim/2)
    columns = sinusoidal_table(width, half, base=base, dtype=dtype, device=device)  # (w, dim/2)
    grid = torch.cat(
        (
            rows[:, None, :].expand(height, width, half),  # (h, w, dim/2): the row's
            columns[None, :, :].expand(height, width, half),  # (h, w, dim/2): the column's
        ),
        dim=-1,
    )  # (h, w, dim)
    return grid.reshape(height * width, dim)  # (h * w, dim), row-major


class Sinusoidal2DPositionalEncoding(nn.Module):
    """Looks up the 2-D sinusoidal encoding of patch indices of a height x width grid.

    The table (`sinusoidal_2d_table`) is a non-persistent buffer: a function of the sizes, not
    learned, not saved in state dicts. forward(positions): integer tensor of any shape with
    values in [0, height * width), row-major patch indices -> (*positions.shape, dim); add it to
    the patch embeddings.
    """

    def __init__(self, height: int, width: int, dim: int, *, base: float = 10000.0) -> None:
        super().__init__()
        table = sinusoidal_2d_table(height, width, dim, base=base)  # (h * w, dim)
        self.height, self.width, self.dim, self.base = height, width, dim, float(base)
        self.register_buffer("table", table, persistent=False)

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        check_positions(positions, integer=True)
        if positions.numel():
            smallest, largest = int(positions.min()), int(positions.max())
            if smallest < 0 or largest >= len(self.table):
                raise ValueError(
                    f"positions: expected patch indices in [0, {len(self.table)}) "
                    f"(a {self.height} x {self.width} grid), got values from {smallest} to "
                    f"{largest}"
                )
        return F.embedding(positions, self.table)  # (*positions.shape, dim)

    def extra_repr(self) -> str:
        return f"height={self.height}, width={self.width}, dim={self.dim}, base={self.base}"
