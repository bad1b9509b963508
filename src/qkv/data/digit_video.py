"""Videos that need no network: scikit-learn's 8x8 digits moving across a larger canvas.

Each clip shows one digit (`qkv.data.load_digits`) on a zero canvas of canvas_size x
canvas_size pixels, in T frames. The digit moves by `speed` pixels per frame in one of the
eight compass directions, drawn per clip, from a start drawn so that it stays whole on the
canvas in every frame:

    frame t = the digit placed with its top-left corner at (row_0 + t dy speed,
              column_0 + t dx speed),  (dy, dx) in DIRECTIONS,  t = 0 .. T - 1

A clip has two labels: the digit, which every frame shows, and the direction of motion, which
no single frame shows: a model reads it only by comparing frames (the temporal attention of
Bertasius et al. 2021 and Arnab et al. 2021). `digit_video_splits` draws the clips of the
digits' own seeded training, validation and test split (`qkv.data.digit_splits`), so no digit
of the test clips is seen in training; `digit_clips` draws fresh clips from any images, e.g. a
new direction and start for each training digit at every step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qkv.data.digits import digit_splits
from qkv.validation import check_positive_int

__all__ = [
    "DIRECTIONS",
    "DIRECTION_NAMES",
    "DigitClips",
    "DigitVideoSplits",
    "digit_clips",
    "digit_video_splits",
]

# (dy, dx) per frame, in pixels of `speed`: rows grow downwards, columns to the right
DIRECTIONS = ((-1, 0), (-1, 1), (0, 1), (1, 1), (1, 0), (1, -1), (0, -1), (-1, -1))
DIRECTION_NAMES = ("N", "NE", "E", "SE", "S", "SW", "W", "NW")


@dataclass(frozen=True)
class DigitClips:
    """videos (M, T, 1, S, S) float32 in [0, 1]; digits (M,) the digit each shows; directions
    (M,) the index of its motion in DIRECTIONS; row by row."""

    videos: torch.Tensor
    digits: torch.Tensor
    directions: torch.Tensor

    def __post_init__(self) -> None:
        M = self.videos.shape[:1]
        if self.videos.dim() != 5 or self.digits.shape != M or self.directions.shape != M:
            raise ValueError(
                f"videos, digits, directions: expected (M, T, C, S, S), (M,) and (M,), got "
                f"{tuple(self.videos.shape)}, {tuple(self.digits.shape)} and "
                f"{tuple(self.directions.shape)}"
            )

    def __len__(self) -> int:
        return len(self.digits)

    def labels(self, target: str) -> torch.Tensor:
        """The labels of `target`: "digit" (10 classes) or "motion" (8 directions)."""
        if target == "digit":
            return self.digits
        if target == "motion":
            return self.directions
        raise ValueError(f"target: expected 'digit' or 'motion', got {target!r}")


@dataclass(frozen=True)
class DigitVideoSplits:
    """Clips of the training, validation and test digits (disjoint sets of digits)."""

    train: DigitClips
    valid: DigitClips
    test: DigitClips


def digit_clips(
    images: torch.Tensor,
    labels: torch.Tensor,
    *,
    frames: int = 6,
    canvas_size: int = 16,
    speed: int = 1,
    generator: torch.Generator | None = None,
) -> DigitClips:
    """One clip per image of (M, 1, h, w) with digits `labels` (M,): a direction and a start
    drawn uniformly (from `generator`) among those that keep the digit whole in all frames."""
    T, S = check_positive_int("frames", frames), check_positive_int("canvas_size", canvas_size)
    check_positive_int("speed", speed)
    if not isinstance(images, torch.Tensor) or images.dim() != 4 or images.shape[1] != 1:
        raise ValueError(f"images: expected shape (M, 1, h, w), got {_shape(images)}")
    M, _, h, w = images.shape
    if not isinstance(labels, torch.Tensor) or tuple(labels.shape) != (M,):
        raise ValueError(f"labels: expected shape ({M},), got {_shape(labels)}")
    travel = (T - 1) * speed
    if max(h, w) + travel > S:
        raise ValueError(
            f"canvas_size: {S} cannot hold a {h}x{w} digit moving {travel} pixels "
            f"(frames={T}, speed={speed}); expected at least {max(h, w) + travel}"
        )
    directions = torch.randint(len(DIRECTIONS), (M,), generator=generator)  # (M,)
    steps = torch.tensor(DIRECTIONS)[directions]  # (M, 2): (dy, dx)
    corners = torch.stack(
        [
            _start(steps[:, axis], room, travel, generator)
            for axis, room in ((0, S - h), (1, S - w))
        ],
        dim=1,
    )  # (M, 2): the top-left corner in frame 0
    videos = _render(images, corners, steps * speed, frames=T, canvas_size=S)
    return DigitClips(videos, labels.clone(), directions)


def digit_video_splits(
    *,
    frames: int = 6,
    canvas_size: int = 16,
    speed: int = 1,
    clips_per_digit: int = 1,
    valid_fraction: float = 0.1,
    test_fraction: float = 0.2,
    seed: int = 0,
) -> DigitVideoSplits:
    """Clips of `qkv.data.digit_splits(valid_fraction, test_fraction, seed)`: clips_per_digit
    clips of every digit of each split, their motions drawn from a generator seeded by seed."""
    check_positive_int("clips_per_digit", clips_per_digit)
    splits = digit_splits(valid_fraction=valid_fraction, test_fraction=test_fraction, seed=seed)
    generator = torch.Generator().manual_seed(seed)
    clips = {}
    for name in ("train", "valid", "test"):
        part = getattr(splits, name)
        clips[name] = digit_clips(
            part.images.repeat(clips_per_digit, 1, 1, 1), part.labels.repeat(clips_per_digit),
            frames=frames, canvas_size=canvas_size, speed=speed, generator=generator,
        )  # fmt: skip
    return DigitVideoSplits(**clips)


def _start(
    step: torch.Tensor, room: int, travel: int, generator: torch.Generator | None
) -> torch.Tensor:
    """A uniform start along one axis in [low, high]: room = canvas - digit side; a digit
    moving by +travel starts at most room - travel, one moving by -travel at least travel."""
    low = (step < 0).long() * travel  # (M,)
    high = room - (step > 0).long() * travel  # (M,)
    uniform = torch.rand(step.shape, generator=generator, dtype=torch.float64)
    return low + (uniform * (high - low + 1)).long().clamp(max=high - low)


def _render(
    images: torch.Tensor, corners: torch.Tensor, velocity: torch.Tensor, *, frames: int,
    canvas_size: int,
) -> torch.Tensor:  # fmt: skip
    """(M, T, 1, S, S) canvases, image m at corners[m] + t * velocity[m] in frame t."""
    M, _, h, w = images.shape
    t = torch.arange(frames)  # (T,)
    top = corners[:, None, 0] + t * velocity[:, None, 0]  # (M, T)
    left = corners[:, None, 1] + t * velocity[:, None, 1]  # (M, T)
    rows = top[:, :, None, None] + torch.arange(h)[:, None]  # (M, T, h, 1)
    columns = left[:, :, None, None] + torch.arange(w)  # (M, T, 1, w)
    clip = torch.arange(M)[:, None, None, None]  # (M, 1, 1, 1)
    frame = t[None, :, None, None]  # (1, T, 1, 1)
    videos = images.new_zeros(M, frames, canvas_size, canvas_size)
    videos[clip, frame, rows, columns] = images[:, None, 0]  # each frame gets the whole digit
    return videos.unsqueeze(2)  # (M, T, 1, S, S)


def _shape(value: object) -> object:
    return tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
