"""Attention's weights are computed from the input; a fully connected layer's are not.

A layer that mixes the L positions of a sequence with a fully connected map (a token-mixing MLP,
as in MLP-Mixer, Tolstikhin et al. 2021) multiplies every input by the same learned (L, L)
matrix. Attention mixes them with softmax(q k^T / sqrt(d)), a matrix computed from each input
itself (Vaswani et al. 2017, s3.2; Bahdanau et al. 2015's "soft search"): the same head weighs
two sentences' positions differently, and the same positions differently in two sentences.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from qkv.analysis.plots.common import Figure, check_labels, draw_heatmap, new_figure, to_numpy

__all__ = ["input_dependent_weights"]


def input_dependent_weights(
    attention_maps: Sequence[torch.Tensor],
    mixing: torch.Tensor,
    *,
    tokens: Sequence[Sequence[str]] | None = None,
    title: str = "Attention weights follow the input; a fully connected layer's do not",
) -> Figure:
    """One row per input: the attention weights of one head on that input (left), and the
    position-mixing weights of a fully connected layer (right), which are the same in every row.

    attention_maps: one (L, L) map per input, every row a distribution (e.g. a recorded
    `AttentionMap`'s weights of one head); mixing: the (L, L) weight of the fully connected
    layer that mixes the positions (rows: outputs, columns: inputs); tokens: the labels of
    each input's positions. Each image's array is the matrix drawn, so the figure can be
    checked: the left column's arrays differ from input to input, the right column's do not.
    The panel titles give each left map's largest absolute difference from the first input's.
    """
    maps = [to_numpy("attention_maps", weights) for weights in attention_maps]
    if len(maps) < 2:
        raise ValueError(f"attention_maps: expected maps of at least 2 inputs, got {len(maps)}")
    L = maps[0].shape[-1]
    for index, weights in enumerate(maps):
        if weights.shape != (L, L):
            raise ValueError(f"attention_maps: expected each map (L, L) = ({L}, {L}), got "
                             f"{weights.shape} for input {index}")  # fmt: skip
    fixed = to_numpy("mixing", mixing)
    if fixed.shape != (L, L):
        raise ValueError(f"mixing: expected ({L}, {L}) like the maps, got {fixed.shape}")
    labels = [None] * len(maps) if tokens is None else [
        check_labels(f"tokens[{index}]", words, L) for index, words in enumerate(tokens)
    ]  # fmt: skip
    if len(labels) != len(maps):
        raise ValueError(f"tokens: expected one list per map ({len(maps)}), got {len(labels)}")
    fig = new_figure(figsize=(8.4, 3.6 * len(maps) + 0.6))
    axes = fig.subplots(len(maps), 2, squeeze=False)  # (inputs, 2)
    limit = float(np.abs(fixed).max())
    for row, (weights, words) in enumerate(zip(maps, labels, strict=True)):
        change = float(np.abs(weights - maps[0]).max())
        name = f"attention, input {row + 1}"
        name += f" (max change from input 1: {change:.2f})" if row else ""
        draw_heatmap(axes[row, 0], weights, title=name, query_labels=words, key_labels=words,
                     annotate=False, cmap="Blues", vmin=0.0, vmax=1.0)  # fmt: skip
        draw_heatmap(axes[row, 1], fixed, title=f"fully connected, input {row + 1} (the same)",
                     query_labels=words, key_labels=words, annotate=False, cmap="RdBu",
                     vmin=-limit, vmax=limit)  # fmt: skip
        axes[row, 1].set_xlabel("input position")
        axes[row, 1].set_ylabel("output position")
    fig.suptitle(title)
    return fig
