"""Sparse attention patterns: which keys each query may see, at the token and at the block level.

Attention over L tokens costs O(L^2); the sparse Transformers keep a pattern of O(L) visible
(query, key) pairs instead:

- `Window(left, right)`: the local band (Beltagy et al. 2020, Longformer s3.1);
- `Dilated(left, right, dilation)`: a band with gaps, every `dilation`-th key (Longformer s3.1);
- `Strided(stride)`: keys a multiple of `stride` away (with causal, every stride-th key back),
  and `SameBlock(size)` / `Summary(stride, width)`: the "fixed" pattern's block and summary
  columns (Child et al. 2019, Sparse Transformer s4.2);
- `GlobalTokens(positions)`: tokens that attend everywhere and are attended by all (Longformer's
  global attention; BigBird's ITC, Zaheer et al. 2020 s2);
- `RandomBlocks(per_row, block, seed)`: each query block sees `per_row` random key blocks,
  seeded (BigBird's random attention, Zaheer et al. 2020 s2);
- `a | b`: the union (`bigbird(...)` = window | global | random).

A pattern answers two questions, both on positions with queries aligned bottom-right (query i
sits at position i + L_k - L_q, as causal and windows align):

- `visible(query_pos, key_pos, key_len)`: a bool tensor, token by token (the dense mask the
  reference backend and SDPA read, and the mask of a partly visible tile); `rule(key_len,
  device)` is the same test with its lookup tables built once, for FlexAttention's mask_mod;
- `tiles(q_lo, q_hi, k_lo, k_hi, key_len)`: for blocks of positions given by their inclusive
  bounds (broadcastable integer tensors), whether *any* pair is visible (exact: a tile without
  one is skipped, so that time scales with the computed blocks) and whether *all* are (a tile
  that needs no mask; this answer may err only towards False).

`qkv.attention(..., pattern=p)` intersects the pattern with everything else the call asks for
(causal, window, masks, padding); `layout` gives the block occupancy that the tiled backend walks.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from qkv.validation import check_int

__all__ = [
    "Dilated",
    "GlobalTokens",
    "RandomBlocks",
    "SameBlock",
    "SparsePattern",
    "Strided",
    "Summary",
    "Union",
    "Window",
    "bigbird",
    "dense_mask",
    "layout",
]


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

    def tiles(self, q_lo, q_hi, k_lo, k_hi, key_len):
        answers = [p.tiles(q_lo, q_hi, k_lo, k_hi, key_len) for p in self.parts]
        any_visible = functools.reduce(torch.logical_or, (a for a, _ in answers))
        all_visible = functools.reduce(torch.logical_or, (b for _, b in answers))
        return any_visible, all_visible  # all: one part covering the tile suffices


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


def _multiple_between(lowest: torch.Tensor, highest: torch.Tensor, step: int) -> torch.Tensor:
    """Elementwise: is there a multiple of `step` in [lowest, highest]?"""
    return torch.div(highest, step, rounding_mode="floor") * step >= lowest


def bigbird(*, window: int, global_tokens: int, random_blocks: int, block: int = 64, seed=0):
    """BigBird's pattern (Zaheer et al. 2020, s2): a window of `window` keys on each side, the
    first `global_tokens` positions global, and `random_blocks` random key blocks per query
    block of `block` positions."""
    return (
        Window(window, window)
        | GlobalTokens.first(global_tokens)
        | RandomBlocks(random_blocks, block=block, seed=seed)
    )


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
