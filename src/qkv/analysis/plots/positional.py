"""Position information, drawn: RoPE's decay with relative distance against sinusoidal encodings
(Su et al. 2021), and ALiBi's per-head linear biases (Press et al. 2022).
"""

from __future__ import annotations

import torch

from qkv import masks, positional
from qkv.analysis.plots.common import (
    Figure,
    check_int,
    draw_heatmap,
    grid_shape,
    new_figure,
    to_numpy,
)

__all__ = ["alibi_biases", "rope_vs_sinusoidal_decay"]


def rope_vs_sinusoidal_decay(
    *,
    head_dim: int = 128,
    max_distance: int = 256,
    num_positions: int = 32,
    base: float = 10000.0,
    seed: int = 0,
) -> Figure:
    """RoPE's long-term decay with relative distance, against sinusoidal encodings (Su et al.
    2021): RoPE makes attention decay smoothly with relative distance, while the similarity of
    sinusoidal encodings (Vaswani et al. 2017, s3.5) reflects absolute positions.

    Returns a figure with 5 axes:
    0. Against relative distance r = 0 .. max_distance, each divided by its value at r = 0:
       "RoPE bound", RoFormer's relative upper bound (1/(D/2)) sum_j |S_j| with
       S_j = sum_{i<j} e^{i r theta_i} (Su et al. 2021, section 3.4.3, eq. 37 and figure 2), and
       "sinusoidal PE[m] . PE[m+r]", the dot product of two encodings r apart (the same for
       every m: sum_i cos(r w_i)). Both decay; for constant q and k the RoPE score equals the
       latter, so the difference is not in this curve but in where position enters the score:
    1. "RoPE" heat map: (R_m q) . (R_n k) for random content q, k at every (m, n) of
       num_positions positions (rope_cos_sin + apply_rope, interleaved layout): constant along
       diagonals, a function of m - n only.
    2. "Sinusoidal" heat map: (q + PE[m]) . (k + PE[n]): the cross terms q . PE[n] and
       PE[m] . k depend on the absolute positions.
    3, 4. The colorbars of 1 and 2.
    q, k = torch.randn(head_dim, dtype=float64) twice from `torch.Generator().manual_seed(seed)`.
    """
    check_int("head_dim", head_dim, minimum=2)
    check_int("max_distance", max_distance, minimum=1)
    check_int("num_positions", num_positions, minimum=1)
    bound, sinusoidal = _decay_curves(head_dim, max_distance, base)
    rope_scores, sinusoidal_scores = _score_maps(head_dim, num_positions, base, seed)
    fig = new_figure(figsize=(15.0, 4.6))
    decay_ax, rope_ax, sinusoidal_ax = fig.subplots(1, 3)
    distances = range(max_distance + 1)
    decay_ax.plot(distances, to_numpy("bound", bound / bound[0]), label="RoPE bound")
    sinusoidal_curve = to_numpy("sinusoidal", sinusoidal / sinusoidal[0])
    decay_ax.plot(distances, sinusoidal_curve, label="sinusoidal PE[m] . PE[m+r]")
    decay_ax.set(xlabel="relative distance r", ylabel="relative to distance 0")
    decay_ax.set_title(f"Long-term decay (head_dim {head_dim})")
    decay_ax.grid(True, alpha=0.3)
    decay_ax.legend()
    maps = (
        (rope_ax, rope_scores, "RoPE: (R_m q) . (R_n k)"),
        (sinusoidal_ax, sinusoidal_scores, "Sinusoidal: (q + PE[m]) . (k + PE[n])"),
    )
    for ax, scores, title in maps:
        limit = float(scores.abs().max())
        image = draw_heatmap(
            ax, to_numpy("scores", scores), title=title, cmap="RdBu_r", vmin=-limit, vmax=limit
        )
        ax.set(xlabel="key position n", ylabel="query position m")
        fig.colorbar(image, ax=ax, label="score")
    fig.suptitle("RoPE vs sinusoidal positions")
    return fig


