"""`FastRotaryEmbedding`: RoPE (Su et al. 2021) with apply_rope's bits in fewer ops, swapped into
a built model by `fast_rope(model)`.

Two savings, on the half layout (Hugging Face's Llama):

- the rotation x * cos + rotate_half(x) * sin (chunk, neg, cat, two products and a sum) equals
  x * cos + roll(x, D/2) * (-sin_1, sin_2) bit for bit, negation being exact: the sign moves
  into the sin table, made once, and each rotation is one roll instead of chunk, neg and cat;
- a model shares one RotaryEmbedding across its layers and gives them one positions tensor:
  within one call of the model the tables are computed at the first layer and reused by the
  others. A call is the model's own forward, which hooks on the model open and close; a call
  that bypasses them (`type(model).forward(model, ...)`, torch.compile) computes its tables at
  every layer, as the plain module does. Nothing outlives a call, so positions changed in place
  between two calls are always seen.

Decoding runs RoPE twice per layer and token, on tiny tensors whose cost is the number of ops.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import NamedTuple

import torch
from torch import nn

from qkv.positional import RotaryEmbedding

__all__ = ["FastRotaryEmbedding", "fast_rope"]


class _RolledTables(NamedTuple):
    """cos (L, D) or (B, 1, L, D), and sin with its first half negated, for the roll."""

    cos: torch.Tensor
    flipped_sin: torch.Tensor


class _Call:
    """The tables made during the open call of one model: (rope, positions, key, tables)."""

    def __init__(self) -> None:
        self.depth = 0
        self.tables: list[tuple[RotaryEmbedding, object, tuple, _RolledTables]] = []

    def find(self, rope, positions, key) -> _RolledTables | None:
        for owner, seen, seen_key, tables in self.tables:
            if owner is rope and seen is positions and seen_key == key:
                return tables
        return None


# rope module -> the call of the model it was swapped in with (weak: a dropped model frees it)
_CALLS: weakref.WeakKeyDictionary[nn.Module, _Call] = weakref.WeakKeyDictionary()


class FastRotaryEmbedding(RotaryEmbedding):
    """RotaryEmbedding whose `tables` and `rotate` compute the half layout by a roll, with the
    tables shared within a call of the model (see the module doc); the interleaved layout and
    traced calls are the plain module's. It adds nothing to RotaryEmbedding but these two
    methods: `fast_rope(model)` turns a model's own RotaryEmbedding modules into this class."""

    def tables(self, positions, length: int, device, dtype: torch.dtype):
        if self.layout != "half" or torch.compiler.is_compiling():
            return super().tables(positions, length, device, dtype)
        call = _CALLS.get(self)
        key = (length, device, dtype, torch.is_grad_enabled(), torch.is_inference_mode_enabled())
        found = None if call is None or not call.depth else call.find(self, positions, key)
        if found is not None:
            return found
        cos, sin = super().tables(positions, length, device, dtype)  # (L | B, L, D)
        if cos.dim() == 3:  # (B, L, D) -> (B, 1, L, D): broadcast over heads
            cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        half = self.head_dim // 2
        tables = _RolledTables(cos, torch.cat((-sin[..., :half], sin[..., half:]), dim=-1))
        if call is not None and call.depth:
            call.tables.append((self, positions, key, tables))  # holds positions: ids stay apart
        return tables

    def rotate(self, x: torch.Tensor, tables) -> torch.Tensor:
        if not isinstance(tables, _RolledTables):
            return super().rotate(x, tables)
        rolled = x.roll(self.head_dim // 2, dims=-1)  # (x_2, x_1): rotate_half without the sign
        return (x * tables.cos + rolled * tables.flipped_sin).to(x.dtype)  # (B, heads, L, D)


@contextlib.contextmanager
def fast_rope(model: nn.Module) -> Iterator[nn.Module]:
    """Inside the block, every `RotaryEmbedding` of `model` (that very class) is a
    `FastRotaryEmbedding`: the same outputs, bit for bit, in fewer ops, its tables computed once
    per call of `model`. Yields the model; on exit the modules and hooks are as they were."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected an nn.Module, got {type(model).__name__}")
    ropes = [m for m in model.modules() if type(m) is RotaryEmbedding]
    call = _Call()

    def opened(module, args):
        call.depth += 1

    def closed(module, args, output):
        call.depth -= 1
        if not call.depth:
            call.tables.clear()

    handles = []
    try:
        handles.append(model.register_forward_pre_hook(opened))
        handles.append(model.register_forward_hook(closed, always_call=True))
        for rope in ropes:
            rope.__class__ = FastRotaryEmbedding
            _CALLS[rope] = call
        yield model
    finally:
        for handle in handles:
            handle.remove()
        for rope in ropes:
            _CALLS.pop(rope, None)
            if type(rope) is FastRotaryEmbedding:
                rope.__class__ = RotaryEmbedding
