"""How a sequence is cut across the P processes of a ring, and put back together.

Ring attention (Liu et al. 2023) gives each process one share of the sequence: its queries stay,
its keys and values travel. Which positions a process holds is the layout:

    contiguous   P chunks of N_pad / P positions; rank r holds chunk r.
    zigzag       2P chunks of C = N_pad / (2P); rank r holds chunks r and 2P - 1 - r, in that
                 order, so its shard is (C positions from r * C, C from (2P - 1 - r) * C).

Under causal attention a query at position i sees i + 1 keys, so in the contiguous layout the
last rank does about 2P - 1 times the work of the first, and every ring step waits for it.
Pairing an early chunk with a late one evens the work out: every rank then computes the same
number of (query, key) pairs. This is the load balancing of Striped Attention (Brandon et al.
2023), which deals single positions round-robin; zigzag deals chunks instead, so that whole
chunk pairs are either hidden (skipped) or fully visible (computed without a mask).

Padding. A length N that 2P (zigzag) or P (contiguous) does not divide is padded at the end to
N_pad, the next multiple: `shard_sequence` fills positions N..N_pad-1 with zeros, and
`ring_attention(..., length=N)` never lets them be seen as keys and gives them, as queries,
output 0 (they see nothing); `gather_sequence(..., length=N)` cuts them off again.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from qkv.validation import check_int, check_positive_int

LAYOUTS = ("contiguous", "zigzag")

__all__ = ["LAYOUTS", "gather_sequence", "padded_length", "segments", "shard_sequence"]


def check_layout(layout: object) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"layout: expected one of {LAYOUTS}, got {layout!r}")
    return layout


def padded_length(length: int, world_size: int, layout: str = "zigzag") -> int:
    """N_pad: `length` rounded up to a multiple of the number of chunks (P or 2P)."""
    check_int("length", length, minimum=1)
    chunks = _num_chunks(world_size, check_layout(layout))
    return -(-length // chunks) * chunks


def segments(rank: int, world_size: int, padded: int, layout: str = "zigzag") -> list[range]:
    """The global positions rank `rank` holds, as ranges in the order of its shard.

    `padded` is N_pad, a multiple of the number of chunks."""
    chunks = _num_chunks(world_size, check_layout(layout))
    check_int("rank", rank, minimum=0)
    if rank >= world_size:
        raise ValueError(f"rank: expected 0 <= rank < world_size = {world_size}, got {rank}")
    if padded % chunks:
        raise ValueError(f"padded: expected a multiple of {chunks} chunks, got {padded}")
    size = padded // chunks
    owned = [rank] if layout == "contiguous" else [rank, 2 * world_size - 1 - rank]
    return [range(chunk * size, (chunk + 1) * size) for chunk in owned]


def shard_sequence(
    x: torch.Tensor, rank: int, world_size: int, dim: int, *, layout: str = "zigzag"
) -> torch.Tensor:
    """This rank's shard of the full sequence `x` along `dim`, zero-padded to N_pad first.

    x: (..., N, ...) with N = x.shape[dim]. Returns (..., N_pad / P, ...), a new tensor. Pass
    `length=N` to `ring_attention` when N_pad != N (see the module docstring)."""
    dim = _check_dim(x, dim)
    length = x.shape[dim]
    padded = padded_length(length, world_size, layout)
    if padded != length:  # F.pad counts (left, right) pairs from the last dim backwards
        x = F.pad(x, (0, 0) * (x.dim() - 1 - dim) + (0, padded - length))
    parts = [
        x.narrow(dim, part.start, len(part)) for part in segments(rank, world_size, padded, layout)
    ]
    return torch.cat(parts, dim=dim)


def gather_sequence(
    x: torch.Tensor,
    dim: int,
    *,
    layout: str = "zigzag",
    length: int | None = None,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """The inverse of `shard_sequence`, a collective: every rank of `group` calls it with its
    shard (..., N_pad / P, ...) and gets the full (..., length, ...) sequence back.

    length: the true N (default N_pad, no padding). No gradient flows through the gather: it
    is for outputs and checks, not for the middle of a model."""
    dim = _check_dim(x, dim)
    world_size = dist.get_world_size(group) if dist.is_initialized() else 1
    shards = [x] if world_size == 1 else [torch.empty_like(x) for _ in range(world_size)]
    if world_size > 1:
        dist.all_gather(shards, x.contiguous(), group=group)
    padded = x.shape[dim] * world_size
    length = padded if length is None else check_int("length", length, minimum=1)
    if padded_length(length, world_size, layout) != padded:
        raise ValueError(
            f"length: {length} pads to {padded_length(length, world_size, layout)} under "
            f"layout {layout!r}, but {world_size} shards of {x.shape[dim]} hold {padded}"
        )
    shape = list(x.shape)
    shape[dim] = padded
    full = x.new_empty(shape)  # (..., N_pad, ...)
    for rank, shard in enumerate(shards):
        offset = 0
        for part in segments(rank, world_size, padded, layout):
            full.narrow(dim, part.start, len(part)).copy_(shard.narrow(dim, offset, len(part)))
            offset += len(part)
    return full.narrow(dim, 0, length)


def _num_chunks(world_size: int, layout: str) -> int:
    check_positive_int("world_size", world_size)
    return world_size if layout == "contiguous" else 2 * world_size


def _check_dim(x: torch.Tensor, dim: int) -> int:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x: expected a torch.Tensor, got {type(x).__name__}")
    check_int("dim", dim)
    if not -x.dim() <= dim < x.dim():
        raise ValueError(f"dim: expected a dim of a {x.dim()}-D tensor, got {dim}")
    return dim % x.dim()
