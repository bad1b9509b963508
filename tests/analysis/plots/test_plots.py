"""The classic figures (`qkv.analysis.plots`): each figure's axes, titles and the DATA inside
its artists, checked against numbers computed here independently (torch.softmax, numpy,
math.erf, complex exponentials, the ALiBi paper's own slope rule), not against qkv's own code."""

from __future__ import annotations

import math
import subprocess
import sys

import numpy as np
import pytest
import torch

pytest.importorskip("matplotlib")

from qkv.analysis import plots  # noqa: E402  (after the optional-dependency check)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def keep():
    """Register figures to be cleared after the test (frees their artists)."""
    figures = []
    yield figures.append
    for fig in figures:
        fig.clear()


def _images(fig):
    """The image arrays of the axes that hold one, in axes order (colorbars have none)."""
    return [ax.images[0].get_array() for ax in fig.axes if ax.images]


def _lines_by_label(ax):
    return {line.get_label(): line for line in ax.get_lines()}


def _numpy_softmax(scores: np.ndarray) -> np.ndarray:
    shifted = np.exp(scores - scores.max(axis=-1, keepdims=True))
    return shifted / shifted.sum(axis=-1, keepdims=True)


# ---------------------------------------------------------------------------------- heat maps


def test_attention_heatmaps_show_each_heads_softmax(keep):
    import qkv

    generator = torch.Generator().manual_seed(1)
    q = torch.randn(1, 3, 4, 8, generator=generator, dtype=torch.float64)
    k = torch.randn(1, 3, 4, 8, generator=generator, dtype=torch.float64)
    _, weights = qkv.attention(q, k, k, return_weights=True)  # (1, 3, 4, 4)
    tokens = ["The", "cat", "sat", "down"]
    fig = plots.attention_heatmaps(weights, tokens=tokens, annotate=True)
    keep(fig)

    expected = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(8), dim=-1)[0]  # (3, 4, 4)
    assert len(fig.axes) == 3 + 1  # one per head, then the colorbar
    assert [ax.get_title() for ax in fig.axes[:3]] == ["head 0", "head 1", "head 2"]
    images = _images(fig)
    assert len(images) == 3
    for head, image in enumerate(images):
        np.testing.assert_allclose(image, expected[head].numpy(), atol=1e-6)
    first = fig.axes[0]
    assert [t.get_text() for t in first.get_xticklabels()] == tokens
    assert [t.get_text() for t in first.get_yticklabels()] == tokens
    assert (first.get_xlabel(), first.get_ylabel()) == ("key", "query")
    assert len(first.texts) == 16  # one annotation per cell
    assert first.images[0].get_clim() == (0.0, 1.0)


def test_attention_heatmaps_single_matrix_and_bad_input(keep):
    weights = np.array([[0.25, 0.75], [1.0, 0.0], [0.5, 0.5]])  # (L_q=3, L_k=2)
    fig = plots.attention_heatmaps(weights, title="one head")
    keep(fig)
    assert len(fig.axes) == 2
    assert fig.axes[0].get_title() == "one head"
    np.testing.assert_array_equal(_images(fig)[0], weights)
    with pytest.raises(ValueError, match="weights"):
        plots.attention_heatmaps(np.ones((2, 2, 3, 3)))
    with pytest.raises(ValueError, match="tokens"):
        plots.attention_heatmaps(weights, tokens=["a", "b", "c"])


def test_bidirectional_vs_causal_against_masked_softmax(keep):
    generator = torch.Generator().manual_seed(2)
    q = torch.randn(2, 5, 8, generator=generator)  # (H, L, D)
    k = torch.randn(2, 5, 8, generator=generator)
    fig = plots.bidirectional_vs_causal(q, k, tokens=list("abcde"))
    keep(fig)

    scores = q @ k.transpose(-2, -1) / math.sqrt(8)  # (2, 5, 5)
    future = torch.ones(5, 5).tril() == 0  # torch's own causal pattern, True above the diagonal
    bidirectional = torch.softmax(scores, dim=-1)
    causal = torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1)
    assert len(fig.axes) == 2 * 2 + 1
    titles = [ax.get_title() for ax in fig.axes[:4]]
    assert titles == [
        "Bidirectional attention, head 0",
        "Bidirectional attention, head 1",
        "Causal attention (masked), head 0",
        "Causal attention (masked), head 1",
    ]
    images = _images(fig)
    expected = [bidirectional[0], bidirectional[1], causal[0], causal[1]]
    for image, matrix in zip(images, expected, strict=True):
        np.testing.assert_allclose(image, matrix.numpy(), atol=1e-6)
    assert np.all(images[2][future.numpy()] == 0.0)


