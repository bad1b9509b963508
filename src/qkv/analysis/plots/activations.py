"""The feed-forward activations, GELU vs ReLU, and their derivatives (Hendrycks & Gimpel 2016;
BERT's GELU, Devlin et al. 2019, is a smoother alternative to ReLU)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from qkv.analysis.plots.common import Figure, new_figure, to_numpy
from qkv.layers.feedforward import ACTIVATIONS

__all__ = ["gelu_vs_relu"]

# Label and `qkv.layers.feedforward.ACTIVATIONS` name of each curve, in drawing order.
_CURVES = (
    ("GELU", "gelu"),
    ("GELU (tanh approximation)", "gelu_tanh"),
    ("ReLU", "relu"),
)


def gelu_vs_relu(x: Sequence[float] | np.ndarray | torch.Tensor | None = None) -> Figure:
    """GELU(x) = x Phi(x) = x (1 + erf(x / sqrt 2)) / 2 against ReLU(x) = max(0, x), and their
    derivatives (Hendrycks & Gimpel 2016): ReLU's derivative jumps from 0 to 1 at x = 0 and is
    exactly 0 for every negative input; GELU's is smooth, and not 0 for small negative ones.

    x: a 1-D array of inputs; default `np.linspace(-4, 4, 401)`. The functions are the ones
    `qkv.layers.FeedForward` uses; derivatives come from autograd (ReLU's is 0 at x = 0, as
    in PyTorch). Returns a figure with two axes, "Activation" and "Derivative", each with the
    lines "GELU", "GELU (tanh approximation)" and "ReLU" over x.
    """
    inputs = np.linspace(-4.0, 4.0, 401) if x is None else to_numpy("x", x)
    if inputs.ndim != 1 or inputs.size == 0 or not np.isfinite(inputs).all():
        raise ValueError(
            f"x: expected a non-empty 1-D array of finite numbers, got shape {inputs.shape}"
        )
    fig = new_figure(figsize=(12.0, 4.6))
    value_ax, derivative_ax = fig.subplots(1, 2)
    for label, name in _CURVES:
        points = torch.tensor(inputs, dtype=torch.float64, requires_grad=True)  # (N,)
        values = ACTIVATIONS[name](points)  # (N,)
        (derivative,) = torch.autograd.grad(values.sum(), points)  # (N,): elementwise map
        style = ":" if name == "gelu_tanh" else "-"
        value_ax.plot(inputs, values.detach().numpy(), linestyle=style, label=label)
        derivative_ax.plot(inputs, derivative.numpy(), linestyle=style, label=label)
    value_ax.set(title="Activation", xlabel="x", ylabel="f(x)")
    derivative_ax.set(title="Derivative", xlabel="x", ylabel="f'(x)")
    for ax in (value_ax, derivative_ax):
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle("GELU vs ReLU")
    return fig
