"""2-D sinusoidal positions against the formula of Vaswani et al. 2017 s3.5 applied to the row
(first half of the channels) and to the column (second half), entry by entry with `math`."""

import math

import pytest
import torch

from qkv.positional import Sinusoidal2DPositionalEncoding, sinusoidal_2d_table


def formula_2d(height, width, dim, base):
    """PE[r * width + c] = [sin/cos of r over dim/2 channels, sin/cos of c over dim/2]."""
    half = dim // 2
    table = torch.zeros(height * width, dim, dtype=torch.float64)
    for r in range(height):
        for c in range(width):
            for offset, position in ((0, r), (half, c)):
                for i in range(half // 2):
                    angle = position / base ** (2 * i / half)
                    table[r * width + c, offset + 2 * i] = math.sin(angle)
                    table[r * width + c, offset + 2 * i + 1] = math.cos(angle)
    return table


@pytest.mark.parametrize("height, width, dim, base", [(4, 4, 16, 10000.0), (3, 5, 8, 100.0)])
def test_table_matches_the_formula_on_each_axis(height, width, dim, base):
    table = sinusoidal_2d_table(height, width, dim, base=base, dtype=torch.float64)
    assert table.shape == (height * width, dim)
    torch.testing.assert_close(table, formula_2d(height, width, dim, base), rtol=0, atol=1e-12)


def test_patches_of_a_row_share_the_first_half_and_of_a_column_the_second():
    grid = sinusoidal_2d_table(3, 4, 8).view(3, 4, 8)
    assert torch.equal(grid[:, 0, :4], grid[:, 3, :4]) and torch.equal(
        grid[0, :, 4:], grid[2, :, 4:]
    )
    assert not torch.equal(grid[0, 0, :4], grid[1, 0, :4])


def test_module_looks_up_row_major_indices_and_saves_no_state():
    module = Sinusoidal2DPositionalEncoding(3, 5, 8)
    positions = torch.tensor([[0, 7], [14, 5]])
    expected = formula_2d(3, 5, 8, 10000.0).float()[positions]
    torch.testing.assert_close(module(positions), expected, rtol=0, atol=1e-6)
    assert module.state_dict() == {}
    with pytest.raises(ValueError, match=r"positions: expected patch indices in \[0, 15\)"):
        module(torch.tensor([15]))
    with pytest.raises(TypeError, match="positions"):
        module(torch.tensor([0.0]))


def test_bad_sizes_name_the_argument():
    with pytest.raises(ValueError, match="dim: expected a multiple of 4"):
        sinusoidal_2d_table(2, 2, 6)
    with pytest.raises(ValueError, match="height"):
        sinusoidal_2d_table(0, 2, 8)
    with pytest.raises(TypeError, match="width"):
        sinusoidal_2d_table(2, 2.0, 8)
    with pytest.raises(ValueError, match="base"):
        sinusoidal_2d_table(2, 2, 8, base=1.0)