def test_bidirectional_vs_causal_single_head_titles_its_two_panels(keep):
    q, k = torch.randn(4, 8), torch.randn(4, 8)
    fig = plots.bidirectional_vs_causal(q, k)
    keep(fig)
    assert len(fig.axes) == 3
    assert [ax.get_title() for ax in fig.axes[:2]] == [
        "Bidirectional attention",
        "Causal attention (masked)",
    ]
    with pytest.raises(TypeError, match="q"):
        plots.bidirectional_vs_causal(torch.ones(4, 8, dtype=torch.long), k)


# -------------------------------------------------------------------------------------- masks


def test_mask_gallery_matches_hand_built_masks(keep):
    seq_len, valid = 6, 4
    fig = plots.mask_gallery(seq_len=seq_len, valid_length=valid, window=(1, 1))
    keep(fig)

    padding = np.zeros((seq_len, seq_len))
    padding[:, :valid] = 1.0  # every query may see the real keys, none the padding
    causal = torch.ones(seq_len, seq_len).tril().numpy()
    neighbourhood = np.array(
        [[1.0 if abs(i - j) <= 1 else 0.0 for j in range(seq_len)] for i in range(seq_len)]
    )
    assert len(fig.axes) == 4
    titles = [ax.get_title() for ax in fig.axes]
    assert titles[0].startswith("Padding") and titles[1] == "Causal"
    assert titles[2].startswith("Structured") and titles[3] == "Padding + causal"
    for image, expected in zip(
        _images(fig), [padding, causal, neighbourhood, padding * causal], strict=True
    ):
        np.testing.assert_array_equal(image, expected)
    with pytest.raises(ValueError, match="valid_length"):
        plots.mask_gallery(seq_len=4, valid_length=5)


# ---------------------------------------------------------------------------- softmax scaling


def test_softmax_scaling_bars_are_softmax_of_the_drawn_scores(keep):
    d_k_values, seq_len, seed = (4, 64), 10, 3
    fig = plots.softmax_scaling(d_k_values=d_k_values, seq_len=seq_len, seed=seed)
    keep(fig)

    standard = torch.randn(
        len(d_k_values), seq_len, generator=torch.Generator().manual_seed(seed), dtype=torch.float64
    ).numpy()
    assert len(fig.axes) == 2 * len(d_k_values)
    for row, d_k in enumerate(d_k_values):
        unscaled_ax, scaled_ax = fig.axes[2 * row], fig.axes[2 * row + 1]
        unscaled = np.array([bar.get_height() for bar in unscaled_ax.patches])
        scaled = np.array([bar.get_height() for bar in scaled_ax.patches])
        np.testing.assert_allclose(unscaled, _numpy_softmax(standard[row] * math.sqrt(d_k)))
        np.testing.assert_allclose(scaled, _numpy_softmax(standard[row]))
        # The same scores times sqrt(d_k): softmax(sqrt(d_k) z) = softmax(z)^sqrt(d_k), renormed.
        powered = scaled ** math.sqrt(d_k)
        np.testing.assert_allclose(unscaled, powered / powered.sum(), rtol=1e-9)
        variance = np.var(standard[row] * math.sqrt(d_k), ddof=1)
        assert f"d_k = {d_k}" in unscaled_ax.get_title()
        assert f"variance {variance:.1f}" in unscaled_ax.get_title()
        assert scaled_ax.get_ylabel() == "attention weight"
    # Unscaled is sharper (the figure's point): its largest weight beats the scaled one.
    assert unscaled.max() > scaled.max()


def test_softmax_saturation_curve_and_jacobian(keep):
    a_values = np.array([0.0, 0.5, 1.0, 2.0, 5.0, 10.0, 15.0])
    fig = plots.softmax_saturation(a_values)
    keep(fig)

    assert len(fig.axes) == 1
    ax = fig.axes[0]
    assert ax.get_title() == "Softmax saturation with increasing input magnitude"
    lines = _lines_by_label(ax)
    largest = lines["softmax(2a)"]
    np.testing.assert_array_equal(largest.get_xdata(), a_values)
    largest_softmax = np.exp(2 * a_values) / (2 * np.exp(a_values) + np.exp(2 * a_values))
    np.testing.assert_allclose(largest.get_ydata(), largest_softmax, rtol=1e-12)
    jacobian_diagonal = [
        torch.autograd.functional.jacobian(
            lambda z: torch.softmax(z, dim=0), torch.tensor([a, a, 2 * a], dtype=torch.float64)
        )[2, 2].item()
        for a in a_values
    ]
    np.testing.assert_allclose(lines["dy_3/dx_3 = y_3 (1 - y_3)"].get_ydata(), jacobian_diagonal)
    assert largest.get_ydata()[0] == pytest.approx(1 / 3) and largest.get_ydata()[-1] > 0.999


