"""A score_mod that adds a learned term by clipped key-minus-query offset: relative positions.

Both relative position schemes qkv implements add, to the score of query i and key j, a value
that depends only on the offset j - i' (i' = i + shift, the query's key position), clipped to
[-R, R], and possibly on the batch row, the head and the query:

    score(b, h, i, j) += values[b, h, i, clip(j - i', -R, R) + R]

- T5 (Raffel et al. 2020, s2.1): values (1, H, 1, 2R + 1), the head's bias of each offset's
  bucket. Buckets stop changing at `max_distance` in both directions, so R = max_distance is
  exact for every offset.
- Shaw et al. 2018 (s3.1, eq. 4): values (B, H, L_q, 2k + 1) = scale * q_i . a_r for each
  clipped offset r, R = k.

`OffsetBias` is a score_mod with FlexAttention's signature, so every backend that takes a
score_mod takes it, and it tells its structure to the backends that compute the term in their
own kernels (the Triton kernels read `values` per tile, never an L_q x L_k tensor, and return
its gradient). It holds O(B H L_q R) values at most, O(H R) for T5.
"""

from __future__ import annotations

import torch

__all__ = ["OffsetBias"]


class OffsetBias:
    """score + values[b, h, i, clip(j - (i + shift), -max_distance, max_distance) + max_distance].

    values: (B or 1, H or 1, L_q or 1, 2 * max_distance + 1); a size-1 dimension is shared by
    every batch row, head or query. shift: L_k - L_q of the call it is made for (bottom-right
    alignment, as causal masking). Gradients reach `values` (and what it was computed from)
    on every backend that differentiates a score_mod's captured tensors.
    """

    def __init__(self, values: torch.Tensor, max_distance: int, shift: int) -> None:
        _check(values, max_distance, shift)
        self.shape = tuple(values.shape)
        self.max_distance, self.shift = max_distance, shift
        # `table` drops the shared dimensions once, here, contiguous: a reshape inside the
        # score_mod, a size-1 dimension indexed by a constant 0 or a transposed table trip
        # torch 2.13's CPU FlexAttention compiler
        self.kept = tuple(size > 1 for size in self.shape[:3])
        table = values.reshape(*[n for n in self.shape[:3] if n > 1], self.shape[3])
        self.table = table.contiguous()
        self._add = _score_mod(self.table, self.kept, max_distance, shift)

    @property
    def values(self) -> torch.Tensor:
        """The 4-D values, a view of `table`."""
        return self.table.reshape(self.shape)

    def index(self, q_idx: torch.Tensor, k_idx: torch.Tensor) -> torch.Tensor:
        """The column of `values` each (query, key) reads."""
        offset = k_idx - (q_idx + self.shift)
        return offset.clamp(-self.max_distance, self.max_distance) + self.max_distance

    def __call__(self, score, batch, head, q_idx, k_idx):
        return self._add(score, batch, head, q_idx, k_idx)

    def check_call(self, B: int, H: int, L_q: int, L_k: int) -> None:
        """ValueError unless `values` broadcasts over (B, H, L_q) and shift is L_k - L_q."""
        for name, size, have in zip(("B", "H", "L_q"), (B, H, L_q), self.shape[:3], strict=True):
            if have not in (1, size):
                raise ValueError(
                    f"score_mod: OffsetBias values of shape {self.shape} do not "
                    f"broadcast over {name} = {size}"
                )
        if self.shift != L_k - L_q:
            raise ValueError(
                f"score_mod: OffsetBias made for shift {self.shift}, but this call has "
                f"L_k - L_q = {L_k - L_q}"
            )


def _score_mod(table: torch.Tensor, kept: tuple[bool, ...], max_distance: int, shift: int):
    # torch 2.13's CPU FlexAttention compiles the ints a score_mod captures as symbols
    lowest = -max_distance  # negated here: a negated symbolic int fails to lower

    def add_offset_bias(score, batch, head, q_idx, k_idx):
        rows = [i for i, keep in zip((batch, head, q_idx), kept, strict=True) if keep]
        column = (k_idx - (q_idx + shift)).clamp(lowest, max_distance) - lowest
        return score + table[(*rows, column)].to(score.dtype)

    return add_offset_bias


def _check(values: object, max_distance: object, shift: object) -> None:
    if not isinstance(values, torch.Tensor) or values.dim() != 4:
        raise ValueError(f"values: expected a 4-D tensor, got {_describe(values)}")
    if not values.is_floating_point():
        raise ValueError(f"values: expected a floating tensor, got {values.dtype}")
    if isinstance(max_distance, bool) or not isinstance(max_distance, int) or max_distance < 0:
        raise ValueError(f"max_distance: expected an int >= 0, got {max_distance!r}")
    if values.shape[-1] != 2 * max_distance + 1:
        raise ValueError(
            f"values: expected a last dimension of 2 * max_distance + 1 = "
            f"{2 * max_distance + 1}, got shape {tuple(values.shape)}"
        )
    if isinstance(shift, bool) or not isinstance(shift, int):
        raise ValueError(f"shift: expected an int, got {shift!r}")


def _describe(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dim()}-D tensor of shape {tuple(value.shape)}"
    return repr(value)
