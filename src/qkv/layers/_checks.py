"""Argument checks shared by the layers: errors name the argument, the value seen and expected."""

from __future__ import annotations


def check_positive_int(name: str, value: object) -> int:
    """`value` must be an int >= 1 (a bool is refused: True is not a size)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: expected a positive int, got {type(value).__name__} {value!r}")
    if value < 1:
        raise ValueError(f"{name}: expected a positive int, got {value}")
    return value


def check_probability(name: str, value: object) -> float:
    """`value` must be a dropout probability in [0, 1)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name}: expected a float in [0, 1), got {type(value).__name__} {value!r}")
    if not 0.0 <= value < 1.0:
        raise ValueError(f"{name}: expected a probability in [0, 1), got {value}")
    return float(value)


def check_positive_float(name: str, value: object) -> float:
    """`value` must be a number > 0 (an epsilon, a base)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name}: expected a positive float, got {type(value).__name__} {value!r}")
    if not value > 0.0:
        raise ValueError(f"{name}: expected a positive float, got {value}")
    return float(value)