def alibi_biases(
    *, num_heads: int = 8, seq_len: int = 8, causal: bool = True, max_columns: int = 4
) -> Figure:
    """The ALiBi bias of every head (Press et al. 2022, section 3): each score becomes
    score_ij - m * |i - j|, a distance penalty with one slope m per head.

    From `qkv.positional.alibi_bias(num_heads, seq_len, seq_len)` and `alibi_slopes`. Returns
    a figure with num_heads image axes, one per head and titled with its slope m (each image
    the (seq_len, seq_len) bias, NaN where `causal` blocks the key so it is drawn blank, on a
    color scale shared by all heads), one colorbar axes, and a last axes "bias of the last
    query" with one line per head, -m * distance for distances 0 .. seq_len - 1.
    """
    check_int("num_heads", num_heads, minimum=1)
    check_int("seq_len", seq_len, minimum=1)
    check_int("max_columns", max_columns, minimum=1)
    bias = positional.alibi_bias(num_heads, seq_len, seq_len, dtype=torch.float64)[0]  # (H, L, L)
    if causal:
        bias = bias.masked_fill(~masks.causal(seq_len), float("nan"))
    slopes = positional.alibi_slopes(num_heads).tolist()
    rows, columns = grid_shape(num_heads, max_columns=max_columns)
    fig = new_figure(figsize=(3.0 * columns + 1.0, 2.8 * rows + 3.0))
    grid = fig.add_gridspec(rows + 1, columns)
    lowest = -max(slopes) * (seq_len - 1)  # the steepest head's farthest key
    heat_axes = []
    for head in range(num_heads):
        ax = fig.add_subplot(grid[head // columns, head % columns])
        title = f"head {head}: m = {slopes[head]:.4g}"
        image = draw_heatmap(
            ax, to_numpy("bias", bias[head]), title=title, cmap="viridis", vmin=lowest, vmax=0.0
        )
        heat_axes.append(ax)
    fig.colorbar(image, ax=heat_axes, label="bias added to the score")
    line_ax = fig.add_subplot(grid[rows, :])
    distances = torch.arange(seq_len, dtype=torch.float64)  # (L,)
    for head, slope in enumerate(slopes):
        line_ax.plot(
            to_numpy("distances", distances),
            to_numpy("bias", -slope * distances),
            marker="o",
            label=f"head {head}",
        )
    line_ax.set(xlabel="distance i - j", ylabel="bias", title="bias of the last query")
    line_ax.legend(fontsize=7, ncols=min(num_heads, 8))
    fig.suptitle(f"ALiBi biases, {num_heads} heads")
    return fig


def _decay_curves(head_dim: int, max_distance: int, base: float):
    """RoFormer's bound and PE[0] . PE[r], each (max_distance + 1,), from qkv's own angles."""
    distances = torch.arange(max_distance + 1)  # (R,)
    cos, sin = positional.rope_cos_sin(
        distances, head_dim, base=base, layout="interleaved", dtype=torch.float64
    )  # each (R, D): frequency i at columns 2i and 2i + 1
    partial_real = cos[:, 0::2].cumsum(dim=-1)  # (R, D/2): Re S_1 .. S_{D/2}
    partial_imag = sin[:, 0::2].cumsum(dim=-1)  # (R, D/2): Im S_1 .. S_{D/2}
    bound = torch.hypot(partial_real, partial_imag).mean(dim=-1)  # (R,)
    table = positional.sinusoidal_table(
        max_distance + 1, head_dim, base=base, dtype=torch.float64
    )  # (R, D)
    return bound, table @ table[0]  # (R,), (R,)


def _score_maps(head_dim: int, num_positions: int, base: float, seed: int):
    """(P, P) scores of one random content pair under RoPE and under added sinusoids."""
    generator = torch.Generator().manual_seed(seed)
    content_q = torch.randn(head_dim, generator=generator, dtype=torch.float64)  # (D,)
    content_k = torch.randn(head_dim, generator=generator, dtype=torch.float64)  # (D,)
    positions = torch.arange(num_positions)  # (P,)
    cos, sin = positional.rope_cos_sin(
        positions, head_dim, base=base, layout="interleaved", dtype=torch.float64
    )  # each (P, D)
    rotated = [
        positional.apply_rope(
            content.expand(1, 1, num_positions, head_dim), cos, sin, layout="interleaved"
        )[0, 0]  # (P, D)
        for content in (content_q, content_k)
    ]
    rope_scores = rotated[0] @ rotated[1].T  # (P, P)
    table = positional.sinusoidal_table(num_positions, head_dim, base=base, dtype=torch.float64)
    sinusoidal_scores = (content_q + table) @ (content_k + table).T  # (P, P)
    return rope_scores, sinusoidal_scores
