"""Argument checks shared by the positional modules: each error names the argument, the value
seen and the value expected."""

from __future__ import annotations

import torch

from qkv.validation import check_int


def check_even_dim(name: str, value: object) -> int:
    """A positive even dimension: sin/cos (and rotation) pairs need two coordinates each."""
    check_int(name, value, minimum=1)
    if value % 2:
        raise ValueError(
            f"{name}: expected an even dimension (coordinates come in sin/cos pairs), got {value}"
        )
    return value


def check_base(value: object) -> float:
    """The wavelength base (10000 in the papers): a real number > 1 so frequencies decrease."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"base: expected a float, got {type(value).__name__} {value!r}")
    if not value > 1.0:
        raise ValueError(f"base: expected a number > 1 (e.g. 10000.0), got {value}")
    return float(value)


def check_positions(positions: object, *, integer: bool) -> torch.Tensor:
    """A tensor of positions; `integer=True` refuses floating-point positions (table lookups)."""
    if not isinstance(positions, torch.Tensor):
        raise TypeError(f"positions: expected a torch.Tensor, got {type(positions).__name__}")
    wrong = positions.dtype == torch.bool or positions.is_complex()
    if wrong or (integer and positions.is_floating_point()):
        expected = "an integer tensor" if integer else "an integer or real floating-point tensor"
        raise TypeError(f"positions: expected {expected}, got dtype {positions.dtype}")
    return positions


def check_floating_dtype(name: str, dtype: object) -> torch.dtype:
    """A floating-point torch.dtype (the output of sin/cos cannot be an integer)."""
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"{name}: expected a floating-point torch.dtype, got {dtype!r}")
    return dtype


def angle_dtype(dtype: torch.dtype) -> torch.dtype:
    """Angles are computed in float32, or float64 when float64 output is asked for: position
    times frequency loses too many digits in half precision."""
    return torch.float64 if dtype == torch.float64 else torch.float32
