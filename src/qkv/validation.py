"""Argument checks for the whole package, at the bottom of its layers: each error names the
argument, the value seen and what was expected, and is a TypeError for a value of the wrong
type, a ValueError for a value of the right type out of range.

A bool is never taken for a number: True is an int in Python, but not a size or a count.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TypeVar

import torch

Config = TypeVar("Config")

__all__ = [
    "check_choice",
    "check_int",
    "check_positive_float",
    "check_positive_int",
    "check_probability",
    "describe",
    "preset",
]


def check_int(
    name: str, value: object, *, minimum: int | None = None, maximum: int | None = None
) -> int:
    """`value` must be an int (not a bool), at least `minimum` and at most `maximum` when they
    are given. A symbolic size (torch.SymInt, what a length is while torch.export traces)
    counts as an int."""
    bounds = [f">= {minimum}"] * (minimum is not None) + [f"<= {maximum}"] * (maximum is not None)
    expected = " and ".join(["an int", *bounds]).replace("int and", "int", 1)
    if isinstance(value, bool) or not isinstance(value, int | torch.SymInt):
        raise TypeError(f"{name}: expected {expected}, got {type(value).__name__} {value!r}")
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        raise ValueError(f"{name}: expected {expected}, got {value}")
    return value


# torch's generators take 64-bit seeds: a larger int fails inside torch ("Overflow when
# unpacking long long") rather than naming the argument.
MAX_SEED = 2**63 - 1


def check_seed(name: str, value: object) -> int:
    """`value` must be a seed torch's generators take: an int in [0, MAX_SEED]."""
    return check_int(name, value, minimum=0, maximum=MAX_SEED)


def check_positive_int(name: str, value: object) -> int:
    """`value` must be an int >= 1: a size, a count of layers or heads."""
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
    """`value` must be a finite number > 0 (an epsilon, a base)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name}: expected a positive float, got {type(value).__name__} {value!r}")
    if not value > 0.0:
        raise ValueError(f"{name}: expected a positive float, got {value}")
    if not math.isfinite(value):
        raise ValueError(f"{name}: expected a finite positive float, got {value}")
    return float(value)


def describe(value: object) -> str:
    """A value as an error message shows it: a tensor by its shape, anything else by its type
    and (the start of) its repr."""
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    return f"{type(value).__name__} {value!r:.60}"


def check_choice(name: str, value: object, choices: tuple[str, ...]) -> None:
    """ValueError naming `name` unless value is one of `choices`."""
    if value not in choices:
        raise ValueError(f"{name}: expected one of {choices}, got {value!r}")


def preset(
    presets: Mapping[str, object], name: str, overrides: Mapping[str, object], config_class=None
) -> Config:
    """presets[name] (a dataclass, or the fields of a `config_class`) with the fields in
    `overrides` replaced: what every config's `from_name` returns. An unknown name is a
    ValueError, an unknown field a TypeError."""
    if name not in presets:
        raise ValueError(f"name: unknown preset {name!r}; expected one of {sorted(presets)}")
    chosen = presets[name]
    if isinstance(chosen, Mapping):
        chosen = config_class(**chosen)
    fields = {field.name for field in dataclasses.fields(chosen)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise TypeError(f"overrides: unknown fields {unknown}; expected some of {sorted(fields)}")
    return dataclasses.replace(chosen, **overrides)


def check_readable_file(name: str, path: str | os.PathLike) -> Path:
    """`path` must be a file this process can read; the error says which of "does not exist",
    "is a folder" and "cannot be read (Permission denied, ...)" it is, naming `name` (a file
    in a folder one may not enter is not "missing": `Path.is_file` says False for both)."""
    file = Path(path)
    try:
        with open(file, "rb"):
            pass
    except FileNotFoundError:
        raise FileNotFoundError(f"{name}: {str(path)!r} does not exist") from None
    except IsADirectoryError:
        raise IsADirectoryError(f"{name}: {str(path)!r} is a folder; expected a file") from None
    except OSError as error:
        reason = error.strerror or type(error).__name__
        raise type(error)(f"{name}: {str(path)!r} cannot be read ({reason})") from None
    return file
