"""Sequences packed one after the other without padding, as a pattern: FlashAttention's
variable-length (`cu_seqlens`) layout (Dao 2023), served by every backend that takes a
pattern."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qkv.attention.sparse.base import SparsePattern
from qkv.validation import check_int

__all__ = ["Packed"]


@dataclass(frozen=True)
class Packed(SparsePattern):
    """Sequences packed along the length axis: sequence s holds queries
    [query_offsets[s], query_offsets[s + 1]) and keys [key_offsets[s], key_offsets[s + 1])
    (the `cu_seqlens` of FlashAttention's varlen API, Dao 2023). A query sees the keys of its
    own sequence only; `causal` and `window` (left, right) align each sequence's last query with
    its last key, as they align a whole call. Give causal and window here, not to the call,
    whose own alignment is that of the whole packed length."""

    query_offsets: tuple[int, ...]
    key_offsets: tuple[int, ...] | None = None  # default: the query offsets
    causal: bool = False
    window: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        _check_offsets("query_offsets", self.query_offsets)
        if self.key_offsets is None:
            object.__setattr__(self, "key_offsets", self.query_offsets)
        _check_offsets("key_offsets", self.key_offsets)
        if len(self.key_offsets) != len(self.query_offsets):
            raise ValueError(
                f"key_offsets: {len(self.key_offsets) - 1} sequences, expected as many as "
                f"query_offsets' {len(self.query_offsets) - 1}"
            )
        if not isinstance(self.causal, bool):
            raise TypeError(f"causal: expected a bool, got {self.causal!r}")
        if self.window is not None:
            if not (isinstance(self.window, tuple) and len(self.window) == 2):
                raise TypeError(f"window: expected (left, right) or None, got {self.window!r}")
            for extent in self.window:
                check_int("window", extent, minimum=0)

    @classmethod
    def from_lengths(cls, query_lengths, key_lengths=None, *, causal=False, window=None):
        """The pattern of sequences of these lengths (ints), packed in this order."""
        return cls(
            _offsets("query_lengths", query_lengths),
            None if key_lengths is None else _offsets("key_lengths", key_lengths),
            causal=causal,
            window=window,
        )

    def positions(self, device=None) -> torch.Tensor:
        """(L_q,) int64: each query's position within its own sequence, 0 .. n_s - 1."""
        lengths = torch.tensor(self.query_offsets, device=device).diff()  # (S,)
        starts = torch.tensor(self.query_offsets[:-1], device=device)
        index = torch.arange(self.query_offsets[-1], device=device)
        return index - starts.repeat_interleave(lengths)

    def rule(self, key_len, device=None):
        self._check_key_len(key_len)
        query_lengths = torch.tensor(self.query_offsets, device=device).diff()  # (S,)
        key_lengths = torch.tensor(self.key_offsets, device=device).diff()  # (S,)
        sequences = torch.arange(len(query_lengths), device=device)
        # lookup tables (what FlexAttention's mask_mod can read): the sequence of every query
        # and key, and the key position each query's causal diagonal passes through
        query_sequence = sequences.repeat_interleave(query_lengths)  # (L_q,)
        key_sequence = sequences.repeat_interleave(key_lengths)  # (L_k,)
        diagonal = (key_lengths.cumsum(0) - query_lengths.cumsum(0))[query_sequence]
        position_of = torch.arange(len(query_sequence), device=device) + diagonal  # (L_q,)
        shift = key_len - self.query_offsets[-1]  # undoes the call's bottom-right alignment
        left, right = self.window if self.window is not None else (None, None)

        def visible(query_pos, key_pos):
            query = query_pos - shift  # the query's index in the packed sequence
            same = query_sequence[query] == key_sequence[key_pos]
            position = position_of[query]  # aligned within its own sequence
            if self.causal:
                same = same & (key_pos <= position)
            if left is not None:
                same = same & (key_pos >= position - left) & (key_pos <= position + right)
            return same

        return visible

    def visible(self, query_pos, key_pos, key_len):
        return self.rule(key_len, key_pos.device)(query_pos, key_pos)

    def tiles(self, q_lo, q_hi, k_lo, k_hi, key_len):
        """Per sequence: the part of the tile inside it, then causal/window interval
        arithmetic on that part (exact: the constraints are intervals along the diagonal)."""
        self._check_key_len(key_len)
        shift = key_len - self.query_offsets[-1]
        q_lo, q_hi = torch.as_tensor(q_lo) - shift, torch.as_tensor(q_hi) - shift
        k_lo, k_hi = torch.as_tensor(k_lo), torch.as_tensor(k_hi)
        some = torch.zeros(torch.broadcast_shapes(q_lo.shape, k_lo.shape), dtype=torch.bool)
        every = torch.zeros_like(some)
        bounds = zip(self.query_offsets, self.query_offsets[1:], self.key_offsets,
                     self.key_offsets[1:], strict=False)  # fmt: skip
        for q_start, q_end, k_start, k_end in bounds:
            diagonal = k_end - q_end
            first_q, last_q = q_lo.clamp(min=q_start), q_hi.clamp(max=q_end - 1)
            first_k, last_k = k_lo.clamp(min=k_start), k_hi.clamp(max=k_end - 1)
            inside = (first_q <= last_q) & (first_k <= last_k)
            low, high = first_q + diagonal, last_q + diagonal  # aligned query positions
            if self.causal:
                inside = inside & (first_k <= high)
            if self.window is not None:
                left, right = self.window
                inside = inside & (last_k >= low - left) & (first_k <= high + right)
            some |= inside
            whole = (q_lo >= q_start) & (q_hi < q_end) & (k_lo >= k_start) & (k_hi < k_end)
            if self.causal:
                whole = whole & (k_hi <= low)
            if self.window is not None:
                left, right = self.window
                whole = whole & (k_lo >= high - left) & (k_hi <= low + right)
            every |= whole
        return some, every

    def check(self, query_len, key_len):
        self._check_key_len(key_len)
        if query_len != self.query_offsets[-1]:
            raise ValueError(
                f"pattern: packed sequences of {self.query_offsets[-1]} queries in all, but the "
                f"call has L_q={query_len}; expected the packed length"
            )

    def _check_key_len(self, key_len: int) -> None:
        if key_len != self.key_offsets[-1]:
            raise ValueError(
                f"pattern: packed sequences of {self.key_offsets[-1]} keys in all, but the call "
                f"has L_k={key_len}; expected the packed length"
            )


def _check_offsets(name: str, offsets) -> None:
    if not isinstance(offsets, tuple) or len(offsets) < 2:
        raise TypeError(f"{name}: expected a tuple of at least 2 ints, got {offsets!r}")
    for value in offsets:
        check_int(name, value, minimum=0)
    if offsets[0] != 0 or any(b < a for a, b in zip(offsets, offsets[1:], strict=False)):
        raise ValueError(f"{name}: expected non-decreasing offsets from 0, got {offsets!r}")


def _offsets(name: str, lengths) -> tuple[int, ...]:
    """(0, n_0, n_0 + n_1, ...) from sequence lengths (a list, tuple or 1-D integer tensor)."""
    if isinstance(lengths, torch.Tensor):
        lengths = lengths.tolist()
    if not isinstance(lengths, (list, tuple)) or not lengths:
        raise TypeError(f"{name}: expected a non-empty list of ints, got {lengths!r}")
    total, offsets = 0, [0]
    for n in lengths:
        total += check_int(name, n, minimum=0)
        offsets.append(total)
    return tuple(offsets)
