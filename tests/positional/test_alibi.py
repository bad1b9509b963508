"""ALiBi against the paper: the slopes of Press et al.'s reference `get_slopes`, the bias formula
written out element by element, and attention with it against F.scaled_dot_product_attention."""

import math

import pytest
import torch
import torch.nn.functional as F

import qkv
from qkv.positional import alibi_bias, alibi_slopes


def paper_get_slopes(n):
    """`get_slopes` of the ALiBi paper's code, ofirpress/attention_with_linear_biases."""

    def get_slopes_power_of_2(n):
        start = 2 ** (-(2 ** -(math.log2(n) - 3)))
        ratio = start
        return [start * ratio**i for i in range(n)]

    if math.log2(n).is_integer():
        return get_slopes_power_of_2(n)
    closest_power_of_2 = 2 ** math.floor(math.log2(n))
    return (
        get_slopes_power_of_2(closest_power_of_2)
        + paper_get_slopes(2 * closest_power_of_2)[0::2][: n - closest_power_of_2]
    )


def test_eight_heads_are_powers_of_one_half():
    expected = torch.tensor([1 / 2, 1 / 4, 1 / 8, 1 / 16, 1 / 32, 1 / 64, 1 / 128, 1 / 256])
    slopes = alibi_slopes(8)
    assert slopes.dtype == torch.float32 and slopes.shape == (8,)
    assert torch.equal(slopes, expected)


def test_twelve_heads_follow_the_non_power_of_two_rule():
    """The 8-head slopes, then 16-head slopes 2^(-k/2) at indices 0, 2, 4, 6 (k = 1, 3, 5, 7)."""
    expected = [
        0.5, 0.25, 0.125, 0.0625, 0.03125, 0.015625, 0.0078125, 0.00390625,
        0.7071067811865476,  # 2^-0.5
        0.3535533905932738,  # 2^-1.5
        0.1767766952966369,  # 2^-2.5
        0.08838834764831845,  # 2^-3.5
    ]  # fmt: skip
    torch.testing.assert_close(alibi_slopes(12), torch.tensor(expected), rtol=1e-7, atol=0)


@pytest.mark.parametrize("num_heads", range(1, 65))
def test_slopes_match_paper_reference_code(num_heads):
    expected = torch.tensor(paper_get_slopes(num_heads), dtype=torch.float32)
    torch.testing.assert_close(alibi_slopes(num_heads), expected, rtol=1e-7, atol=0)


@pytest.mark.parametrize(("L_q", "L_k"), [(5, 5), (3, 7), (1, 6), (6, 2)])
def test_bias_is_minus_slope_times_distance(L_q, L_k):
    num_heads = 6
    slopes = paper_get_slopes(num_heads)
    expected = torch.tensor(
        [
            [[-slopes[h] * abs(i + (L_k - L_q) - j) for j in range(L_k)] for i in range(L_q)]
            for h in range(num_heads)
        ]
    ).unsqueeze(0)
    bias = alibi_bias(num_heads, L_q, L_k)
    assert bias.shape == (1, num_heads, L_q, L_k) and bias.dtype == torch.float32
    torch.testing.assert_close(bias, expected)
    bias64 = alibi_bias(num_heads, L_q, L_k, dtype=torch.float64)
    torch.testing.assert_close(bias64, expected.double(), rtol=1e-15, atol=1e-15)


@pytest.mark.parametrize("backend", ["auto", "reference"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(("L_q", "L_k"), [(6, 6), (3, 6)])
def test_attention_with_alibi_matches_torch_sdpa(causal, L_q, L_k, backend):
    torch.manual_seed(0)
    B, H, D = 2, 4, 8
    q = torch.randn(B, H, L_q, D, dtype=torch.float64)
    k, v = torch.randn(2, B, H, L_k, D, dtype=torch.float64)
    bias = alibi_bias(H, L_q, L_k, dtype=torch.float64)
    attn_mask = bias
    if causal:
        # bottom-right aligned look-ahead mask, written out for SDPA as an additive mask
        query_pos = torch.arange(L_q)[:, None] + (L_k - L_q)
        blocked = torch.arange(L_k)[None, :] > query_pos
        attn_mask = bias.masked_fill(blocked, float("-inf"))
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
    got = qkv.attention(q, k, v, bias=bias, causal=causal, backend=backend)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)


def test_bad_arguments():
    with pytest.raises(ValueError, match=r"num_heads: expected an int >= 1, got 0"):
        alibi_slopes(0)
    with pytest.raises(TypeError, match=r"num_heads: expected an int >= 1, got float 4.0"):
        alibi_slopes(4.0)
    with pytest.raises(TypeError, match=r"num_heads: expected an int >= 1, got bool True"):
        alibi_bias(True, 2, 2)
    with pytest.raises(ValueError, match=r"L_q: expected an int >= 0, got -1"):
        alibi_bias(4, -1, 2)
    with pytest.raises(TypeError, match=r"L_k: expected an int >= 0, got str '3'"):
        alibi_bias(4, 2, "3")
    with pytest.raises(TypeError, match=r"dtype: expected a floating-point torch.dtype"):
        alibi_bias(4, 2, 2, dtype=torch.int32)
