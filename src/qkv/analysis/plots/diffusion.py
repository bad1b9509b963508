"""What a text-conditioned diffusion model draws, and where its prompt's words look.

- `tile_images` lays small grey images out in a grid with a gap between them, and
  `sample_grid` draws that grid as one figure (what `qkv sample` writes).
- `guidance_figure`: the samples of each prompt at each classifier-free guidance scale, side
  by side (Ho & Salimans 2022, Figure 1's trade-off between fidelity and variety), and below,
  for one prompt, the image as it forms through the sampling steps with the cross-attention of
  one prompt token over the image patches at each of those steps, in one or more rows (the
  mean over blocks and heads, one head; Hertz et al. 2022's per-word cross-attention maps).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch

from qkv.analysis.plots.common import Figure, check_int, new_figure, to_numpy

__all__ = ["guidance_figure", "sample_grid", "tile_images"]


def tile_images(images: torch.Tensor, *, columns: int, gap: int = 1) -> np.ndarray:
    """(B, H, W) or (B, 1, H, W) images in [0, 1] -> one (rows * (H + gap) - gap,
    columns * (W + gap) - gap) array, row-major, the gaps and empty cells 0 (the background)."""
    pixels = _grey(images)
    check_int("columns", columns, minimum=1)
    check_int("gap", gap, minimum=0)
    B, H, W = pixels.shape
    rows = max(1, -(-B // columns))
    grid = np.zeros((rows * (H + gap) - gap, columns * (W + gap) - gap))
    for index in range(B):
        row, column = divmod(index, columns)
        top, left = row * (H + gap), column * (W + gap)
        grid[top : top + H, left : left + W] = pixels[index]
    return grid


def sample_grid(images: torch.Tensor, *, columns: int, title: str | None = None) -> Figure:
    """The images tiled `columns` wide in one axes, dark strokes on white, no ticks."""
    grid = tile_images(images, columns=columns)
    height, width = grid.shape
    scale = 0.06
    fig = new_figure(figsize=(max(2.0, width * scale + 0.4), max(2.0, height * scale + 0.6)))
    ax = fig.subplots()
    ax.imshow(grid, cmap="gray_r", vmin=0.0, vmax=1.0, interpolation="nearest")
    ax.set_axis_off()
    if title:
        ax.set_title(title, fontsize=9)
    return fig


def guidance_figure(
    grids: Mapping[str, torch.Tensor],
    *,
    columns: int,
    steps: Sequence[int],
    trajectory: torch.Tensor,
    maps: Mapping[str, torch.Tensor],
    token: str,
    prompt: str,
    title: str = "Classifier-free guidance",
) -> Figure:
    """Top: one tiled grid per guidance scale ({"s = 3": (B, H, W) images}); bottom: for
    `prompt`, the model's estimate of the clean image (K, H, W) at each of the K sampling
    `steps`, then one row per entry of `maps` ({row label: (K, h, w)}): the cross-attention
    weight of `token` over the patches at those steps (e.g. the mean over blocks and heads, and
    one head), each row on its own colour scale from the least to the largest of its K maps."""
    if not grids:
        raise ValueError("grids: expected at least one guidance scale, got none")
    if not maps:
        raise ValueError("maps: expected at least one row of attention maps, got none")
    images = _grey(trajectory)
    rows = {label: to_numpy("maps", row) for label, row in maps.items()}
    for label, row in rows.items():
        if row.ndim != 3 or len(row) != len(images) or len(steps) != len(images):
            raise ValueError(
                f"maps[{label!r}], steps: expected {len(images)} maps (K, h, w) and steps, one "
                f"per image of trajectory; got maps of shape {row.shape} and {len(steps)} steps"
            )
    fig = new_figure(figsize=(max(2.4 * len(grids), 1.25 * len(images) + 1.0),
                              6.0 + 1.3 * len(rows)))  # fmt: skip
    top, bottom = fig.subfigures(2, 1, height_ratios=(1.25, 0.5 * (1 + len(rows))))
    top.suptitle(title, fontsize=11)
    for ax, (label, samples) in zip(top.subplots(1, len(grids), squeeze=False)[0],
                                    grids.items(), strict=True):  # fmt: skip
        ax.imshow(tile_images(samples, columns=columns), cmap="gray_r", vmin=0.0, vmax=1.0,
                  interpolation="nearest")  # fmt: skip
        ax.set_title(label, fontsize=10)
        ax.set_axis_off()
    bottom.suptitle(f"{prompt!r}: the clean-image estimate and the attention of {token!r} "
                    f"over the patches, step by step", fontsize=10)  # fmt: skip
    axes = bottom.subplots(1 + len(rows), len(images), squeeze=False)
    for column, step in enumerate(steps):
        pixels = axes[0, column].imshow(images[column], cmap="gray_r", vmin=0.0, vmax=1.0,
                                        interpolation="nearest")  # fmt: skip
        axes[0, column].set_title(f"t = {step}", fontsize=9)
    bottom.colorbar(pixels, ax=axes[0, :].tolist(), shrink=0.9, label="pixel")  # rows align
    axes[0, 0].set_ylabel("x0 estimate", fontsize=9)
    for index, (label, row) in enumerate(rows.items(), start=1):
        _attention_row(bottom, axes[index], row, images, label)
    for ax in axes.flat:
        ax.set_xticks([])
        ax.set_yticks([])
    return fig


def _attention_row(fig, axes, maps: np.ndarray, images: np.ndarray, label: str) -> None:
    """One row of (K, h, w) patch maps over the K images' grid, the 0.5 contour of each image
    drawn on its map, one colour scale and colorbar for the row."""
    H, W = images.shape[1:]
    extent = (-0.5, W - 0.5, H - 0.5, -0.5)  # each map cell covers a whole patch
    low, high = float(maps.min()), float(maps.max())
    high = max(high, low + 1e-12)
    for ax, patch_map, image in zip(axes, maps, images, strict=True):
        shown = ax.imshow(patch_map, cmap="magma", vmin=low, vmax=high, extent=extent,
                          interpolation="nearest")  # fmt: skip
        ax.contour(image, levels=[0.5], colors="cyan", linewidths=0.8)
    fig.colorbar(shown, ax=list(axes), shrink=0.9, label="weight")
    axes[0].set_ylabel(label, fontsize=8)


def _grey(images: object) -> np.ndarray:
    """(B, H, W) or (B, 1, H, W) -> a float64 (B, H, W) array."""
    pixels = to_numpy("images", images)
    if pixels.ndim == 4 and pixels.shape[1] == 1:
        pixels = pixels[:, 0]
    if pixels.ndim != 3:
        raise ValueError(f"images: expected shape (B, H, W) or (B, 1, H, W), got {pixels.shape}")
    return pixels