def test_softmax_saturation_default_range_and_bad_input(keep):
    fig = plots.softmax_saturation()
    keep(fig)
    np.testing.assert_array_equal(fig.axes[0].get_lines()[0].get_xdata(), np.linspace(0, 15, 100))
    with pytest.raises(ValueError, match="a_values"):
        plots.softmax_saturation(np.ones((2, 2)))


def test_scaling_comparison_matches_a_direct_computation(keep):
    d_k_values, seq_len, num_queries, seed = (1, 16, 256), 8, 32, 5
    fig = plots.scaling_comparison(
        d_k_values=d_k_values, seq_len=seq_len, num_queries=num_queries, seed=seed
    )
    keep(fig)

    generator = torch.Generator().manual_seed(seed)
    expected_std = {"none": [], "1/sqrt(d_k)": [], "1/d_k": []}
    expected_entropy = {"none": [], "1/sqrt(d_k)": [], "1/d_k": []}
    for d_k in d_k_values:
        q = torch.randn(1, 1, num_queries, d_k, generator=generator, dtype=torch.float64)
        k = torch.randn(1, 1, seq_len, d_k, generator=generator, dtype=torch.float64)
        dots = (q[0, 0] @ k[0, 0].T).numpy()
        for name, scale in (("none", 1.0), ("1/sqrt(d_k)", d_k**-0.5), ("1/d_k", 1.0 / d_k)):
            weights = _numpy_softmax(dots * scale)
            expected_std[name].append(np.std(dots * scale, ddof=1))
            entropy = -(weights * np.log(weights)).sum(axis=-1)
            expected_entropy[name].append(entropy.mean())

    assert len(fig.axes) == 2
    std_ax, entropy_ax = fig.axes
    assert std_ax.get_xscale() == "log" and std_ax.get_yscale() == "log"
    std_lines, entropy_lines = _lines_by_label(std_ax), _lines_by_label(entropy_ax)
    predicted = {"none": np.sqrt(d_k_values), "1/sqrt(d_k)": np.ones(3), "1/d_k": None}
    predicted["1/d_k"] = 1 / np.sqrt(d_k_values)
    for name in expected_std:
        np.testing.assert_array_equal(std_lines[name].get_xdata(), d_k_values)
        np.testing.assert_allclose(std_lines[name].get_ydata(), expected_std[name], rtol=1e-10)
        np.testing.assert_allclose(std_lines[f"{name} (predicted)"].get_ydata(), predicted[name])
        np.testing.assert_allclose(
            entropy_lines[name].get_ydata(), expected_entropy[name], rtol=1e-10
        )
    np.testing.assert_allclose(
        entropy_lines["uniform: log(seq_len)"].get_ydata(), [math.log(seq_len)] * 3
    )


def test_scaling_comparison_agrees_with_the_predicted_std_and_entropy(keep):
    """std ~ 1 with sqrt(d_k); none saturates, 1/d_k goes uniform."""
    fig = plots.scaling_comparison(d_k_values=(4, 64, 256), seq_len=16, num_queries=256)
    keep(fig)
    std_lines, entropy_lines = _lines_by_label(fig.axes[0]), _lines_by_label(fig.axes[1])
    np.testing.assert_allclose(std_lines["1/sqrt(d_k)"].get_ydata(), 1.0, rtol=0.15)
    np.testing.assert_allclose(std_lines["none"].get_ydata(), np.sqrt([4, 64, 256]), rtol=0.15)
    none, sqrt, linear = (
        entropy_lines[n].get_ydata()[-1] for n in ("none", "1/sqrt(d_k)", "1/d_k")
    )
    assert none < 0.5 * math.log(16) < sqrt < linear
    assert linear > 0.99 * math.log(16)


# ---------------------------------------------------------------------------------- positions


