"""The classic figures of attention, as matplotlib figures (matplotlib is optional:
`pip install matplotlib`).

Every function returns a `matplotlib.figure.Figure` built without pyplot, so nothing is shown,
no backend is chosen and no global state is touched; write it with `save_figure`:

    from qkv.analysis import plots
    fig = plots.softmax_saturation()
    plots.save_figure(fig, "saturation.svg")

- Attention weights: `attention_heatmaps` (per head, side by side; Clark et al. 2019),
  `bidirectional_vs_causal` (BERT's vs GPT's attention), `mask_gallery` (padding, causal and
  structured masks), `input_dependent_weights` (one head's weights on two inputs beside a fully
  connected layer's fixed position mixing; Vaswani et al. 2017, Tolstikhin et al. 2021).
- Why sqrt(d_k) (Vaswani et al. 2017, s3.2.1): `softmax_scaling`, `softmax_saturation`
  ([a, a, 2a]), `scaling_comparison` (d_k vs sqrt(d_k) vs none).
- Positions: `rope_vs_sinusoidal_decay` (Su et al. 2021), `alibi_biases` (Press et al. 2022),
  `permutation_equivariance` (without positions, permuting the input permutes the output).
- Activations: `gelu_vs_relu` (Hendrycks & Gimpel 2016).
- Vision: `rollout_maps`, attention rollout over the input images (Abnar & Zuidema 2020).
"""

from __future__ import annotations

from pathlib import Path

from qkv.analysis.plots.activations import gelu_vs_relu
from qkv.analysis.plots.attention import attention_heatmaps, bidirectional_vs_causal, mask_gallery
from qkv.analysis.plots.common import Figure
from qkv.analysis.plots.dynamic_weights import input_dependent_weights
from qkv.analysis.plots.equivariance import equivariance_gaps, permutation_equivariance
from qkv.analysis.plots.positional import alibi_biases, rope_vs_sinusoidal_decay
from qkv.analysis.plots.softmax import scaling_comparison, softmax_saturation, softmax_scaling
from qkv.analysis.plots.vision import rollout_maps

__all__ = [
    "FORMATS",
    "alibi_biases",
    "attention_heatmaps",
    "bidirectional_vs_causal",
    "equivariance_gaps",
    "gelu_vs_relu",
    "input_dependent_weights",
    "mask_gallery",
    "permutation_equivariance",
    "rollout_maps",
    "rope_vs_sinusoidal_decay",
    "save_figure",
    "scaling_comparison",
    "softmax_saturation",
    "softmax_scaling",
]

FORMATS = (".png", ".svg")


def save_figure(fig: Figure, path: str | Path, *, dpi: int = 150) -> Path:
    """Write `fig` as PNG or SVG, chosen by the suffix of `path`; returns the path written.

    The parent folder is created if needed. Any other suffix raises ValueError (a typo such as
    ".pgn" should not silently produce some other format).
    """
    if not isinstance(fig, Figure):
        raise TypeError(f"fig: expected a matplotlib Figure, got {type(fig).__name__}")
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in FORMATS:
        raise ValueError(
            f"path: expected a file name ending in one of {FORMATS}, got {str(path)!r}"
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format=suffix[1:], dpi=dpi)
    return path
