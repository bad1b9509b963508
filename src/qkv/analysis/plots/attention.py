"""Attention weights and masks as heat maps: per head, bidirectional vs causal, and the mask
types. Every figure shows keys along x and queries along y, one row per query's distribution.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from qkv import masks
from qkv.analysis.plots.common import (
    Figure,
    check_int,
    check_labels,
    draw_heatmap,
    grid_shape,
    new_figure,
    to_numpy,
)
from qkv.attention import attention

__all__ = ["attention_heatmaps", "bidirectional_vs_causal", "mask_gallery"]


def attention_heatmaps(
    weights: torch.Tensor,
    *,
    tokens: Sequence[str] | None = None,
    query_tokens: Sequence[str] | None = None,
    title: str = "Attention weights",
    annotate: bool = False,
    cmap: str = "Blues",
    max_columns: int = 4,
) -> Figure:
    """Per-head attention heat maps side by side: how each head attends to different parts of
    a sentence (Clark et al. 2019, what does BERT look at).

    weights: (L_q, L_k), (H, L_q, L_k) or (1, H, L_q, L_k), e.g. the weights of
    `qkv.attention(..., return_weights=True)`. tokens label the keys (and the queries too when
    L_q == L_k and query_tokens is None). Returns a figure with one image axes per head, titled
    "head h" (or `title` for a single matrix), drawn on a shared 0..1 colour scale, followed by
    one colorbar axes; each image's array is that head's (L_q, L_k) weights.
    """
    heads = _as_heads(to_numpy("weights", weights))  # (H, L_q, L_k)
    H, L_q, L_k = heads.shape
    key_labels = check_labels("tokens", tokens, L_k)
    query_labels = check_labels("query_tokens", query_tokens, L_q)
    if query_labels is None and L_q == L_k:
        query_labels = key_labels
    check_int("max_columns", max_columns, minimum=1)
    rows, columns = grid_shape(H, max_columns=max_columns)
    fig = new_figure(figsize=(3.2 * columns + 1.0, 3.0 * rows + 0.5))
    axes = fig.subplots(rows, columns, squeeze=False).ravel()
    for head, ax in enumerate(axes[:H]):
        image = draw_heatmap(
            ax,
            heads[head],
            title=f"head {head}" if H > 1 else title,
            query_labels=query_labels,
            key_labels=key_labels,
            annotate=annotate,
            cmap=cmap,
            vmin=0.0,
            vmax=1.0,
        )
    for ax in axes[H:]:
        fig.delaxes(ax)
    fig.colorbar(image, ax=list(axes[:H]), label="attention weight")
    if H > 1:
        fig.suptitle(title)
    return fig


def bidirectional_vs_causal(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    tokens: Sequence[str] | None = None,
    scale: float | None = None,
    annotate: bool = False,
) -> Figure:
    """Bidirectional vs causal attention weights of the same queries and keys: the key
    difference between BERT (bidirectional, Devlin et al. 2019) and GPT (causal).

    q: (L_q, D), (H, L_q, D) or (1, H, L_q, D); k likewise with L_k. The weights come from
    `qkv.attention(q, k, v, causal=..., scale=scale, return_weights=True)` (they do not depend
    on v). Returns a figure with 2 rows of H image axes (row 0 bidirectional in blue, row 1
    causal in orange) and one colorbar axes.
    """
    qh, kh = _as_batch_of_heads("q", q), _as_batch_of_heads("k", k)  # (1, H, L, D) each
    _, weights_bidirectional = attention(qh, kh, kh, scale=scale, return_weights=True)
    _, weights_causal = attention(qh, kh, kh, causal=True, scale=scale, return_weights=True)
    H, L_q, L_k = weights_causal.shape[1:]
    key_labels = check_labels("tokens", tokens, L_k)
    query_labels = key_labels if L_q == L_k else None
    fig = new_figure(figsize=(3.4 * H + 1.0, 6.4))
    axes = fig.subplots(2, H, squeeze=False)  # (2, H)
    panels = (
        ("Bidirectional attention", weights_bidirectional, "Blues"),
        ("Causal attention (masked)", weights_causal, "Oranges"),
    )
    for row, (name, weights, cmap) in enumerate(panels):
        for head in range(H):
            image = draw_heatmap(
                axes[row, head],
                to_numpy("weights", weights[0, head]),  # (L_q, L_k)
                title=f"{name}, head {head}" if H > 1 else name,
                query_labels=query_labels,
                key_labels=key_labels,
                annotate=annotate,
                cmap=cmap,
                vmin=0.0,
                vmax=1.0,
            )
    fig.colorbar(image, ax=list(axes.ravel()), label="attention weight")
    fig.suptitle("Attention weight heat maps")
    return fig


def mask_gallery(
    *, seq_len: int = 8, valid_length: int = 5, window: int | tuple[int, int] = (1, 1)
) -> Figure:
    """The mask types side by side: a padding mask, a causal mask and a structured mask that
    keeps each query to a local neighbourhood, plus padding combined with causal, the mask of a
    padded decoder batch.

    Built with `qkv.masks`: `padding(tensor([valid_length]), seq_len)` (keys at or beyond
    valid_length blocked), `causal(seq_len)`, `sliding_window(seq_len, seq_len, window)` (the
    structured mask; `(1, 1)` lets each query see its neighbours on both sides) and
    `combine(causal, padding)`. Returns a figure with 4 image axes, in that order, each image
    the (seq_len, seq_len) mask as 1.0 where a query MAY attend and 0.0 where it is blocked.
    """
    check_int("seq_len", seq_len, minimum=1)
    check_int("valid_length", valid_length, minimum=0)
    if valid_length > seq_len:
        raise ValueError(
            f"valid_length: expected at most seq_len={seq_len} real tokens, got {valid_length}"
        )
    padding = masks.padding(torch.tensor([valid_length]), seq_len)  # (1, 1, 1, seq_len)
    causal = masks.causal(seq_len)  # (seq_len, seq_len)
    panels = (
        (f"Padding (length {valid_length})", padding[0, 0].expand(seq_len, seq_len)),
        ("Causal", causal),
        (f"Structured: window {window}", masks.sliding_window(seq_len, seq_len, window)),
        ("Padding + causal", masks.combine(causal, padding)[0, 0]),  # (seq_len, seq_len)
    )
    fig = new_figure(figsize=(13.0, 3.8))
    axes = fig.subplots(1, len(panels))
    for ax, (name, mask) in zip(axes, panels, strict=True):
        draw_heatmap(ax, to_numpy("mask", mask), title=name, cmap="Greens", vmin=0.0, vmax=1.0)
    fig.suptitle("Attention masks (filled = may attend)")
    return fig


def _as_heads(weights: np.ndarray) -> np.ndarray:
    """(L_q, L_k), (H, L_q, L_k) or (1, H, L_q, L_k) -> (H, L_q, L_k)."""
    if weights.ndim == 4 and weights.shape[0] == 1:
        weights = weights[0]
    if weights.ndim == 2:
        weights = weights[None]
    if weights.ndim != 3 or 0 in weights.shape:
        raise ValueError(
            f"weights: expected shape (L_q, L_k), (H, L_q, L_k) or (1, H, L_q, L_k) with "
            f"non-zero sizes, got {tuple(weights.shape)}"
        )
    return weights


def _as_batch_of_heads(name: str, x: torch.Tensor) -> torch.Tensor:
    """(L, D), (H, L, D) or (1, H, L, D) -> a float (1, H, L, D) tensor for `qkv.attention`."""
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        got = f"dtype {x.dtype}" if isinstance(x, torch.Tensor) else type(x).__name__
        raise TypeError(f"{name}: expected a floating-point tensor, got {got}")
    if x.dim() == 4 and x.shape[0] == 1:
        return x
    if x.dim() in (2, 3):
        return x.reshape(1, -1, *x.shape[-2:])  # (1, H, L, D)
    raise ValueError(
        f"{name}: expected shape (L, D), (H, L, D) or (1, H, L, D), got {tuple(x.shape)}"
    )
