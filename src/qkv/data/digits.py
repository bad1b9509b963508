"""Real images that need no network: the 1,797 handwritten digits scikit-learn ships.

`load_digits` returns the UCI "Optical Recognition of Handwritten Digits" test set (Alpaydin &
Kaynak 1998) as scikit-learn packages it: 8x8 grey images, each pixel the count (0 .. 16) of set
pixels in a 4x4 block of a 32x32 bitmap, and the digit 0 .. 9 each shows. Here they become
float images (N, 1, 8, 8) scaled to [0, 1] and int64 labels (N,). `split_digits` cuts them into
seeded training, validation and test sets, stratified by class so that each split holds every
digit in its share; `shift_images` moves each image by a random whole number of pixels, the
augmentation a small Vision Transformer needs on so few examples.

scikit-learn is an optional dependency (`pip install 'qkv[vision]'`), imported only when the
digits are loaded.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from qkv.validation import check_int

__all__ = [
    "DigitSplits",
    "LabelledImages",
    "digit_splits",
    "load_digits",
    "shift_images",
    "split_digits",
]

NUM_CLASSES = 10
_MAX_PIXEL = 16.0  # scikit-learn's digits count set pixels in 4x4 blocks: 0 .. 16


@dataclass(frozen=True)
class LabelledImages:
    """images (N, C, H, W) float32 in [0, 1] and labels (N,) int64, row for row."""

    images: torch.Tensor
    labels: torch.Tensor

    def __post_init__(self) -> None:
        if self.images.dim() != 4 or self.labels.shape != self.images.shape[:1]:
            raise ValueError(
                f"images, labels: expected (N, C, H, W) and (N,), got {tuple(self.images.shape)} "
                f"and {tuple(self.labels.shape)}"
            )

    def __len__(self) -> int:
        return len(self.labels)

    def subset(self, indices: torch.Tensor) -> LabelledImages:
        """The examples at `indices` (a long tensor), in that order."""
        return LabelledImages(self.images[indices], self.labels[indices])


@dataclass(frozen=True)
class DigitSplits:
    """Disjoint training, validation and test sets."""

    train: LabelledImages
    valid: LabelledImages
    test: LabelledImages


def load_digits() -> LabelledImages:
    """All 1,797 digits: images (1797, 1, 8, 8) float32 in [0, 1], labels (1797,) int64.

    Raises ImportError, saying how to install it, when scikit-learn is missing.
    """
    pixels, labels = _digits_arrays()
    images = torch.tensor(pixels, dtype=torch.float32).view(-1, 1, 8, 8) / _MAX_PIXEL
    return LabelledImages(images, torch.tensor(labels, dtype=torch.int64))


@functools.lru_cache(maxsize=1)
def _digits_arrays():
    """scikit-learn's digits as numpy arrays (N, 64) and (N,), read once per process."""
    try:
        from sklearn.datasets import load_digits as sklearn_load_digits
    except ImportError as error:
        raise ImportError(
            "the digits come from scikit-learn, an optional dependency: "
            "pip install 'qkv[vision]' (or pip install scikit-learn)"
        ) from error
    bunch = sklearn_load_digits()
    return bunch.data, bunch.target


def split_digits(
    data: LabelledImages,
    *,
    valid_fraction: float = 0.1,
    test_fraction: float = 0.2,
    seed: int = 0,
    stratified: bool = True,
) -> DigitSplits:
    """Training, validation and test sets of `data`, drawn by a generator seeded with `seed`.

    stratified: each class is split on its own (round(fraction * its count) examples to test
    and to validation), so every split has the classes in the proportions of the whole;
    otherwise one random permutation of all examples is cut. Each split is in random order.
    """
    _check_fractions(valid_fraction, test_fraction)
    check_int("seed", seed, minimum=0)
    generator = torch.Generator().manual_seed(seed)
    groups = [torch.arange(len(data))]
    if stratified:
        groups = [torch.nonzero(data.labels == c).flatten() for c in data.labels.unique()]
    parts: dict[str, list[torch.Tensor]] = {"train": [], "valid": [], "test": []}
    for group in groups:
        shuffled = group[torch.randperm(len(group), generator=generator)]
        num_test = round(test_fraction * len(group))
        num_valid = round(valid_fraction * len(group))
        parts["test"].append(shuffled[:num_test])
        parts["valid"].append(shuffled[num_test : num_test + num_valid])
        parts["train"].append(shuffled[num_test + num_valid :])
    splits = {}
    for name, pieces in parts.items():
        indices = torch.cat(pieces)
        indices = indices[torch.randperm(len(indices), generator=generator)]  # mix the classes
        splits[name] = data.subset(indices)
    return DigitSplits(**splits)


def digit_splits(
    *, valid_fraction: float = 0.1, test_fraction: float = 0.2, seed: int = 0
) -> DigitSplits:
    """`split_digits(load_digits(), ...)`: stratified training, validation and test digits."""
    return split_digits(
        load_digits(), valid_fraction=valid_fraction, test_fraction=test_fraction, seed=seed
    )


def shift_images(
    images: torch.Tensor, *, max_shift: int = 1, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Each image of (B, C, H, W) moved by its own random (dy, dx), each in [-max_shift,
    max_shift], the pixels moved in from outside being 0 (the background). max_shift=0 returns
    the images unchanged."""
    check_int("max_shift", max_shift, minimum=0)
    if images.dim() != 4:
        raise ValueError(f"images: expected shape (B, C, H, W), got {tuple(images.shape)}")
    if max_shift == 0:
        return images
    B, _, H, W = images.shape
    s = max_shift
    padded = F.pad(images, (s, s, s, s))  # (B, C, H + 2s, W + 2s), zeros around
    offsets = torch.randint(0, 2 * s + 1, (B, 2), generator=generator)  # top-left corners
    rows = offsets[:, :1] + torch.arange(H)  # (B, H): the padded rows each image keeps
    columns = offsets[:, 1:] + torch.arange(W)  # (B, W)
    batch = torch.arange(B)[:, None, None]  # (B, 1, 1)
    moved = padded.permute(0, 2, 3, 1)[batch, rows[:, :, None], columns[:, None, :]]  # (B,H,W,C)
    return moved.permute(0, 3, 1, 2).contiguous()  # (B, C, H, W)


def _check_fractions(valid_fraction: float, test_fraction: float) -> None:
    for name, value in (("valid_fraction", valid_fraction), ("test_fraction", test_fraction)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 1:
            raise ValueError(f"{name}: expected a number in (0, 1), got {value!r}")
    if valid_fraction + test_fraction >= 1:
        raise ValueError(
            f"valid_fraction, test_fraction: {valid_fraction} + {test_fraction} leave no "
            f"training examples; expected a sum below 1"
        )