def test_rope_vs_sinusoidal_decay_against_complex_exponentials(keep):
    head_dim, max_distance, num_positions, base, seed = 16, 40, 6, 10000.0, 7
    fig = plots.rope_vs_sinusoidal_decay(
        head_dim=head_dim, max_distance=max_distance, num_positions=num_positions, seed=seed
    )
    keep(fig)

    theta = base ** (-np.arange(0, head_dim, 2) / head_dim)  # (D/2,)
    distances = np.arange(max_distance + 1)
    partial_sums = np.cumsum(np.exp(1j * np.outer(distances, theta)), axis=1)  # S_1 .. S_{D/2}
    bound = np.abs(partial_sums).mean(axis=1)
    positions = np.arange(max_distance + 1)[:, None] * theta  # (R, D/2)
    encodings = np.stack((np.sin(positions), np.cos(positions)), axis=-1).reshape(-1, head_dim)
    pe_dot = encodings @ encodings[0]

    assert len(fig.axes) == 5  # decay curves, two heat maps, two colorbars
    decay_ax, rope_ax, sinusoidal_ax = fig.axes[:3]
    lines = _lines_by_label(decay_ax)
    np.testing.assert_array_equal(lines["RoPE bound"].get_xdata(), distances)
    np.testing.assert_allclose(lines["RoPE bound"].get_ydata(), bound / bound[0], rtol=1e-10)
    sinusoidal_line = lines["sinusoidal PE[m] . PE[m+r]"]
    np.testing.assert_allclose(sinusoidal_line.get_ydata(), pe_dot / pe_dot[0], atol=1e-12)
    assert lines["RoPE bound"].get_ydata()[-1] < 0.8  # it decays

    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(head_dim, generator=generator, dtype=torch.float64).numpy()
    k = torch.randn(head_dim, generator=generator, dtype=torch.float64).numpy()
    q_complex, k_complex = q[0::2] + 1j * q[1::2], k[0::2] + 1j * k[1::2]  # pairs (2i, 2i + 1)
    turns = np.exp(1j * np.arange(num_positions)[:, None] * theta)  # (P, D/2): e^{i m theta}
    rope_scores = np.real((q_complex * turns) @ np.conj(k_complex * turns).T)  # (P, P)
    pe = encodings[:num_positions]
    sinusoidal_scores = (q + pe) @ (k + pe).T
    rope_image, sinusoidal_image = _images(fig)
    np.testing.assert_allclose(rope_image, rope_scores, atol=1e-10)
    np.testing.assert_allclose(sinusoidal_image, sinusoidal_scores, atol=1e-10)
    # RoPE: a function of m - n only (constant diagonals); added sinusoids: not.
    assert np.allclose(rope_image[1:, 1:], rope_image[:-1, :-1])
    assert not np.allclose(sinusoidal_image[1:, 1:], sinusoidal_image[:-1, :-1])
    assert rope_ax.get_title().startswith("RoPE")
    assert sinusoidal_ax.get_title().startswith("Sinusoidal")


def _paper_slopes(n: int) -> list[float]:
    """`get_slopes` of the ALiBi paper's code (Press et al. 2022;
    github.com/ofirpress/attention_with_linear_biases)."""

    def power_of_2(n):
        start = 2 ** (-(2 ** -(math.log2(n) - 3)))
        return [start * start**i for i in range(n)]

    if math.log2(n).is_integer():
        return power_of_2(n)
    closest = 2 ** math.floor(math.log2(n))
    return power_of_2(closest) + _paper_slopes(2 * closest)[0::2][: n - closest]


@pytest.mark.parametrize("num_heads", [8, 6])
def test_alibi_biases_are_slope_times_distance(keep, num_heads):
    seq_len = 5
    fig = plots.alibi_biases(num_heads=num_heads, seq_len=seq_len)
    keep(fig)

    slopes = _paper_slopes(num_heads)
    if num_heads == 8:
        assert slopes == pytest.approx([2 ** (-8 * (i + 1) / 8) for i in range(8)])
    distance = np.abs(np.arange(seq_len)[:, None] - np.arange(seq_len)[None, :])
    future = np.triu(np.ones((seq_len, seq_len), dtype=bool), k=1)
    assert len(fig.axes) == num_heads + 2  # heat maps, colorbar, line plot
    images = _images(fig)
    assert len(images) == num_heads
    for head, (image, slope) in enumerate(zip(images, slopes, strict=True)):
        expected = np.where(future, np.nan, -slope * distance)
        np.testing.assert_allclose(image.filled(np.nan), expected, rtol=1e-6)
        assert fig.axes[head].get_title() == f"head {head}: m = {slope:.4g}"
    line_ax = fig.axes[-1]
    assert line_ax.get_title() == "bias of the last query"
    for head, line in enumerate(line_ax.get_lines()):
        np.testing.assert_allclose(line.get_ydata(), -slopes[head] * np.arange(seq_len), rtol=1e-6)


