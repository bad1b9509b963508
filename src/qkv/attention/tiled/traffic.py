"""Count the bytes the tiled forward moves, tile by tile: FlashAttention's I/O, observed.

Dao et al. 2022 (s3.2, Theorem 2) count the elements that move between the large, slow memory
holding Q, K, V and O (HBM) and the small, fast one where a tile is computed (SRAM). The tiled
forward (`kernels.forward`) keeps the same split: the inputs and the output and log-sum-exp
buffers are its HBM; a tile's scores and the current query block's running max, running sum
and output accumulator are its SRAM. Inside `count_tile_traffic()` the loop reports every
slice it reads from or writes to the first kind, with the query block and key block it
serves; outside it, the loop tests one local for None per tile and records nothing.

    with count_tile_traffic() as traffic:
        qkv.flash_attention(q, k, v, block_q=64, block_k=64)
    traffic.bytes()                    # all of it
    traffic.bytes(tensor="k")          # the K tiles alone
    traffic.per_tile()                 # {(query block, key block): bytes}

Only the forward loop is counted (not the backward, nor the casts to the compute dtype and
the row layout that precede the loop). Bytes are those of the tensors the loop touches, in
the compute dtype: fp32 for fp16/bf16/fp32 inputs, fp64 for fp64.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import torch

from qkv.validation import check_choice

__all__ = ["TileCounter", "TileTraffic", "Transfer", "active_traffic", "count_tile_traffic"]

DIRECTIONS = ("read", "write")


@dataclass(frozen=True)
class Transfer:
    """One slice moved between HBM and the tile being computed.

    tensor: "q", "k", "v", "o", "lse", "bias" or "mask". q_block: the query block served, or
    None for a whole buffer (the output and log-sum-exp set to 0 and -inf before the loop).
    k_block: the key block of the tile, or None for a once-per-query-block transfer.
    """

    direction: str  # "read" or "write"
    tensor: str
    q_block: int | None
    k_block: int | None
    elements: int
    bytes: int


class TileTraffic:
    """The transfers of every tiled forward run while `count_tile_traffic()` is active."""

    def __init__(self) -> None:
        self.transfers: list[Transfer] = []

    def record(
        self,
        direction: str,
        tensor: str,
        x: torch.Tensor,
        *,
        q_block: int | None = None,
        k_block: int | None = None,
    ) -> None:
        """Record that the loop moved all of `x` (a slice of an HBM tensor) in `direction`."""
        check_choice("direction", direction, DIRECTIONS)
        elements = x.numel()
        self.transfers.append(
            Transfer(direction, tensor, q_block, k_block, elements, elements * x.element_size())
        )

    def tile(self, q_block: int, k_block: int) -> TileCounter:
        """A recorder bound to one tile, handed to the code that reads the tile's operands."""
        return TileCounter(self, q_block, k_block)

    def bytes(self, *, direction: str | None = None, tensor: str | None = None) -> int:
        """Bytes moved, optionally only in one direction and/or of one tensor."""
        return sum(t.bytes for t in self._select(direction, tensor))

    def elements(self, *, direction: str | None = None, tensor: str | None = None) -> int:
        """Elements moved, filtered as `bytes`."""
        return sum(t.elements for t in self._select(direction, tensor))

    def per_tile(self) -> dict[tuple[int, int], int]:
        """Bytes read by each computed tile (query block, key block), in the loop's order."""
        tiles: dict[tuple[int, int], int] = {}
        for t in self.transfers:
            if t.q_block is not None and t.k_block is not None:
                key = (t.q_block, t.k_block)
                tiles[key] = tiles.get(key, 0) + t.bytes
        return tiles

    def _select(self, direction: str | None, tensor: str | None) -> Iterator[Transfer]:
        for t in self.transfers:
            if (direction is None or t.direction == direction) and (
                tensor is None or t.tensor == tensor
            ):
                yield t


@dataclass(frozen=True)
class TileCounter:
    """`TileTraffic.record` with the tile's query and key block filled in."""

    traffic: TileTraffic
    q_block: int
    k_block: int

    def read(self, tensor: str, x: torch.Tensor) -> TileCounter:
        self.traffic.record("read", tensor, x, q_block=self.q_block, k_block=self.k_block)
        return self


_ACTIVE: ContextVar[TileTraffic | None] = ContextVar("qkv_tile_traffic", default=None)


def active_traffic() -> TileTraffic | None:
    """The recorder of the innermost active `count_tile_traffic()`, or None."""
    return _ACTIVE.get()


@contextmanager
def count_tile_traffic() -> Iterator[TileTraffic]:
    """Record the HBM traffic of every tiled forward run inside the block (see the module)."""
    traffic = TileTraffic()
    token = _ACTIVE.set(traffic)
    try:
        yield traffic
    finally:
        _ACTIVE.reset(token)
