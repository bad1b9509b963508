"""The protocol every sparse pattern follows (see the package doc), their union, and what is
built from any pattern: its dense mask and its block occupancy."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

__all__ = ["SparsePattern", "Union", "dense_mask", "layout"]


class SparsePattern:
    """Base of the patterns: `|` builds their union (see the module doc for the protocol)."""

    def visible(self, query_pos: torch.Tensor, key_pos: torch.Tensor, key_len: int):
        raise NotImplementedError

    def rule(self, key_len: int, device=None):
        """`visible` for one key length as a function of (query_pos, key_pos) alone, its
        tables (if any) built now: what FlexAttention's mask_mod may call per element."""
        return lambda query_pos, key_pos: self.visible(query_pos, key_pos, key_len)

    def tiles(self, q_lo, q_hi, k_lo, k_hi, key_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def check(self, query_len: int, key_len: int) -> None:
        """Raise a ValueError naming `pattern` if it cannot describe a call of these lengths."""

    def __or__(self, other: SparsePattern) -> Union:
        if not isinstance(other, SparsePattern):
            return NotImplemented
        return Union((*_parts(self), *_parts(other)))


def _parts(pattern: SparsePattern) -> tuple[SparsePattern, ...]:
    return pattern.parts if isinstance(pattern, Union) else (pattern,)


@dataclass(frozen=True)
class Union(SparsePattern):
    """A pair is visible if any part shows it."""

    parts: tuple[SparsePattern, ...]

    def __post_init__(self) -> None:
        if not self.parts or not all(isinstance(p, SparsePattern) for p in self.parts):
            raise TypeError(f"parts: expected one or more SparsePattern, got {self.parts!r}")

    def visible(self, query_pos, key_pos, key_len):
        return self.rule(key_len, key_pos.device)(query_pos, key_pos)

    def rule(self, key_len, device=None):
        rules = [p.rule(key_len, device) for p in self.parts]

        def visible(query_pos, key_pos):
            return functools.reduce(torch.logical_or, (r(query_pos, key_pos) for r in rules))

        return visible

    def check(self, query_len, key_len):
        for part in self.parts:
            part.check(query_len, key_len)

    def tiles(self, q_lo, q_hi, k_lo, k_hi, key_len):
        answers = [p.tiles(q_lo, q_hi, k_lo, k_hi, key_len) for p in self.parts]
        any_visible = functools.reduce(torch.logical_or, (a for a, _ in answers))
        all_visible = functools.reduce(torch.logical_or, (b for _, b in answers))
        return any_visible, all_visible  # all: one part covering the tile suffices


def dense_mask(pattern: SparsePattern, L_q: int, L_k: int, *, device=None) -> torch.Tensor:
    """Bool (L_q, L_k), True where query i may see key j (positions aligned bottom-right)."""
    query_pos = torch.arange(L_q, device=device).view(-1, 1) + (L_k - L_q)  # (L_q, 1)
    key_pos = torch.arange(L_k, device=device).view(1, -1)  # (1, L_k)
    return pattern.visible(query_pos, key_pos, L_k).expand(L_q, L_k)


def layout(pattern: SparsePattern, L_q: int, L_k: int, block_q: int, block_k: int):
    """Block occupancy of a pattern: (computed, full), two bool (ceil(L_q / block_q),
    ceil(L_k / block_k)) tensors: a tile is computed when any of its pairs is visible, full
    when every pair is (then it needs no mask)."""
    q_lo = torch.arange(0, L_q, block_q).view(-1, 1)  # (n_q, 1), query indices
    q_hi = (q_lo + block_q).clamp(max=L_q) - 1
    k_lo = torch.arange(0, L_k, block_k).view(1, -1)  # (1, n_k)
    k_hi = (k_lo + block_k).clamp(max=L_k) - 1
    shift = L_k - L_q  # bottom-right alignment
    computed, full = pattern.tiles(q_lo + shift, q_hi + shift, k_lo, k_hi, L_k)
    shape = (q_lo.shape[0], k_lo.shape[1])
    return computed.expand(shape), (full & computed).expand(shape)