def test_alibi_biases_bidirectional_has_no_blank_cells(keep):
    fig = plots.alibi_biases(num_heads=2, seq_len=4, causal=False)
    keep(fig)
    image = _images(fig)[0]
    np.testing.assert_allclose(image, -0.0625 * np.abs(np.subtract.outer(range(4), range(4))))


# -------------------------------------------------------------------------------- activations


def test_gelu_vs_relu_curves_and_derivatives(keep):
    x = np.linspace(-3.0, 3.0, 13)  # includes 0
    fig = plots.gelu_vs_relu(x)
    keep(fig)

    assert len(fig.axes) == 2
    value_ax, derivative_ax = fig.axes
    assert (value_ax.get_title(), derivative_ax.get_title()) == ("Activation", "Derivative")
    values, derivatives = _lines_by_label(value_ax), _lines_by_label(derivative_ax)
    assert set(values) == set(derivatives) == {"GELU", "GELU (tanh approximation)", "ReLU"}

    def gelu(t):
        return t * 0.5 * (1.0 + math.erf(t / math.sqrt(2.0)))  # x Phi(x) (Hendrycks & Gimpel 2016)

    def gelu_tanh(t):
        return 0.5 * t * (1.0 + math.tanh(math.sqrt(2.0 / math.pi) * (t + 0.044715 * t**3)))

    def gelu_derivative(t):  # Phi(x) + x phi(x)
        return 0.5 * (1.0 + math.erf(t / math.sqrt(2.0))) + t * math.exp(-t * t / 2) / math.sqrt(
            2 * math.pi
        )

    step = 1e-6
    np.testing.assert_allclose(values["GELU"].get_ydata(), [gelu(t) for t in x], atol=1e-12)
    np.testing.assert_allclose(
        values["GELU (tanh approximation)"].get_ydata(), [gelu_tanh(t) for t in x], atol=1e-12
    )
    np.testing.assert_array_equal(values["ReLU"].get_ydata(), np.maximum(x, 0.0))
    np.testing.assert_allclose(
        derivatives["GELU"].get_ydata(), [gelu_derivative(t) for t in x], atol=1e-12
    )
    central = [(gelu_tanh(t + step) - gelu_tanh(t - step)) / (2 * step) for t in x]
    np.testing.assert_allclose(
        derivatives["GELU (tanh approximation)"].get_ydata(), central, atol=1e-7
    )
    np.testing.assert_array_equal(derivatives["ReLU"].get_ydata(), (x > 0).astype(float))


# ----------------------------------------------------------------------- saving and imports


def test_save_figure_writes_png_and_svg(tmp_path, keep):
    fig = plots.mask_gallery(seq_len=4, valid_length=2)
    keep(fig)
    png = plots.save_figure(fig, tmp_path / "masks.png")
    svg = plots.save_figure(fig, tmp_path / "sub" / "masks.SVG")
    assert png.read_bytes().startswith(PNG_MAGIC)
    svg_bytes = svg.read_bytes()
    assert len(svg_bytes) > 1000 and b"<svg" in svg_bytes[:1000]
    with pytest.raises(ValueError, match=r"\.png"):
        plots.save_figure(fig, tmp_path / "masks.jpg")
    assert not (tmp_path / "masks.jpg").exists()
    with pytest.raises(TypeError, match="fig"):
        plots.save_figure("not a figure", tmp_path / "x.png")


def test_qkv_imports_without_matplotlib_and_plots_say_how_to_get_it():
    script = (
        "import sys\n"
        "import qkv, qkv.analysis\n"
        "assert 'matplotlib' not in sys.modules, 'qkv imported matplotlib'\n"
        "sys.modules['matplotlib'] = None\n"
        "try:\n"
        "    import qkv.analysis.plots\n"
        "except ImportError as error:\n"
        "    print(error)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=900
    )
    assert result.returncode == 0, result.stderr
    assert "pip install matplotlib" in result.stdout
