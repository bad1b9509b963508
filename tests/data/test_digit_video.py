"""Digit videos: every frame against the digit pasted by hand with NumPy slicing at the place
its direction says, whole digits on the canvas, directions and starts uniform (chi-square,
scipy), splits made of the digits' own split, seeded draws, and errors that name the argument.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from qkv.data import digit_splits, load_digits
from qkv.data.digit_video import DIRECTIONS, DigitClips, digit_clips, digit_video_splits

P_VALUE = 1e-3  # a correct sampler fails one test in a thousand


@pytest.fixture(scope="module")
def digits():
    return load_digits()


def _placement(frame: np.ndarray, image: np.ndarray) -> tuple[int, int]:
    """The one (row, column) where `image` pasted on a zero canvas gives `frame`, by search."""
    side = frame.shape[0]
    h, w = image.shape
    found = []
    for row in range(side - h + 1):
        for column in range(side - w + 1):
            canvas = np.zeros_like(frame)
            canvas[row : row + h, column : column + w] = image
            if np.array_equal(canvas, frame):
                found.append((row, column))
    assert len(found) == 1, found
    return found[0]


@pytest.mark.parametrize(("frames", "canvas_size", "speed"), [(6, 16, 1), (4, 16, 2), (3, 10, 1)])
def test_each_frame_is_the_digit_pasted_where_its_direction_moves_it(
    digits, frames, canvas_size, speed
):
    images, labels = digits.images[:24], digits.labels[:24]
    generator = torch.Generator().manual_seed(1)
    clips = digit_clips(images, labels, frames=frames, canvas_size=canvas_size, speed=speed,
                        generator=generator)  # fmt: skip
    assert clips.videos.shape == (24, frames, 1, canvas_size, canvas_size)
    assert torch.equal(clips.digits, labels)
    for m in range(24):
        image = images[m, 0].numpy()
        row, column = _placement(clips.videos[m, 0, 0].numpy(), image)
        dy, dx = DIRECTIONS[int(clips.directions[m])]
        for t in range(frames):
            expected = np.zeros((canvas_size, canvas_size), dtype=np.float32)
            top, left = row + t * dy * speed, column + t * dx * speed
            assert 0 <= top <= canvas_size - 8 and 0 <= left <= canvas_size - 8  # whole
            expected[top : top + 8, left : left + 8] = image
            np.testing.assert_array_equal(clips.videos[m, t, 0].numpy(), expected)


def test_directions_and_starts_are_uniform(digits):
    """8,000 clips: the 8 directions uniform; for the clips moving east (dx = +1) over 6 frames
    on 16 pixels, the first column uniform over the 4 that keep the digit whole (0 .. 3), the
    first row over all 9 (0 .. 8)."""
    images = digits.images[:1].expand(8000, -1, -1, -1)
    labels = torch.zeros(8000, dtype=torch.long)
    clips = digit_clips(images, labels, generator=torch.Generator().manual_seed(2))
    counts = torch.bincount(clips.directions, minlength=8).numpy()
    assert chisquare(counts).pvalue > P_VALUE
    east = DIRECTIONS.index((0, 1))
    image = images[0, 0].numpy()
    moving_east = torch.nonzero(clips.directions == east).flatten()[:300]
    corners = np.array([_placement(clips.videos[m, 0, 0].numpy(), image) for m in moving_east])
    rows = np.bincount(corners[:, 0], minlength=9)
    columns = np.bincount(corners[:, 1], minlength=4)
    assert len(rows) == 9 and len(columns) == 4  # no start outside the allowed range
    assert chisquare(rows).pvalue > P_VALUE and chisquare(columns).pvalue > P_VALUE


def test_splits_are_the_digits_own_split_with_seeded_motions():
    splits = digit_video_splits(frames=4, seed=0)
    images = digit_splits(seed=0)
    for name in ("train", "valid", "test"):
        clips, part = getattr(splits, name), getattr(images, name)
        assert torch.equal(clips.digits, part.labels) and torch.equal(
            clips.labels("digit"), part.labels
        )
        assert torch.equal(clips.labels("motion"), clips.directions)
        for m in range(0, len(clips), 97):  # the clip shows the split's own image
            frame = clips.videos[m, 0, 0].numpy()
            row, column = _placement(frame, part.images[m, 0].numpy())
            np.testing.assert_array_equal(frame[row : row + 8, column : column + 8],
                                          part.images[m, 0].numpy())  # fmt: skip
    again = digit_video_splits(frames=4, seed=0)
    assert torch.equal(again.test.videos, splits.test.videos)
    other = digit_video_splits(frames=4, seed=1)
    assert not torch.equal(other.test.directions, splits.test.directions)


def test_clips_per_digit_repeats_each_digit_with_its_own_motion():
    once, twice = digit_video_splits(clips_per_digit=1), digit_video_splits(clips_per_digit=2)
    n = len(once.train)
    assert len(twice.train) == 2 * n
    assert torch.equal(twice.train.digits, once.train.digits.repeat(2))
    assert not torch.equal(twice.train.directions[:n], twice.train.directions[n:])


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"canvas_size": 12}, "canvas_size"),  # 8 pixels + 5 frames of motion need 13
        ({"frames": 0}, "frames"),
        ({"speed": 0}, "speed"),
        ({"labels": torch.zeros(3, dtype=torch.long)}, "labels"),
        ({"images": torch.zeros(4, 8, 8)}, "images"),
    ],
)
def test_bad_input_names_the_argument(digits, kwargs, named):
    arguments = {"images": digits.images[:4], "labels": digits.labels[:4], **kwargs}
    images, labels = arguments.pop("images"), arguments.pop("labels")
    with pytest.raises(ValueError, match=f"^{named}: "):
        digit_clips(images, labels, **arguments)
    with pytest.raises(ValueError, match="^target: "):
        DigitClips(torch.zeros(1, 2, 1, 4, 4), torch.zeros(1), torch.zeros(1)).labels("colour")
