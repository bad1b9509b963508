"""Permutation equivariance without positions (Vaswani et al. 2017, s3.5), as a property of
qkv's encoder blocks and as a figure."""

import pytest
import torch

from qkv.analysis import plots
from qkv.layers import EncoderBlock


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_permuting_the_input_permutes_the_output_only_without_positions(seed):
    gaps = plots.equivariance_gaps(seq_len=10, embed_dim=16, num_heads=4, seed=seed)
    permutation = gaps["permutation"]
    assert sorted(permutation.tolist()) == list(range(10))
    assert permutation.tolist() != list(range(10))
    assert float(gaps["gap_without_positions"].max()) < 1e-12  # f(P x) = P f(x)
    assert float(gaps["gap_with_sinusoidal"].min()) > 1e-3  # positions break it for every token


def test_any_permutation_and_padding_mask_commute_with_the_encoder():
    """Random permutations of a batch with padding: the mask permuted with the keys."""
    torch.manual_seed(3)
    block = EncoderBlock(12, 3, 24).double().eval()
    x = torch.randn(2, 9, 12, dtype=torch.float64)
    keep = torch.ones(2, 9, dtype=torch.bool)
    keep[1, 6:] = False
    for _ in range(3):
        order = torch.randperm(9)
        with torch.no_grad():
            plain = block(x, mask=keep[:, None, None, :])
            permuted = block(x[:, order], mask=keep[:, order][:, None, None, :])
        torch.testing.assert_close(permuted, plain[:, order], rtol=1e-12, atol=1e-12)


def test_the_figure_draws_both_outputs_and_the_gaps():
    fig = plots.permutation_equivariance(seq_len=8)
    titles = [ax.get_title() for ax in fig.axes]
    assert "f(x): one row per token" in titles and "Equivariance gap per token" in titles
    gap_ax = next(ax for ax in fig.axes if ax.get_title() == "Equivariance gap per token")
    assert len(gap_ax.get_lines()) == 2
