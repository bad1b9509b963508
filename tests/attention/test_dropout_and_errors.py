"""Attention dropout, tested statistically; bad input, each error naming its argument."""

import pytest
import torch

import qkv


def test_dropout_zeroes_weights_with_probability_p_and_keeps_row_sums_at_one_on_average():
    torch.manual_seed(0)
    p, draws = 0.3, 400
    q, k, v = (torch.randn(1, 4, 8, 16, dtype=torch.float64) for _ in range(3))
    _, clean = qkv.attention(q, k, v, return_weights=True)
    dropped = torch.stack(
        [qkv.attention(q, k, v, dropout_p=p, return_weights=True)[1] for _ in range(draws)]
    )
    zero_fraction = (dropped == 0).double().mean().item()
    n = dropped.numel()
    assert abs(zero_fraction - p) < 5 * (p * (1 - p) / n) ** 0.5  # within 5 sigma
    survivors = dropped != 0
    # Kept weights are scaled by 1 / (1 - p), as inverted dropout does (to 2^-16: on the CPU
    # the keep probability is a multiple of 2^-16, the scale its inverse; qkv.attention.dropout)
    expected = (clean / (1 - p)).expand_as(dropped)[survivors]
    torch.testing.assert_close(dropped[survivors], expected, rtol=2**-16, atol=0)
    row_sums = dropped.sum(-1)  # not 1 per draw, 1 in expectation
    assert (row_sums - 1).abs().max() > 0.05
    assert abs(row_sums.mean().item() - 1) < 0.01


def test_sdpa_dropout_is_unbiased_on_the_output():
    torch.manual_seed(1)
    q, k, v = (torch.randn(1, 2, 6, 8, dtype=torch.float64) for _ in range(3))
    clean = qkv.attention(q, k, v, backend="sdpa")
    mean = torch.stack([qkv.attention(q, k, v, dropout_p=0.2, backend="sdpa") for _ in range(2000)])
    assert not torch.equal(mean[0], clean)
    torch.testing.assert_close(mean.mean(0), clean, atol=0.06, rtol=0)


def test_no_dropout_is_deterministic():
    q, k, v = (torch.randn(1, 2, 6, 8) for _ in range(3))
    assert torch.equal(qkv.attention(q, k, v, dropout_p=0.0), qkv.attention(q, k, v))


def _qkv(B=2, H=4, H_kv=2, L_q=5, L_k=6, D=8):
    return torch.randn(B, H, L_q, D), torch.randn(B, H_kv, L_k, D), torch.randn(B, H_kv, L_k, D)


@pytest.mark.parametrize(
    ("make_call", "error", "match"),
    [
        (
            lambda q, k, v: ((q[0], k, v), {}),
            ValueError,
            r"q: expected 4 dimensions .* \(4, 5, 8\)",
        ),
        (lambda q, k, v: ((q, k[:1], v[:1]), {}), ValueError, "batch sizes differ: q 2, k 1, v 1"),
        (
            lambda q, k, v: ((q, k[..., :4], v), {}),
            ValueError,
            "head dims differ: q has D=8, k has D=4",
        ),
        (lambda q, k, v: ((q[:, :3], k, v), {}), ValueError, "2 key/value heads must divide the 3"),
        (
            lambda q, k, v: ((q, k, v[:, :, :3]), {}),
            ValueError,
            r"k, v: expected the same \(H_kv, L_k\)",
        ),
        (lambda q, k, v: ((q, k, v.double()), {}), TypeError, "expected one dtype"),
        (lambda q, k, v: ((q.long(), k, v), {}), TypeError, "q: expected a floating-point"),
        (
            lambda q, k, v: ((q, k, v), {"mask": torch.ones(5, 6, dtype=torch.int64)}),
            TypeError,
            "mask: expected dtype bool .* got torch.int64",
        ),
        (
            lambda q, k, v: ((q, k, v), {"mask": torch.ones(5, 7, dtype=torch.bool)}),
            ValueError,
            r"mask: shape \(5, 7\) does not broadcast to \(B, H, L_q, L_k\) = \(2, 4, 5, 6\)",
        ),
        (
            lambda q, k, v: ((q, k, v), {"mask": torch.ones(2, 5, 6, dtype=torch.bool)}),
            ValueError,
            r"mask: .*\.unsqueeze\(1\)",
        ),
        (
            lambda q, k, v: ((q, k, v), {"bias": torch.ones(5, 6, dtype=torch.bool)}),
            TypeError,
            "bias: expected dtype floating point",
        ),
        (
            lambda q, k, v: ((q, k, v), {"backend": "flash9"}),
            ValueError,
            "backend: unknown backend 'flash9'; expected 'auto' or one of",
        ),
        (
            lambda q, k, v: ((q, k, v), {"backend": "sdpa", "return_weights": True}),
            ValueError,
            "backend: 'sdpa' cannot serve this request: the fused kernel does not return",
        ),
        (
            lambda q, k, v: ((q, k, v), {"dropout_p": 1.0}),
            ValueError,
            r"dropout_p: .* \[0, 1\), got 1.0",
        ),
        (lambda q, k, v: ((q, k, v), {"window": 0}), ValueError, "window: expected a positive"),
        (
            lambda q, k, v: ((q, k, v), {"scale": float("nan")}),
            ValueError,
            "scale: expected a finite",
        ),
        (lambda q, k, v: ((q, k, v), {"causal": 1}), TypeError, "causal: expected a bool"),
    ],
)
def test_bad_input_names_the_argument_and_what_was_expected(make_call, error, match):
    args, kwargs = make_call(*_qkv())
    with pytest.raises(error, match=match):
        qkv.attention(*args, **kwargs)
    with pytest.raises(error, match=match):
        qkv.explain(*args, **kwargs)
