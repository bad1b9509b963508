"""The softmax Jacobian, the naive and stable softmax and log-sum-exp, against PyTorch's own
softmax, logsumexp and autograd Jacobian (float64), with -inf entries and float16 overflow."""

from __future__ import annotations

import math

import pytest
import torch
from torch.autograd.functional import jacobian

from qkv.analysis.softmax_math import logsumexp, naive_softmax, softmax_jacobian, stable_softmax

F64 = torch.float64


def _scores(*shape: int, spread: float = 3.0, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=generator, dtype=F64) * spread


@pytest.mark.parametrize("spread", [0.1, 3.0, 30.0])
def test_jacobian_equals_autograd_of_torch_softmax(spread):
    x = _scores(7, spread=spread)
    expected = jacobian(lambda z: torch.softmax(z, dim=-1), x)  # (7, 7)
    got = softmax_jacobian(torch.softmax(x, dim=-1))
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-15)


def test_jacobian_is_batched_over_leading_dims():
    x = _scores(2, 3, 5, seed=1)  # (2, 3, 5)
    got = softmax_jacobian(torch.softmax(x, dim=-1))  # (2, 3, 5, 5)
    assert got.shape == (2, 3, 5, 5)
    for b in range(2):
        for r in range(3):
            expected = jacobian(lambda z: torch.softmax(z, dim=-1), x[b, r])
            torch.testing.assert_close(got[b, r], expected, rtol=0, atol=1e-15)
    # adding a constant to all scores changes nothing: every row of J sums to 0
    torch.testing.assert_close(got.sum(dim=-1), torch.zeros(2, 3, 5, dtype=F64))


def test_jacobian_of_masked_scores_matches_autograd():
    x = _scores(6, seed=2)
    x[[1, 4]] = -math.inf  # masked keys: their rows and columns of J are 0
    expected = jacobian(lambda z: torch.softmax(z, dim=-1), x)
    got = softmax_jacobian(torch.softmax(x, dim=-1))
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-15)
    assert not got[1].any() and not got[:, 4].any()


def test_jacobian_vanishes_on_and_off_the_diagonal_as_scores_grow():
    x = _scores(16, seed=3)
    small = softmax_jacobian(torch.softmax(x, dim=-1))
    large = softmax_jacobian(torch.softmax(x * 50, dim=-1))
    off = ~torch.eye(16, dtype=torch.bool)
    assert large.diagonal().abs().max() < 1e-3 * small.diagonal().abs().max()
    assert large[off].abs().max() < 1e-3 * small[off].abs().max()


@pytest.mark.parametrize("spread", [0.5, 5.0, 200.0])
def test_stable_softmax_and_logsumexp_equal_torch(spread):
    x = _scores(4, 9, spread=spread, seed=4)
    torch.testing.assert_close(stable_softmax(x), torch.softmax(x, dim=-1), rtol=0, atol=1e-15)
    torch.testing.assert_close(logsumexp(x), torch.logsumexp(x, dim=-1), rtol=1e-15, atol=0)


def test_naive_softmax_equals_torch_on_moderate_scores_and_overflows_on_large_ones():
    x = _scores(4, 9, spread=2.0, seed=5)
    torch.testing.assert_close(naive_softmax(x), torch.softmax(x, dim=-1), rtol=1e-14, atol=0)
    large = x.clone()
    large[0, 0] = 800.0  # exp(800) overflows float64
    assert torch.isnan(naive_softmax(large)[0]).any()
    assert torch.isfinite(stable_softmax(large)).all()
    torch.testing.assert_close(stable_softmax(large), torch.softmax(large, dim=-1))


def test_minus_inf_entries_and_fully_masked_rows():
    x = _scores(3, 5, seed=6)
    x[0, [0, 2]] = -math.inf  # partly masked
    x[1] = -math.inf  # nothing visible
    torch.testing.assert_close(stable_softmax(x)[[0, 2]], torch.softmax(x, dim=-1)[[0, 2]])
    assert torch.equal(stable_softmax(x)[1], torch.zeros(5, dtype=F64))  # torch gives NaN
    lse = logsumexp(x)
    assert lse[1] == -math.inf  # the log of an empty sum, not NaN
    torch.testing.assert_close(lse, torch.logsumexp(x, dim=-1))
    assert logsumexp(torch.tensor([1.0, math.inf], dtype=F64)) == math.inf


def test_float16_naive_overflows_where_max_subtraction_does_not():
    x = torch.tensor([[12.0, 3.0, -1.0], [1.0, 2.0, 3.0]], dtype=torch.float16)  # e^12 > 65504
    reference = torch.softmax(x.double(), dim=-1)
    naive, stable = naive_softmax(x), stable_softmax(x)
    assert naive.dtype == stable.dtype == torch.float16
    assert not torch.isfinite(naive[0]).all() and torch.isfinite(naive[1]).all()
    assert torch.isfinite(stable).all()
    # float16 keeps about 3 decimal digits; torch's float16 softmax makes errors of this size
    torch.testing.assert_close(stable.double(), reference, rtol=0, atol=2e-3)
    torch.testing.assert_close(logsumexp(x).double(), torch.logsumexp(x.double(), dim=-1),
                               rtol=2e-3, atol=0)  # fmt: skip


def test_bad_inputs_name_the_argument():
    with pytest.raises(TypeError, match="x"):
        stable_softmax([1.0, 2.0])
    with pytest.raises(ValueError, match="x"):
        logsumexp(torch.tensor(1.0))
    with pytest.raises(ValueError, match="y"):
        softmax_jacobian(torch.tensor([1, 2]))


def test_saturation_plot_draws_an_off_diagonal_jacobian_entry():
    from qkv.analysis import plots

    a_values = [0.0, 1.0, 4.0, 12.0]
    fig = plots.softmax_saturation(a_values)
    line = {line.get_label(): line for line in fig.axes[0].get_lines()}["dy_3/dx_1 = -y_3 y_1"]
    expected = [
        jacobian(lambda z: torch.softmax(z, dim=0), torch.tensor([a, a, 2 * a], dtype=F64))[2, 0]
        for a in a_values
    ]
    torch.testing.assert_close(torch.from_numpy(line.get_ydata()), torch.stack(expected))
