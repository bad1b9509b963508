"""Which keys each query may see, decided one (query block x key block) tile at a time.

The tiled algorithm never builds the L_q x L_k mask. For each tile it first asks, with integer
interval arithmetic on the block bounds, whether the tile is entirely hidden (skip it: causal and
windowed attention then cost work proportional to what is visible), entirely visible (no mask at
all), or partly visible (build the small (bq, bk) mask from index arithmetic).

Visibility of key j from query i (positions aligned bottom-right: i' = i + L_k - L_q; with
per-row query lengths, row b aligns its own: i' = i + lengths[b] - query_lengths[b], and its
queries from query_lengths[b] on are padding, seeing nothing):
    structural(i', j) = [not causal or j <= i'] and [i' - left <= j <= i' + right]   (window)
    sink(i', j)       = j < sinks and j <= i' + future      (StreamingLLM: the first keys stay)
    visible           = (structural or sink) and j < lengths[b] and dense_mask[b, h, i, j]
                        and pattern(i', j)                    (qkv.attention.sparse)
where `future` is 0 under causal, `right` under a window, and unbounded otherwise.

`TilePlan.tiles()` classifies every tile at once (integer tensors of block bounds), so that the
loops visit only the computed tiles: time scales with them, not with (L / block)^2 Python steps.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from qkv.attention.sparse import SparsePattern


class Tile(enum.Enum):
    HIDDEN = "hidden"  # no query of the block sees any key of the block: skip the tile
    VISIBLE = "visible"  # every query sees every key: no mask needed
    PARTIAL = "partial"  # build the tile's mask


@dataclass(frozen=True)
class TilePlan:
    """The masking of one call, with block sizes: everything forward and backward agree on."""

    query_len: int
    key_len: int
    block_q: int
    block_k: int
    causal: bool
    window: tuple[int, int] | None  # (left, right) key counts
    sinks: int
    lengths: tuple[int, ...] | None  # valid keys per batch row, as Python ints (one host sync)
    has_dense_mask: bool
    pattern: SparsePattern | None = None  # intersected with the rest
    query_lengths: tuple[int, ...] | None = None  # real queries per row: per-row alignment

    @property
    def shift(self) -> int:
        """Query i sits at key position i + shift (bottom-right alignment)."""
        return self.key_len - self.query_len

    def row_shifts(self) -> tuple[int, ...] | None:
        """Each row's shift when rows align their own last query with their own last key (with
        query_lengths), else None: one shift for every row."""
        if self.query_lengths is None:
            return None
        keys = (
            self.lengths if self.lengths is not None else (self.key_len,) * len(self.query_lengths)
        )
        return tuple(k - q for q, k in zip(self.query_lengths, keys, strict=True))

    def shift_range(self) -> tuple[int, int]:
        """The smallest and largest shift of any row: tile decisions hold for all rows."""
        shifts = self.row_shifts()
        return (self.shift, self.shift) if shifts is None else (min(shifts), max(shifts))

    @property
    def future(self) -> float:
        """How far ahead of a query a sink key may lie and still be visible."""
        if self.causal:
            return 0
        return self.window[1] if self.window is not None else float("inf")

    def blocks(self, length: int, block: int) -> list[tuple[int, int]]:
        return [(start, min(start + block, length)) for start in range(0, length, block)]

    def query_blocks(self) -> list[tuple[int, int]]:
        return self.blocks(self.query_len, self.block_q)

    def key_blocks(self) -> list[tuple[int, int]]:
        return self.blocks(self.key_len, self.block_k)

    def tiles(self) -> list[list[tuple[int, Tile]]]:
        """For each query block, its (key block index, VISIBLE or PARTIAL) tiles, in key order;
        hidden tiles are absent. Decided from the block bounds alone, all tiles at once."""
        computed, whole = self.grid(self.block_q, self.block_k)
        kinds = torch.where(whole, 2, 1).masked_fill(~computed, 0).tolist()  # one host sync
        named = (None, Tile.PARTIAL, Tile.VISIBLE)
        return [[(kj, named[kind]) for kj, kind in enumerate(row) if kind] for row in kinds]

    def grid(self, block_q: int, block_k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(computed, whole): bool (n_q, n_k) CPU tensors over tiles of block_q x block_k: does
        any query of the tile see any of its keys; does every query see every key (no mask)."""
        index_lo = torch.arange(0, self.query_len, block_q).view(-1, 1)  # (n_q, 1)
        index_hi = (index_lo + block_q).clamp(max=self.query_len) - 1
        lowest, highest = self.shift_range()  # aligned bottom-right: every row's positions
        q_lo, q_hi = index_lo + lowest, index_hi + highest
        k_lo = torch.arange(0, self.key_len, block_k).view(1, -1)  # (1, n_k)
        k_hi = (k_lo + block_k).clamp(max=self.key_len) - 1
        shape = (q_lo.shape[0], k_lo.shape[1])
        computed = ~torch.as_tensor(self.hides(q_lo, q_hi, k_lo, k_hi)).expand(shape)
        whole = torch.as_tensor(self.shows_all(q_lo, q_hi, k_lo, k_hi)).expand(shape)
        if self.pattern is not None:
            some, every = self.pattern.tiles(q_lo, q_hi, k_lo, k_hi, self.key_len)
            computed, whole = computed & some, whole & every
        if self.query_lengths is not None:  # padding queries see nothing
            computed = computed & (index_lo < max(self.query_lengths))
            whole = whole & (index_hi < min(self.query_lengths))
        return computed, whole & computed

    def hides(self, q_min, q_max, k_min, k_max):
        """Does no aligned query in [q_min, q_max] see any key in [k_min, k_max]? Python ints
        or integer tensors of block bounds (then elementwise: FlexAttention's BlockMask)."""
        longest = max(self.lengths) if self.lengths is not None else self.key_len
        structural_none = False
        if self.causal:
            structural_none = structural_none | (k_min > q_max)
        if self.window is not None:
            left, right = self.window
            structural_none = structural_none | (k_max < q_min - left) | (k_min > q_max + right)
        sink_none = (k_min >= self.sinks) | (k_min > q_max + self.future)
        return (k_min >= longest) | (structural_none & sink_none)

    def shows_all(self, q_min, q_max, k_min, k_max):
        """Does every aligned query in [q_min, q_max] see every key in [k_min, k_max] (no mask
        needed)? Ints or tensors, as `hides`."""
        shortest = min(self.lengths) if self.lengths is not None else self.key_len
        structural_all = True
        if self.causal:
            structural_all = structural_all & (k_max <= q_min)
        if self.window is not None:
            left, right = self.window
            structural_all = structural_all & (k_min >= q_max - left) & (k_max <= q_min + right)
        sink_all = (k_max < self.sinks) & (k_max <= q_min + self.future)
        return (k_max < shortest) & (not self.has_dense_mask) & (structural_all | sink_all)

    def tile_mask(
        self, q_start: int, q_end: int, k_start: int, k_end: int, device: torch.device
    ) -> torch.Tensor:
        """Bool (B|1, 1, bq, 1, bk) mask of a PARTIAL tile, laid out like the score tiles.

        Score tiles are (B, H_kv, bq, G, bk): G query heads share each K/V head (GQA).
        """
        query_index = torch.arange(q_start, q_end, device=device)
        key_index = torch.arange(k_start, k_end, device=device)
        return self.visible(query_index, key_index)[:, :, :, None, :]

    def visible(self, query_index: torch.Tensor, key_index: torch.Tensor) -> torch.Tensor:
        """Bool (B|1, 1, n_q, n_k): may query query_index[a] see key key_index[b]?"""
        device, shifts = key_index.device, self.row_shifts()
        shift = self.shift if shifts is None else torch.tensor(shifts, device=device).view(-1, 1, 1)
        query_pos = query_index.view(1, -1, 1) + shift  # (B|1, n_q, 1), aligned bottom-right
        key_pos = key_index.view(1, 1, -1)  # (1, 1, n_k)
        structural = torch.ones(
            query_pos.shape[0], query_pos.shape[1], key_pos.shape[2], dtype=torch.bool,
            device=device,
        )  # fmt: skip
        if self.causal:
            structural &= key_pos <= query_pos
        if self.window is not None:
            left, right = self.window
            structural &= (key_pos >= query_pos - left) & (key_pos <= query_pos + right)
        if self.sinks:
            sink = key_pos < self.sinks
            if self.future != float("inf"):
                sink = sink & (key_pos <= query_pos + self.future)
            structural |= sink
        if self.pattern is not None:
            structural &= self.pattern.visible(query_pos, key_pos, self.key_len)
        mask = structural[:, None]  # (B|1, 1, n_q, n_k)
        if self.lengths is not None:
            lengths = torch.tensor(self.lengths, device=device).view(-1, 1, 1, 1)
            mask = mask & (key_index.view(1, 1, 1, -1) < lengths)  # (B, 1, n_q, n_k)
        if self.query_lengths is not None:
            real = torch.tensor(self.query_lengths, device=device).view(-1, 1, 1, 1)
            mask = mask & (query_index.view(1, 1, -1, 1) < real)  # padding queries: nothing
        return mask


def dropout_keep(
    seed: int,
    q_block: int,
    k_block: int,
    shape: tuple[int, ...],
    p: float,
    device: torch.device,
) -> torch.Tensor:
    """Which weights of one tile survive dropout: a pure function of (seed, tile), so the
    backward pass regenerates exactly the forward's mask without storing it."""
    generator = torch.Generator(device=device)
    generator.manual_seed((seed * 1_000_003 + q_block * 65_537 + k_block) % (2**63 - 1))
    return torch.rand(shape, generator=generator, device=device) >= p
