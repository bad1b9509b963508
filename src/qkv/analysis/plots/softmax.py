"""Why attention divides by sqrt(d_k) (Vaswani et al. 2017, s3.2.1 and its footnote 4): the
classic softmax figures.

- `softmax_scaling`: the effect of scaling on the softmax output distribution.
- `softmax_saturation`: the classic figure of softmax saturation (the largest element of
  softmax([a, a, 2a]) saturates to 1) and two entries of the softmax Jacobian (on and off its
  diagonal, `qkv.analysis.softmax_math.softmax_jacobian`), which both vanish.
- `scaling_comparison`: scaling by d_k vs sqrt(d_k) vs not at all.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from qkv.analysis.plots.common import (
    Figure,
    MaxNLocator,
    check_int,
    check_int_sequence,
    new_figure,
    to_numpy,
)
from qkv.analysis.softmax_math import softmax_jacobian
from qkv.attention import attention

__all__ = ["scaling_comparison", "softmax_saturation", "softmax_scaling"]


def softmax_scaling(
    *, d_k_values: Sequence[int] = (64, 256), seq_len: int = 20, seed: int = 0
) -> Figure:
    """Softmax of unscaled vs scaled scores, one row per d_k: the softmax output becomes
    harder (closer to one-hot) as the variance of the scores grows, and scaling brings it back
    to a softer distribution.

    The unscaled scores of row r are z_r * sqrt(d_k), which have the variance
    d_k of a dot product of unit-variance q and k, and the scaled scores are those divided by
    sqrt(d_k), i.e. z_r. Here z = torch.randn(len(d_k_values), seq_len, dtype=float64) drawn
    from `torch.Generator().manual_seed(seed)`. Returns a figure with a (len(d_k_values), 2)
    grid of bar axes: column 0 softmax(unscaled), column 1 softmax(scaled); each title gives
    d_k and the sample variance of its scores.
    """
    d_k_values = check_int_sequence("d_k_values", d_k_values, minimum=1)
    check_int("seq_len", seq_len, minimum=1)
    generator = torch.Generator().manual_seed(seed)
    standard = torch.randn(len(d_k_values), seq_len, generator=generator, dtype=torch.float64)
    fig = new_figure(figsize=(12.0, 3.2 * len(d_k_values)))
    axes = fig.subplots(len(d_k_values), 2, squeeze=False)  # (rows, 2)
    for row, d_k in enumerate(d_k_values):
        unscaled = standard[row] * math.sqrt(d_k)  # (seq_len,): variance d_k, like q . k
        panels = (
            ("unscaled", unscaled, "tab:red"),
            ("scaled", unscaled / math.sqrt(d_k), "tab:blue"),
        )
        for ax, (name, scores, color) in zip(axes[row], panels, strict=True):
            ax.bar(range(seq_len), torch.softmax(scores, dim=0).numpy(), color=color)
            variance = float(scores.var()) if seq_len > 1 else 0.0
            ax.set_title(f"d_k = {d_k}: softmax of {name} scores (variance {variance:.1f})")
            ax.set_xlabel("token position")
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.set_ylabel("attention weight")
            ax.set_ylim(0.0, 1.0)
    fig.suptitle("Effect of scaling on softmax")
    return fig


def softmax_saturation(
    a_values: Sequence[float] | np.ndarray | torch.Tensor | None = None,
) -> Figure:
    """softmax([a, a, 2a]) for the largest element, and its gradient, as a grows: the output
    for the largest element quickly saturates to 1 as the magnitude a increases.

    a_values: a 1-D array of magnitudes; default `np.linspace(0, 15, 100)`.
    Returns a figure with one axes and three lines: "softmax(2a)", y_3 = e^{2a} / (2 e^a +
    e^{2a}); "dy_3/dx_3 = y_3 (1 - y_3)", a diagonal entry of the softmax Jacobian
    diag(y) - y y^T; and "dy_3/dx_1 = -y_3 y_1", an off-diagonal one. Both fall to 0 as
    y_3 -> 1 (Vaswani et al. 2017, s3.2.1).
    """
    a = np.linspace(0.0, 15.0, 100) if a_values is None else to_numpy("a_values", a_values)
    if a.ndim != 1 or a.size == 0 or not np.isfinite(a).all():
        raise ValueError(
            f"a_values: expected a non-empty 1-D array of finite numbers, got shape {a.shape}"
        )
    magnitudes = torch.from_numpy(a)  # (N,) float64
    logits = torch.stack((magnitudes, magnitudes, 2 * magnitudes), dim=-1)  # (N, 3)
    probabilities = torch.softmax(logits, dim=-1)  # (N, 3)
    largest = probabilities[:, 2]  # (N,)
    jacobian = softmax_jacobian(probabilities)  # (N, 3, 3)
    fig = new_figure(figsize=(8.0, 5.0))
    ax = fig.subplots()
    ax.plot(a, largest.numpy(), label="softmax(2a)")
    ax.plot(a, jacobian[:, 2, 2].numpy(), linestyle="--", label="dy_3/dx_3 = y_3 (1 - y_3)")
    ax.plot(a, jacobian[:, 2, 0].numpy(), linestyle=":", label="dy_3/dx_1 = -y_3 y_1")
    ax.set_title("Softmax saturation with increasing input magnitude")
    ax.set_xlabel("input magnitude (a)")
    ax.set_ylabel("softmax output and Jacobian entries")
    ax.grid(True)
    ax.legend()
    return fig


_SCALINGS = (
    ("none", lambda d_k: 1.0),
    ("1/sqrt(d_k)", lambda d_k: 1.0 / math.sqrt(d_k)),
    ("1/d_k", lambda d_k: 1.0 / d_k),
)
# The predicted standard deviation of the scores, q . k having variance d_k.
_PREDICTED_STD = {"none": math.sqrt, "1/sqrt(d_k)": lambda d_k: 1.0, "1/d_k": lambda d_k: d_k**-0.5}


def scaling_comparison(
    *,
    d_k_values: Sequence[int] = (1, 4, 16, 64, 256),
    seq_len: int = 16,
    num_queries: int = 256,
    seed: int = 0,
) -> Figure:
    """Scores scaled by 1 vs 1/sqrt(d_k) vs 1/d_k, as d_k grows: scaling by 1/d_k shrinks the
    scores until the softmax is nearly uniform; no scaling gives std sqrt(d_k) (8 at d_k = 64)
    and a softmax saturated to nearly one-hot; 1/sqrt(d_k) keeps std ~ 1, the sweet spot.

    For each d_k in order, q (num_queries, d_k) then k (seq_len, d_k) are drawn with unit
    variance (torch.randn, float64, from `torch.Generator().manual_seed(seed)`), and the weights
    come from `qkv.attention(q, k, v, scale=..., return_weights=True)`. Returns a figure with
    two axes. Axes 0 (log-log): the standard deviation of the scaled scores q . k * scale
    against d_k, one line per scaling labelled "none", "1/sqrt(d_k)", "1/d_k", and dashed lines
    "<name> (predicted)": sqrt(d_k), 1, 1/sqrt(d_k). Axes 1: the mean entropy (nats) of the
    softmax rows, same labels, and a dotted line "uniform: log(seq_len)".
    """
    d_k_values = check_int_sequence("d_k_values", d_k_values, minimum=1)
    check_int("seq_len", seq_len, minimum=1)
    check_int("num_queries", num_queries, minimum=2)
    generator = torch.Generator().manual_seed(seed)
    stds = {name: [] for name, _ in _SCALINGS}
    entropies = {name: [] for name, _ in _SCALINGS}
    for d_k in d_k_values:
        q = torch.randn(1, 1, num_queries, d_k, generator=generator, dtype=torch.float64)
        k = torch.randn(1, 1, seq_len, d_k, generator=generator, dtype=torch.float64)
        dot_products = q[0, 0] @ k[0, 0].T  # (num_queries, seq_len)
        for name, scale_of in _SCALINGS:
            scale = scale_of(d_k)
            _, weights = attention(q, k, k, scale=scale, return_weights=True)  # (1, 1, Q, S)
            row_entropy = -torch.special.xlogy(weights, weights).sum(dim=-1)  # (1, 1, Q)
            stds[name].append(float((dot_products * scale).std()))
            entropies[name].append(float(row_entropy.mean()))
    return _draw_scaling_comparison(d_k_values, seq_len, stds, entropies)


def _draw_scaling_comparison(
    d_k_values: tuple[int, ...],
    seq_len: int,
    stds: dict[str, list[float]],
    entropies: dict[str, list[float]],
) -> Figure:
    fig = new_figure(figsize=(12.0, 4.8))
    std_ax, entropy_ax = fig.subplots(1, 2)
    for index, (name, _) in enumerate(_SCALINGS):
        color = f"C{index}"
        predicted = [_PREDICTED_STD[name](d_k) for d_k in d_k_values]
        std_ax.plot(d_k_values, stds[name], marker="o", color=color, label=name)
        std_ax.plot(d_k_values, predicted, linestyle="--", color=color, label=f"{name} (predicted)")
        entropy_ax.plot(d_k_values, entropies[name], marker="o", color=color, label=name)
    uniform = [math.log(seq_len)] * len(d_k_values)
    entropy_ax.plot(d_k_values, uniform, linestyle=":", color="gray", label="uniform: log(seq_len)")
    std_ax.set(xscale="log", yscale="log", xlabel="d_k", ylabel="std of the scaled scores")
    std_ax.set_title("Score spread by scaling")
    entropy_ax.set(xscale="log", xlabel="d_k", ylabel="entropy of softmax rows (nats)")
    entropy_ax.set_title(f"Softmax entropy ({seq_len} keys)")
    for ax in (std_ax, entropy_ax):
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("Scaling by d_k vs sqrt(d_k) vs none")
    return fig
