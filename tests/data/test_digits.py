"""The digits: scikit-learn's own arrays as images, seeded stratified splits, pixel shifts
against slicing by hand, and a clear error where scikit-learn is missing."""

import sys

import numpy as np
import pytest
import torch
from sklearn.datasets import load_digits as sklearn_load_digits

from qkv.data import LabelledImages, digit_splits, load_digits, shift_images, split_digits
from qkv.data import digits as digits_module


@pytest.fixture(scope="module")
def data():
    return load_digits()


def test_images_are_scikit_learns_pixels_over_16(data):
    bunch = sklearn_load_digits()
    assert data.images.shape == (1797, 1, 8, 8) and data.images.dtype == torch.float32
    assert data.labels.dtype == torch.int64 and torch.equal(data.labels, torch.tensor(bunch.target))
    np.testing.assert_allclose(data.images.numpy()[:, 0], bunch.images / 16.0, rtol=0, atol=1e-7)
    assert float(data.images.min()) == 0.0 and float(data.images.max()) == 1.0


def test_split_is_disjoint_complete_stratified_and_seeded(data):
    splits = split_digits(data, valid_fraction=0.1, test_fraction=0.2, seed=3)
    sizes = [len(splits.train), len(splits.valid), len(splits.test)]
    assert sum(sizes) == 1797
    # every image appears once: compare the multiset of rows with the original's
    joined = torch.cat([splits.train.images, splits.valid.images, splits.test.images])
    key = lambda images: sorted(map(tuple, images.flatten(1).tolist()))  # noqa: E731
    assert key(joined) == key(data.images)
    counts = torch.bincount(data.labels)
    for split, fraction in ((splits.test, 0.2), (splits.valid, 0.1)):
        expected = torch.tensor([round(fraction * int(n)) for n in counts])
        assert torch.equal(torch.bincount(split.labels, minlength=10), expected)
    again = split_digits(data, valid_fraction=0.1, test_fraction=0.2, seed=3)
    assert torch.equal(again.test.images, splits.test.images)
    other = split_digits(data, valid_fraction=0.1, test_fraction=0.2, seed=4)
    assert not torch.equal(other.test.images, splits.test.images)
    random = split_digits(data, valid_fraction=0.1, test_fraction=0.2, seed=3, stratified=False)
    assert len(random.test) == round(0.2 * 1797)


def test_digit_splits_labels_follow_their_images(data):
    splits = digit_splits(seed=0)
    lookup = {tuple(image.flatten().tolist()): int(label)
              for image, label in zip(data.images, data.labels, strict=True)}  # fmt: skip
    for image, label in zip(splits.test.images[:50], splits.test.labels[:50], strict=True):
        assert lookup[tuple(image.flatten().tolist())] == int(label)


def test_shift_images_moves_each_image_by_its_drawn_offset():
    images = torch.rand(6, 2, 5, 7)
    shifted = shift_images(images, max_shift=2, generator=torch.Generator().manual_seed(0))
    offsets = torch.randint(0, 5, (6, 2), generator=torch.Generator().manual_seed(0))
    for b in range(6):
        dy, dx = 2 - int(offsets[b, 0]), 2 - int(offsets[b, 1])  # content moves down/right
        expected = torch.zeros(2, 5, 7)
        src_rows, dst_rows = _overlap(dy, 5)
        src_cols, dst_cols = _overlap(dx, 7)
        expected[:, dst_rows, dst_cols] = images[b][:, src_rows, src_cols]
        assert torch.equal(shifted[b], expected), (b, dy, dx)
    assert shift_images(images, max_shift=0) is images


def _overlap(shift, size):
    """Source and destination slices of a shift by `shift` along an axis of `size`."""
    if shift >= 0:
        return slice(0, size - shift), slice(shift, size)
    return slice(-shift, size), slice(0, size + shift)


def test_bad_arguments_name_the_argument(data):
    with pytest.raises(ValueError, match="valid_fraction"):
        split_digits(data, valid_fraction=0.0)
    with pytest.raises(ValueError, match="leave no training examples"):
        split_digits(data, valid_fraction=0.5, test_fraction=0.5)
    with pytest.raises(ValueError, match="images"):
        shift_images(torch.zeros(8, 8))
    with pytest.raises(ValueError, match="max_shift"):
        shift_images(torch.zeros(1, 1, 8, 8), max_shift=-1)
    with pytest.raises(ValueError, match=r"\(N, C, H, W\) and \(N,\)"):
        LabelledImages(torch.zeros(3, 1, 8, 8), torch.zeros(2, dtype=torch.long))


def test_missing_scikit_learn_says_how_to_install_it(monkeypatch):
    digits_module._digits_arrays.cache_clear()
    monkeypatch.setitem(sys.modules, "sklearn.datasets", None)  # import now fails
    try:
        with pytest.raises(ImportError, match=r"pip install 'qkv\[vision\]'"):
            load_digits()
    finally:
        digits_module._digits_arrays.cache_clear()
