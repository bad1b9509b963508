"""Sinusoidal encodings against the formula of Vaswani et al. 2017 section 3.5, computed
directly with `math`, and against its relative-position property (a fixed rotation per offset)."""

import math

import numpy as np
import pytest
import torch

from qkv.positional import SinusoidalPositionalEncoding, sinusoidal_table


def formula_table(num_positions, dim, base):
    """PE[pos, 2i] = sin(pos / base^(2i/dim)), PE[pos, 2i+1] = cos(...), one entry at a time."""
    table = np.zeros((num_positions, dim))
    for pos in range(num_positions):
        for i in range(dim // 2):
            angle = pos / base ** (2 * i / dim)
            table[pos, 2 * i] = math.sin(angle)
            table[pos, 2 * i + 1] = math.cos(angle)
    return torch.from_numpy(table)


def shift_matrix(offset, dim, base):
    """Block-diagonal M_k with PE[pos + k] = M_k @ PE[pos], from sin(a + b) and cos(a + b)."""
    matrix = torch.zeros(dim, dim, dtype=torch.float64)
    for i in range(dim // 2):
        angle = offset / base ** (2 * i / dim)
        c, s = math.cos(angle), math.sin(angle)
        # [sin(a + b), cos(a + b)] = [[cos b, sin b], [-sin b, cos b]] @ [sin a, cos a]
        block = torch.tensor([[c, s], [-s, c]], dtype=torch.float64)
        matrix[2 * i : 2 * i + 2, 2 * i : 2 * i + 2] = block
    return matrix


def test_position_zero_is_zero_one_pattern():
    table = sinusoidal_table(3, 10)
    assert torch.equal(table[0], torch.tensor([0.0, 1.0] * 5))


@pytest.mark.parametrize(("dim", "base"), [(16, 10000.0), (6, 100.0), (2, 10000.0)])
def test_table_matches_formula(dim, base):
    expected = formula_table(60, dim, base)
    table = sinusoidal_table(60, dim, base=base)
    assert table.shape == (60, dim) and table.dtype == torch.float32
    torch.testing.assert_close(table, expected.float())
    table64 = sinusoidal_table(60, dim, base=base, dtype=torch.float64)
    torch.testing.assert_close(table64, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("offset", [1, 5, 37, 200])
def test_shift_by_k_is_a_fixed_rotation(offset):
    dim, base = 12, 10000.0
    table = sinusoidal_table(300, dim, base=base, dtype=torch.float64)
    matrix = shift_matrix(offset, dim, base)
    moved = table[:-offset] @ matrix.T  # row pos -> M_k @ PE[pos]
    torch.testing.assert_close(moved, table[offset:], rtol=1e-10, atol=1e-10)


def test_module_looks_up_and_extends_past_max_positions():
    dim = 8
    module = SinusoidalPositionalEncoding(dim, max_positions=16)
    expected = formula_table(40, dim, 10000.0).float()
    positions = torch.tensor([[0, 3, 15], [2, 2, 7]])
    torch.testing.assert_close(module(positions), expected[positions])
    beyond = torch.tensor([[1, 16, 39]])  # longer than the table: computed, not refused
    out = module(beyond)
    assert out.shape == (1, 3, dim)
    torch.testing.assert_close(out, expected[beyond])
    assert module(torch.zeros(0, dtype=torch.long)).shape == (0, dim)
    assert "table" not in module.state_dict()
    assert dict(module.named_buffers())["table"].shape == (16, dim)


def test_bad_arguments():
    with pytest.raises(ValueError, match=r"dim: expected an even dimension.*got 7"):
        sinusoidal_table(4, 7)
    with pytest.raises(ValueError, match=r"num_positions: expected an int >= 0, got -2"):
        sinusoidal_table(-2, 8)
    with pytest.raises(ValueError, match=r"base: expected a number > 1.*got 0.5"):
        sinusoidal_table(4, 8, base=0.5)
    with pytest.raises(TypeError, match=r"dtype: expected a floating-point torch.dtype"):
        sinusoidal_table(4, 8, dtype=torch.long)
    with pytest.raises(ValueError, match=r"dim: expected an even dimension.*got 9"):
        SinusoidalPositionalEncoding(9)
    with pytest.raises(TypeError, match=r"max_positions: expected an int >= 0, got float"):
        SinusoidalPositionalEncoding(8, max_positions=10.0)
    module = SinusoidalPositionalEncoding(8, max_positions=4)
    with pytest.raises(ValueError, match=r"positions: expected positions >= 0.*minimum of -1"):
        module(torch.tensor([0, -1]))
    with pytest.raises(TypeError, match=r"positions: expected an integer tensor.*float32"):
        module(torch.tensor([0.0, 1.0]))
