"""Without positions, self-attention cannot tell orders apart: permuting the input permutes the
output (Vaswani et al. 2017, s3.5: "since our model contains no recurrence and no convolution
... we must inject some information about the relative or absolute position of the tokens").
"""

from __future__ import annotations

import torch

from qkv.analysis.plots.common import Figure, check_int, draw_heatmap, new_figure, to_numpy
from qkv.layers import EncoderBlock
from qkv.positional import sinusoidal_table

__all__ = ["equivariance_gaps", "permutation_equivariance"]


def equivariance_gaps(
    *, seq_len: int = 12, embed_dim: int = 16, num_heads: int = 2, seed: int = 0
) -> dict[str, torch.Tensor]:
    """Two post-norm encoder blocks f (float64, seeded) on x (seq_len, embed_dim) and on the
    reversed-then-rotated order P x: {"outputs": f(x), "permuted_outputs": f(P x),
    "permutation": P as indices, "gap_without_positions": |f(P x) - P f(x)| per token,
    "gap_with_sinusoidal": the same with sinusoidal positions added to the input}."""
    check_int("seq_len", seq_len, minimum=2)
    generator = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    encoder = torch.nn.Sequential(
        *(EncoderBlock(embed_dim, num_heads, 2 * embed_dim) for _ in range(2))
    ).double().eval()  # fmt: skip
    x = torch.randn(1, seq_len, embed_dim, generator=generator, dtype=torch.float64)
    permutation = torch.arange(seq_len).flip(0).roll(seq_len // 3)  # a fixed reordering
    positions = sinusoidal_table(seq_len, embed_dim, dtype=torch.float64)[None]  # (1, L, E)
    with torch.no_grad():
        outputs = encoder(x)[0]  # (L, E)
        permuted_outputs = encoder(x[:, permutation])[0]  # f(P x)
        with_positions = encoder(x + positions)[0]
        permuted_with_positions = encoder(x[:, permutation] + positions)[0]
    return {
        "outputs": outputs,
        "permuted_outputs": permuted_outputs,
        "permutation": permutation,
        "gap_without_positions": (permuted_outputs - outputs[permutation]).abs().amax(dim=-1),
        "gap_with_sinusoidal": (permuted_with_positions - with_positions[permutation])
        .abs()
        .amax(dim=-1),
    }


def permutation_equivariance(
    *, seq_len: int = 12, embed_dim: int = 16, num_heads: int = 2, seed: int = 0
) -> Figure:
    """f(x), f(P x) row by row, and per token the largest |f(P x) - P f(x)|: zero (to float64
    rounding) without positions, far from zero once sinusoidal positions are added (the data:
    `equivariance_gaps`)."""
    gaps = equivariance_gaps(seq_len=seq_len, embed_dim=embed_dim, num_heads=num_heads, seed=seed)
    fig = new_figure(figsize=(14.0, 4.2))
    original_ax, permuted_ax, gap_ax = fig.subplots(1, 3)
    limit = float(gaps["outputs"].abs().max())
    for ax, values, title in (
        (original_ax, gaps["outputs"], "f(x): one row per token"),
        (permuted_ax, gaps["permuted_outputs"], "f(P x): the same rows, permuted"),
    ):
        draw_heatmap(ax, to_numpy(title, values), title=title, cmap="RdBu_r", vmin=-limit,
                     vmax=limit)  # fmt: skip
        ax.set(xlabel="feature", ylabel="token")
    tokens = range(seq_len)
    gap_ax.semilogy(tokens, to_numpy("gap", gaps["gap_with_sinusoidal"]), "o-",
                    label="with sinusoidal positions")  # fmt: skip
    floor = gaps["gap_without_positions"].clamp(min=1e-18)  # exact zeros drawn at the floor
    gap_ax.semilogy(tokens, to_numpy("gap", floor), "s-", label="without positions")
    gap_ax.set(xlabel="token", ylabel="max |f(P x) - P f(x)|")
    gap_ax.set_title("Equivariance gap per token")
    gap_ax.legend()
    gap_ax.grid(True, alpha=0.3)
    fig.suptitle("Self-attention without positions is permutation-equivariant")
    return fig
