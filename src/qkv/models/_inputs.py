"""Checks of the inputs the models take: ids, (B, L) attention masks, class labels.

Errors name the argument, the value seen and the value expected.
"""

from __future__ import annotations

import torch

from qkv.models.losses import IGNORE_INDEX
from qkv.validation import describe

__all__ = ["check_class_labels", "check_ids", "key_mask"]


def key_mask(
    name: str, mask: torch.Tensor | None, expected_shape: tuple[int, ...]
) -> torch.Tensor | None:
    """A (B, L) attention mask, 1/True on real tokens -> qkv key mask (B, 1, 1, L)."""
    if mask is None:
        return None
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor or None, got {type(mask).__name__}")
    if mask.is_floating_point() or mask.is_complex():
        raise TypeError(
            f"{name}: expected a bool or 0/1 integer tensor (1/True on real tokens), got dtype "
            f"{mask.dtype}; an additive float mask is not accepted here"
        )
    if tuple(mask.shape) != expected_shape:
        raise ValueError(f"{name}: expected shape {expected_shape}, got {tuple(mask.shape)}")
    return mask.bool()[:, None, None, :]  # (B, 1, 1, L)


def check_ids(
    name: str, ids: object, *, vocab_size: int | None = None, allow_ignored: bool = False
) -> None:
    """A (B, L) integer tensor of ids in [0, vocab_size) (or -100, the ignored label)."""
    if not isinstance(ids, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(ids).__name__}")
    if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise TypeError(f"{name}: expected an integer tensor, got dtype {ids.dtype}")
    if ids.dim() != 2:
        raise ValueError(f"{name}: expected shape (B, L), got {tuple(ids.shape)}")
    if vocab_size is None or ids.numel() == 0:
        return
    real = ids[ids != IGNORE_INDEX] if allow_ignored else ids
    if real.numel() and (int(real.min()) < 0 or int(real.max()) >= vocab_size):
        raise ValueError(
            f"{name}: expected ids in [0, {vocab_size}), got values in "
            f"[{int(real.min())}, {int(real.max())}]"
        )


def check_class_labels(labels: object, batch: int, num_classes: int) -> None:
    """labels: (batch,) integer class indices in [0, num_classes), as a classifier takes them."""
    if not isinstance(labels, torch.Tensor) or tuple(labels.shape) != (batch,):
        raise ValueError(f"labels: expected shape ({batch},) class indices, got {describe(labels)}")
    if labels.is_floating_point() or labels.dtype == torch.bool:
        raise TypeError(f"labels: expected an integer tensor of class indices, got {labels.dtype}")
    if len(labels) and not 0 <= int(labels.min()) <= int(labels.max()) < num_classes:
        raise ValueError(
            f"labels: expected class indices in [0, {num_classes}), got values from "
            f"{int(labels.min())} to {int(labels.max())}"
        )
