"""A `GPT` call on several sequences packed along L without padding (`sequence_lengths`): each
attends only to itself (`qkv.sparse.Packed`), positions restart at 0 for each, and no loss is
taken on a sequence's first token predicted from the one before it."""

from __future__ import annotations

import torch

from qkv.attention.sparse import Packed
from qkv.models.losses import IGNORE_INDEX

__all__ = ["packed_call"]


def packed_call(sequence_lengths, L: int, cache, position_ids, labels, device):
    """(pattern, position_ids, labels) of a call with `sequence_lengths` (see GPT.forward)."""
    if cache is not None:
        raise ValueError("sequence_lengths: packed sequences are for training and scoring; "
                         "expected cache=None")  # fmt: skip
    pattern = Packed.from_lengths(sequence_lengths)
    if pattern.query_offsets[-1] != L:
        raise ValueError(
            f"sequence_lengths: {list(sequence_lengths)} sum to {pattern.query_offsets[-1]}, "
            f"expected the packed length L={L}"
        )
    starts = torch.tensor(pattern.query_offsets[:-1], device=device)
    if position_ids is None:  # 0 .. n_s - 1 in each sequence
        position_ids = pattern.positions(device)
    if labels is not None:  # a sequence's first token is not predicted from the one before
        labels = labels.clone()
        labels[:, starts[1:]] = IGNORE_INDEX
    return pattern, position_ids, labels
