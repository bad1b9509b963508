"""Where a Vision Transformer looks: attention rollout maps drawn over the input images.

Dosovitskiy et al. 2021 (Appendix D.8, Figure 6) show, for each input, the attention rollout
(Abnar & Zuidema 2020) of the output token over the image: the share of what the head reads
that comes from each patch. `rollout_maps` draws a row of images, then one row per map (e.g.
one per pooling): each map scaled to its own maximum and drawn patch by patch, with the
outline of the image's strokes over it. The maps come from
`qkv.analysis.inspection.vit_rollout_map`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch

from qkv.analysis.plots.common import Figure, check_labels, new_figure, to_numpy

__all__ = ["rollout_maps"]


def rollout_maps(
    images: torch.Tensor,
    maps: torch.Tensor | Mapping[str, torch.Tensor],
    *,
    titles: Sequence[str] | None = None,
    title: str = "Attention rollout",
    cmap: str = "magma",
    outline: float = 0.5,
) -> Figure:
    """Images in the first row, each map of `maps` laid over them in the rows below.

    images: (B, H, W) or (B, 1, H, W) grey images (drawn black on white). maps: (B, h, w)
    patch maps with H and W multiples of h and w, or {row label: (B, h, w)} for several rows.
    titles: one per image (e.g. "3 -> 3", label and prediction). outline: the pixel value
    whose contour marks the strokes on the maps. Returns a figure of (1 + rows) x B image
    axes; each map's image array is the map divided by its maximum.
    """
    pixels = _grey_images(images)  # (B, H, W)
    rows = dict(maps) if isinstance(maps, Mapping) else {"rollout": maps}
    if not rows:
        raise ValueError("maps: expected at least one map, got an empty mapping")
    rows = {label: _patch_maps(label, value, pixels.shape) for label, value in rows.items()}
    labels = check_labels("titles", titles, len(pixels))
    B, H, W = pixels.shape
    fig = new_figure(figsize=(1.3 * B + 0.8, 1.45 * (1 + len(rows)) + 0.4))
    axes = fig.subplots(1 + len(rows), B, squeeze=False)
    extent = (-0.5, W - 0.5, H - 0.5, -0.5)  # the map's cells cover whole patches
    for column in range(B):
        top = axes[0, column]
        top.imshow(pixels[column], cmap="gray_r", vmin=0.0, vmax=1.0)
        if labels is not None:
            top.set_title(labels[column], fontsize=9)
        for row, (label, patch_maps) in enumerate(rows.items(), start=1):
            ax = axes[row, column]
            scaled = patch_maps[column] / max(float(patch_maps[column].max()), 1e-12)
            ax.imshow(scaled, cmap=cmap, vmin=0.0, vmax=1.0, extent=extent,
                      interpolation="nearest")  # fmt: skip
            if pixels[column].min() < outline < pixels[column].max():
                ax.contour(pixels[column], levels=[outline], colors="cyan", linewidths=1.2)
            if column == 0:
                ax.set_ylabel(label, fontsize=9)
    for ax in axes.ravel():
        ax.set_xticks([])
        ax.set_yticks([])
    axes[0, 0].set_ylabel("input", fontsize=9)
    fig.suptitle(title)
    return fig


def _grey_images(images: object) -> np.ndarray:
    pixels = to_numpy("images", images)
    if pixels.ndim == 4 and pixels.shape[1] == 1:
        pixels = pixels[:, 0]
    if pixels.ndim != 3 or pixels.shape[0] == 0:
        raise ValueError(
            f"images: expected (B, H, W) or (B, 1, H, W) grey images, got shape {pixels.shape}"
        )
    return pixels


def _patch_maps(label: str, value: object, image_shape: tuple[int, ...]) -> np.ndarray:
    patch_maps = to_numpy(f"maps[{label!r}]", value)
    B, H, W = image_shape
    if (
        patch_maps.ndim != 3
        or patch_maps.shape[0] != B
        or 0 in patch_maps.shape[1:]
        or H % patch_maps.shape[1]
        or W % patch_maps.shape[2]
    ):
        raise ValueError(
            f"maps[{label!r}]: expected ({B}, h, w) with h dividing {H} and w dividing {W}, got "
            f"shape {patch_maps.shape}"
        )
    return patch_maps
