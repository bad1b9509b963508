"""Patterns defined by particular tokens and blocks: global tokens, BigBird's random blocks, and
BigBird's pattern as their union with a window (Zaheer et al. 2020, s2)."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from qkv.attention.sparse.base import SparsePattern
from qkv.attention.sparse.local import Window
from qkv.validation import check_int

__all__ = ["GlobalTokens", "RandomBlocks", "bigbird"]


@dataclass(frozen=True)
class GlobalTokens(SparsePattern):
    """Tokens at `positions` attend to every key and every query attends to them (Longformer's
    global attention, BigBird's internal global tokens such as [CLS])."""

    positions: tuple[int, ...]

    def __post_init__(self) -> None:
        if not isinstance(self.positions, tuple) or not self.positions:
            raise TypeError(
                f"positions: expected a non-empty tuple of ints, got {self.positions!r}"
            )
        for p in self.positions:
            check_int("positions", p, minimum=0)
        object.__setattr__(self, "positions", tuple(sorted(set(self.positions))))

    @classmethod
    def first(cls, count: int) -> GlobalTokens:
        """The first `count` positions ([CLS] and the like) as global tokens."""
        return cls(tuple(range(check_int("count", count, minimum=1))))

    def visible(self, query_pos, key_pos, key_len):
        return self.rule(key_len, key_pos.device)(query_pos, key_pos)

    def rule(self, key_len, device=None):
        table = self._table(key_len, device)
        return lambda query_pos, key_pos: table[query_pos] | table[key_pos]

    def tiles(self, q_lo, q_hi, k_lo, k_hi, key_len):
        q_count = self._count(q_lo, q_hi)
        k_count = self._count(k_lo, k_hi)
        any_visible = (q_count > 0) | (k_count > 0)
        all_visible = (q_count == q_hi - q_lo + 1) | (k_count == k_hi - k_lo + 1)
        return any_visible, all_visible

    def _table(self, key_len: int, device) -> torch.Tensor:
        """Bool (key_len,): which positions are global."""
        table = torch.zeros(key_len, dtype=torch.bool, device=device)
        inside = [p for p in self.positions if p < key_len]
        table[inside] = True
        return table

    def _count(self, lo, hi) -> torch.Tensor:
        """How many global positions lie in [lo, hi] (elementwise)."""
        lo, hi = torch.as_tensor(lo), torch.as_tensor(hi)
        sorted_positions = torch.tensor(self.positions, device=lo.device)
        below_hi = torch.searchsorted(sorted_positions, hi, right=True)
        below_lo = torch.searchsorted(sorted_positions, lo, right=False)
        return below_hi - below_lo


@dataclass(frozen=True)
class RandomBlocks(SparsePattern):
    """Each block of `block` query positions sees `per_row` key blocks drawn at random without
    replacement (BigBird's random attention, Zaheer et al. 2020 s2), the same for a given seed
    and number of key blocks ceil(L_k / block): the draw depends on the key length."""

    per_row: int
    block: int = 64
    seed: int = 0

    def __post_init__(self) -> None:
        check_int("per_row", self.per_row, minimum=1)
        check_int("block", self.block, minimum=1)
        check_int("seed", self.seed, minimum=0)

    def table(self, key_len: int, device=None) -> torch.Tensor:
        """Bool (n, n) with n = ceil(key_len / block): may query block r see key block c?"""
        return _random_table(self.per_row, self.seed, -(-key_len // self.block)).to(device)

    def visible(self, query_pos, key_pos, key_len):
        return self.rule(key_len, key_pos.device)(query_pos, key_pos)

    def rule(self, key_len, device=None):
        table, block = self.table(key_len, device), self.block
        return lambda query_pos, key_pos: table[query_pos // block, key_pos // block]

    def tiles(self, q_lo, q_hi, k_lo, k_hi, key_len):
        counts = _prefix_sums(self.table(key_len))  # (n + 1, n + 1)
        r0, r1 = (torch.as_tensor(x) // self.block for x in (q_lo, q_hi))
        c0, c1 = (torch.as_tensor(x) // self.block for x in (k_lo, k_hi))
        seen = counts[r1 + 1, c1 + 1] - counts[r0, c1 + 1] - counts[r1 + 1, c0] + counts[r0, c0]
        return seen > 0, seen == (r1 - r0 + 1) * (c1 - c0 + 1)


@functools.lru_cache(maxsize=16)
def _random_table(per_row: int, seed: int, num_blocks: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    chosen = torch.rand(num_blocks, num_blocks, generator=generator).argsort(dim=1)
    chosen = chosen[:, : min(per_row, num_blocks)]  # (n, per_row): distinct blocks per row
    table = torch.zeros(num_blocks, num_blocks, dtype=torch.bool)
    return table.scatter_(1, chosen, True)


def _prefix_sums(table: torch.Tensor) -> torch.Tensor:
    """(n + 1, m + 1) inclusive 2-D prefix counts with a zero first row and column."""
    counts = torch.zeros(table.shape[0] + 1, table.shape[1] + 1, dtype=torch.long)
    counts[1:, 1:] = table.long().cumsum(0).cumsum(1)
    return counts


def bigbird(*, window: int, global_tokens: int, random_blocks: int, block: int = 64, seed=0):
    """BigBird's pattern (Zaheer et al. 2020, s2): a window of `window` keys on each side, the
    first `global_tokens` positions global, and `random_blocks` random key blocks per query
    block of `block` positions."""
    return (
        Window(window, window)
        | GlobalTokens.first(global_tokens)
        | RandomBlocks(random_blocks, block=block, seed=seed)
    )
