"""Patterns defined by the distance between query and key: windows, dilated and strided heads,
and the Sparse Transformer's "fixed" blocks and summary columns (Beltagy et al. 2020; Child et
al. 2019)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qkv.attention.sparse.base import SparsePattern
from qkv.validation import check_int

__all__ = ["Dilated", "SameBlock", "Strided", "Summary", "Window"]


@dataclass(frozen=True)
class Window(SparsePattern):
    """Key j visible from query position i when i - left <= j <= i + right."""

    left: int
    right: int = 0

    def __post_init__(self) -> None:
        check_int("left", self.left, minimum=0)
        check_int("right", self.right, minimum=0)

    def visible(self, query_pos, key_pos, key_len):
        return (key_pos >= query_pos - self.left) & (key_pos <= query_pos + self.right)

    def tiles(self, q_lo, q_hi, k_lo, k_hi, key_len):
        any_visible = (k_hi >= q_lo - self.left) & (k_lo <= q_hi + self.right)
        all_visible = (k_lo >= q_hi - self.left) & (k_hi <= q_lo + self.right)
        return any_visible, all_visible


@dataclass(frozen=True)
class Dilated(SparsePattern):
    """Every `dilation`-th key within `left` visible keys before and `right` after the query
    (itself included): i - j in {-right * d, ..., -d, 0, d, ..., left * d}."""

    left: int
    right: int = 0
    dilation: int = 2

    def __post_init__(self) -> None:
        check_int("left", self.left, minimum=0)
        check_int("right", self.right, minimum=0)
        check_int("dilation", self.dilation, minimum=1)

    def visible(self, query_pos, key_pos, key_len):
        offset = query_pos - key_pos  # i - j
        d = self.dilation
        return (offset % d == 0) & (offset <= self.left * d) & (offset >= -self.right * d)

    def tiles(self, q_lo, q_hi, k_lo, k_hi, key_len):
        d = self.dilation
        lowest = torch.clamp(torch.as_tensor(q_lo - k_hi), min=-self.right * d)
        highest = torch.clamp(torch.as_tensor(q_hi - k_lo), max=self.left * d)
        any_visible = _multiple_between(lowest, highest, d)
        if d == 1:
            return any_visible, Window(self.left, self.right).tiles(q_lo, q_hi, k_lo, k_hi, 0)[1]
        return any_visible, torch.zeros_like(any_visible)  # gaps: never every pair


@dataclass(frozen=True)
class Strided(SparsePattern):
    """Keys at a multiple of `stride` from the query, i - j = 0 (mod stride): the Sparse
    Transformer's strided head (with causal, every stride-th key back; Child et al. 2019)."""

    stride: int

    def __post_init__(self) -> None:
        check_int("stride", self.stride, minimum=1)

    def visible(self, query_pos, key_pos, key_len):
        return (query_pos - key_pos) % self.stride == 0

    def tiles(self, q_lo, q_hi, k_lo, k_hi, key_len):
        lowest, highest = torch.as_tensor(q_lo - k_hi), torch.as_tensor(q_hi - k_lo)
        any_visible = _multiple_between(lowest, highest, self.stride)
        return any_visible, any_visible & (self.stride == 1)


@dataclass(frozen=True)
class SameBlock(SparsePattern):
    """Keys in the query's own block of `size` positions, floor(j / size) = floor(i / size):
    the "fixed" pattern's local head (Child et al. 2019, s4.2)."""

    size: int

    def __post_init__(self) -> None:
        check_int("size", self.size, minimum=1)

    def visible(self, query_pos, key_pos, key_len):
        return torch.div(query_pos, self.size, rounding_mode="floor") == torch.div(
            key_pos, self.size, rounding_mode="floor"
        )

    def tiles(self, q_lo, q_hi, k_lo, k_hi, key_len):
        n = self.size
        any_visible = (q_lo // n <= k_hi // n) & (k_lo // n <= q_hi // n)
        all_visible = (q_lo // n == q_hi // n) & (k_lo // n == k_hi // n) & (q_lo // n == k_lo // n)
        return torch.as_tensor(any_visible), torch.as_tensor(all_visible)


@dataclass(frozen=True)
class Summary(SparsePattern):
    """The last `width` keys of every block of `stride` are seen by every query: the "fixed"
    pattern's summary columns, j mod stride >= stride - width (Child et al. 2019, s4.2)."""

    stride: int
    width: int = 1

    def __post_init__(self) -> None:
        check_int("stride", self.stride, minimum=1)
        check_int("width", self.width, minimum=1)
        if self.width > self.stride:
            raise ValueError(f"width: expected at most stride={self.stride}, got {self.width}")

    def visible(self, query_pos, key_pos, key_len):
        return key_pos % self.stride >= self.stride - self.width

    def tiles(self, q_lo, q_hi, k_lo, k_hi, key_len):
        n, first = self.stride, self.stride - self.width  # summary offsets: first .. n - 1
        k_lo, k_hi = torch.as_tensor(k_lo), torch.as_tensor(k_hi)
        # the first summary key at or after k_lo
        start = torch.where(k_lo % n >= first, k_lo, k_lo // n * n + first)
        any_visible = start <= k_hi
        all_visible = (k_lo % n >= first) & (k_lo // n == k_hi // n)
        return any_visible, all_visible


def _multiple_between(lowest: torch.Tensor, highest: torch.Tensor, step: int) -> torch.Tensor:
    """Elementwise: is there a multiple of `step` in [lowest, highest]?"""
    return torch.div(highest, step, rounding_mode="floor") * step >= lowest
