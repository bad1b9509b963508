"""`qkv.analysis.cost.complexity` and `qkv bench complexity`: the O(L^2) doubling table.

Outside references: numpy's least-squares polyfit (the exponent fit), the byte size PyTorch
gives a (B, H, L, L) fp32 tensor (the `seq_len * seq_len * n_heads * 4` formula, the
naive backend's memory), and `F.scaled_dot_product_attention` (the three timed calls do the
same work). No timed assertions: times are only checked to be positive.
"""

from __future__ import annotations

import argparse
import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from qkv.analysis.cost.complexity import (
    BACKENDS,
    NAIVE_SCORE_COPIES,
    backend_function,
    fit_exponent,
    measure_complexity,
    predicted_peak,
)
from qkv.analysis.cost.complexity_report import format_table, plot_complexity
from qkv.commands import bench

LENGTHS = (256, 512, 1024)
B, H, D = 1, 4, 32


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """One thread: on a machine with few cores, shared with other work, two OpenMP threads can
    wait on each other and make each call far slower. Only memory and shapes are asserted here,
    never times."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def result(one_thread):
    """One small run shared by the tests below: naive and tiled, forward, 1 timed sample."""
    torch.manual_seed(0)
    return measure_complexity(
        lengths=LENGTHS, backends=("naive", "tiled"), batch=B, heads=H, head_dim=D, repeats=1
    )


def test_fit_exponent_recovers_known_slopes_and_matches_numpy_polyfit():
    lengths = [64, 128, 256, 512, 1024]
    assert fit_exponent(lengths, [3e-9 * L**2 for L in lengths]) == pytest.approx(2.0, abs=1e-12)
    assert fit_exponent(lengths, [5.0 * L for L in lengths]) == pytest.approx(1.0, abs=1e-12)
    noisy = np.random.default_rng(0).uniform(0.5, 2.0, size=len(lengths)) * np.square(lengths)
    expected = np.polyfit(np.log(lengths), np.log(noisy), 1)[0]
    assert fit_exponent(lengths, noisy.tolist()) == pytest.approx(expected, rel=1e-12)


def test_fixed_overhead_flattens_the_small_lengths_so_the_top_points_fit_better():
    lengths = [2**i for i in range(6, 14)]
    times = [1e-3 + 1e-9 * L**2 for L in lengths]  # 1 ms of overhead, then L^2
    over_all = fit_exponent(lengths, times)
    over_top = fit_exponent(lengths[-3:], times[-3:])
    assert over_all < 1.0 < 1.8 < over_top <= 2.0


@pytest.mark.parametrize(
    "lengths, values",
    [([64], [1.0]), ([64, 128], [1.0]), ([0, 128], [1.0, 2.0]), ([64, 64], [1, 2])],
)
def test_fit_exponent_rejects_too_few_or_bad_points(lengths, values):
    with pytest.raises(ValueError, match="length"):
        fit_exponent(lengths, values)


@pytest.mark.parametrize("backward", [False, True])
@pytest.mark.parametrize("causal", [False, True])
def test_the_three_timed_calls_agree_with_pytorch_sdpa(causal, backward):
    q, k, v = (torch.randn(2, 3, 100, 16, dtype=torch.float64, requires_grad=True) for _ in "qkv")
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    grad_out = torch.randn_like(expected)
    expected_grads = torch.autograd.grad(expected, (q, k, v), grad_out) if backward else None
    for backend in BACKENDS:
        output = backend_function(backend, causal=causal)(q, k, v)
        torch.testing.assert_close(output, expected, msg=backend)
        if backward:
            grads = torch.autograd.grad(output, (q, k, v), grad_out)
            torch.testing.assert_close(grads, expected_grads, msg=backend)


def test_naive_memory_is_whole_score_matrices_of_l_times_l_times_heads_times_4_bytes(result):
    for point in result.rows("naive"):
        L = point.length
        scores = torch.empty(B, H, L, L, dtype=torch.float32)  # L * L * heads * 4 bytes
        formula = scores.nelement() * scores.element_size()
        assert point.score_bytes == formula == B * H * L * L * 4
        copies = point.peak_bytes / formula
        # the peak is a whole number of (B, H, L, L) fp32 tensors plus O(L) odds and ends (at
        # most a few (B, H, L, D) ones: q scaled, the output), and no more of them than the
        # budget's prediction assumes
        odds = point.peak_bytes - round(copies) * formula
        assert abs(odds) <= 2 * B * H * L * D * 4, (L, copies)
        assert 1 <= round(copies) <= NAIVE_SCORE_COPIES[False]
        assert point.peak_bytes <= predicted_peak(
            "naive", batch=B, heads=H, length=L, head_dim=D, dtype=torch.float32, backward=False
        )
        assert point.seconds > 0


def test_naive_memory_grows_as_L_squared_and_tiled_clearly_slower(result):
    assert result.fit_from == 512
    assert 1.6 <= result.fit("naive").memory_exponent <= 2.4
    assert result.fit("tiled").memory_exponent < 1.5
    assert [p.memory_ratio for p in result.rows("naive")][1:] == pytest.approx([4.0, 4.0], rel=0.1)
    assert (
        result.rows("naive")[0].memory_ratio is None and result.rows("naive")[0].time_ratio is None
    )
    tiled = result.rows("tiled")
    assert tiled[2].time_ratio == pytest.approx(tiled[2].seconds / tiled[1].seconds)


def test_format_table_has_a_row_per_backend_and_length_with_time_ratio_and_memory(result):
    text = format_table(result)
    lines = text.splitlines()
    header = lines[1]
    for column in ("backend", "seq_len", "time (ms)", "ratio", "mem (MB)", "L*L (MB)"):
        assert column in header
    data = [line.split() for line in lines[2:] if line.split()[1].isdigit()]
    assert [(r[0], int(r[1])) for r in data] == [
        (b, L) for b in ("naive", "tiled") for L in LENGTHS
    ]
    first, second = data[0], data[1]
    assert len(first) == 5 and len(second) == 7  # the first L has no ratios
    assert second[5] == f"{result.rows('naive')[1].memory_ratio:.1f}x"
    assert float(second[6]) == pytest.approx(B * H * 512 * 512 * 4 / 1e6, abs=0.01)
    fitted = [line.split() for line in lines if "memory L^" in line]
    assert [f[0] for f in fitted] == ["naive", "tiled"]


def test_plot_has_time_and_memory_axes_with_one_line_per_backend(result):
    figure = plot_complexity(result)
    assert len(figure.axes) == 2
    for axes, key in zip(figure.axes, ("time", "memory"), strict=True):
        assert axes.get_xscale() == "log" and axes.get_yscale() == "log"
        lines = axes.get_lines()
        assert len(lines) == 2
        for line, backend in zip(lines, ("naive", "tiled"), strict=True):
            assert list(line.get_xdata()) == list(LENGTHS)
            exponent = getattr(result.fit(backend), f"{key}_exponent")
            assert line.get_label() == f"{backend} (L^{exponent:.2f})"
    memory_line = figure.axes[1].get_lines()[0]
    expected = [p.peak_bytes / 1e6 for p in result.rows("naive")]
    assert list(memory_line.get_ydata()) == pytest.approx(expected)


def test_a_backend_over_the_memory_budget_is_skipped_and_says_so():
    predicted = [
        predicted_peak(
            "naive", batch=1, heads=2, length=L, head_dim=8, dtype=torch.float32, backward=True
        )
        for L in (32, 64)
    ]
    assert predicted == [5 * 2 * L * L * 4 + 4 * 2 * L * 8 * 4 for L in (32, 64)]
    skipped = measure_complexity(
        lengths=(32, 64), backends=("naive", "sdpa"), heads=2, head_dim=8, repeats=1,
        backward=True, max_memory=sum(predicted) // 2,
    )  # fmt: skip
    naive, sdpa = skipped.rows("naive"), skipped.rows("sdpa")
    assert naive[0].skipped is None and naive[1].skipped.startswith("skipped: predicted peak")
    assert naive[1].seconds is None and naive[1].peak_bytes is None
    assert all(p.skipped is None for p in sdpa)
    assert skipped.fit("naive").time_exponent is None  # one measured point: no fit
    text = format_table(skipped)
    assert "naive       64 skipped: predicted peak" in text
    assert "? (fewer than 2 points)" in text
    figure = plot_complexity(skipped)
    assert list(figure.axes[0].get_lines()[0].get_xdata()) == [32]


def test_a_length_whose_inputs_exceed_the_budget_is_skipped_before_allocating(monkeypatch):
    """--max-memory counts the inputs too: (B, H, L, D) q, k, v and the output gradient are 4
    tensors; a length whose inputs alone exceed the budget allocates nothing."""
    allocated = []
    real = torch.randn

    def counted(*shape, **kwargs):
        allocated.append(shape)
        return real(*shape, **kwargs)

    monkeypatch.setattr(torch, "randn", counted)
    inputs_64 = 4 * 2 * 64 * 8 * 4  # bytes of the four (1, 2, 64, 8) fp32 inputs
    result = measure_complexity(
        lengths=(32, 64), backends=("naive", "sdpa"), heads=2, head_dim=8, repeats=1,
        max_memory=inputs_64 - 1,
    )  # fmt: skip
    for backend in ("naive", "sdpa"):
        _, long = result.rows(backend)
        assert long.skipped.startswith("skipped: the inputs alone take")
    assert all(shape[2] == 32 for shape in allocated)  # nothing of L = 64 was allocated


@pytest.mark.parametrize(
    "kwargs, error",
    [
        (dict(lengths=(64, 0)), ValueError),
        (dict(backends=("naive", "flash")), ValueError),
        (dict(heads=0), ValueError),
        (dict(repeats=0), ValueError),
        (dict(dtype=torch.int32), TypeError),
    ],
)
def test_bad_arguments_fail_early(kwargs, error):
    with pytest.raises(error, match=next(iter(kwargs))):
        measure_complexity(**kwargs)


def test_cli_runs_end_to_end_and_writes_json_and_a_plot(tmp_path, capsys):
    parser = argparse.ArgumentParser(prog="qkv")
    bench.add_parser(parser.add_subparsers(dest="command", required=True))
    out_json, out_png = tmp_path / "complexity.json", tmp_path / "complexity.png"
    args = parser.parse_args(
        ["bench", "complexity", "--lengths", "64", "128", "--heads", "2", "--head-dim", "16",
         "--repeats", "1", "--causal", "--backward", "--json", str(out_json),
         "--plot", str(out_png)]
    )  # fmt: skip
    assert args.run(args) == 0
    printed = capsys.readouterr().out
    assert "seq_len" in printed and "causal, forward + backward" in printed
    payload = json.loads(out_json.read_text())
    assert payload["settings"]["causal"] and payload["settings"]["backward"]
    assert payload["lengths"] == [64, 128] and payload["settings"]["dtype"] == "float32"
    assert [(p["backend"], p["length"]) for p in payload["points"]] == [
        (b, L) for b in ("naive", "sdpa", "tiled") for L in (64, 128)
    ]
    assert all(p["seconds"] > 0 and math.isfinite(p["seconds"]) for p in payload["points"])
    assert {f["backend"] for f in payload["fits"]} == {"naive", "sdpa", "tiled"}
    assert out_png.read_bytes().startswith(b"\x89PNG")


def test_cli_reports_bad_arguments_with_exit_status_1(capsys):
    parser = argparse.ArgumentParser(prog="qkv")
    bench.add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["bench", "complexity", "--lengths", "-8"])
    assert args.run(args) == 1
    assert "lengths must be positive" in capsys.readouterr().err
