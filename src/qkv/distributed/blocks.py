"""Which (query segment, key segment) pairs of a ring step are computed, and with what mask.

A rank holds its queries as one or two segments of global positions (`layout.segments`), and
so does the key block arriving from each other rank. Causal attention and windows are decided
on global positions, with qkv's rule (`qkv.attention.tiles`): key j is visible from query i
when [not causal or j <= i] and [i - left <= j <= i + right]. Each segment pair is classified
by interval arithmetic on its bounds, before anything is computed:

    hidden    no query of the segment sees any key of the other: skipped, no work at all;
    visible   every query sees every key: computed without a mask;
    partial   a (bq, bk) bool mask from the global positions (the diagonal of causal
              attention, the edge of a window, padding at the end of the sequence).

Padding (positions >= length) is never visible as a key, and as a query sees nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qkv.attention.tiles import TilePlan


@dataclass(frozen=True)
class BlockPair:
    """One computed pair: local rows of the queries, local rows of the key block, its mask."""

    query_rows: slice
    key_rows: slice
    visible: torch.Tensor | None  # bool (bq, bk), True = may attend; None: all visible


@dataclass(frozen=True)
class Masking:
    """The attention structure over global positions 0..length-1 (padding beyond)."""

    length: int  # the true sequence length N
    causal: bool
    window: tuple[int, int] | None  # (left, right) key counts

    def _plan(self) -> TilePlan:
        """qkv's tile rules over the whole sequence, queries and keys aligned (no shift)."""
        return TilePlan(
            query_len=self.length, key_len=self.length, block_q=1, block_k=1,
            causal=self.causal, window=self.window, sinks=0, lengths=None,
            has_dense_mask=False,
        )  # fmt: skip

    def pairs(
        self, query_segments: list[range], key_segments: list[range], device: torch.device
    ) -> list[BlockPair]:
        """The computed pairs between this rank's query segments and one key block's."""
        plan, found = self._plan(), []
        for q_rows, q_positions in _with_rows(query_segments):
            for k_rows, k_positions in _with_rows(key_segments):
                kind = self._classify(plan, q_positions, k_positions)
                if kind == "hidden":
                    continue
                visible = None
                if kind == "partial":
                    visible = self._mask(plan, q_positions, k_positions, device)
                found.append(BlockPair(q_rows, k_rows, visible))
        return found

    def _classify(self, plan: TilePlan, queries: range, keys: range) -> str:
        q_last = min(queries.stop, self.length) - 1  # the last real (not padding) position
        k_last = min(keys.stop, self.length) - 1
        if q_last < queries.start or k_last < keys.start:
            return "hidden"  # only padding on one side
        if plan.hides(queries.start, q_last, keys.start, k_last):
            return "hidden"
        unpadded = q_last == queries.stop - 1 and k_last == keys.stop - 1
        if unpadded and plan.shows_all(queries.start, q_last, keys.start, k_last):
            return "visible"
        return "partial"

    def _mask(
        self, plan: TilePlan, queries: range, keys: range, device: torch.device
    ) -> torch.Tensor:
        q_index = torch.arange(queries.start, queries.stop, device=device)
        k_index = torch.arange(keys.start, keys.stop, device=device)
        structural = plan.visible(q_index, k_index)[0, 0]  # (bq, bk)
        real = (q_index < self.length)[:, None] & (k_index < self.length)[None, :]
        return structural & real


def _with_rows(ranges: list[range]) -> list[tuple[slice, range]]:
    """Each segment of global positions with the rows it occupies in the local shard."""
    out, offset = [], 0
    for positions in ranges:
        out.append((slice(offset, offset + len(positions)), positions))
        offset += len(positions)
    return out
