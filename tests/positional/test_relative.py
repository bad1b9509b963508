"""Relative positions: T5's bias against transformers' T5Attention, Shaw et al.'s relative keys
against the paper's equations written out in float64."""

import math

import pytest
import torch
import transformers
from transformers.models.t5.modeling_t5 import T5Attention

import qkv
from qkv.positional.relative import ShawRelativeKeys, T5RelativeBias, t5_relative_bucket


@pytest.mark.parametrize("bidirectional", [True, False])
@pytest.mark.parametrize(("num_buckets", "max_distance"), [(32, 128), (16, 40), (8, 20)])
def test_t5_buckets_equal_transformers(bidirectional, num_buckets, max_distance):
    offset = torch.arange(-300, 301).view(-1, 1) + torch.tensor([[0, 7]])
    ours = t5_relative_bucket(offset, bidirectional=bidirectional, num_buckets=num_buckets,
                              max_distance=max_distance)  # fmt: skip
    theirs = T5Attention._relative_position_bucket(
        offset, bidirectional=bidirectional, num_buckets=num_buckets, max_distance=max_distance
    )
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize("bidirectional", [True, False])
def test_t5_bucket_counts_the_formula_cannot_divide_by_are_refused(bidirectional):
    """transformers' bucket formula divides by num_buckets // 4 (bidirectional) or // 2, and by
    ln(max_distance / that): below 4 (or 2) buckets it raises ZeroDivisionError, and with
    max_distance at most that it gives negative buckets. qkv refuses both when built, naming the
    argument, and equals transformers from the smallest valid values on."""
    minimum = 4 if bidirectional else 2
    offset = torch.arange(-300, 301)
    for num_buckets in range(1, minimum):
        with pytest.raises(ZeroDivisionError):
            T5Attention._relative_position_bucket(
                offset, bidirectional=bidirectional, num_buckets=num_buckets, max_distance=128
            )
        with pytest.raises(ValueError, match=f"num_buckets: expected at least {minimum} "):
            T5RelativeBias(2, bidirectional=bidirectional, num_buckets=num_buckets)
    exact = 1  # num_buckets // minimum, for num_buckets = minimum
    broken = T5Attention._relative_position_bucket(
        offset, bidirectional=bidirectional, num_buckets=minimum, max_distance=exact
    )
    assert broken.min() < 0
    with pytest.raises(ValueError, match="max_distance: expected more than .* = 1"):
        T5RelativeBias(2, bidirectional=bidirectional, num_buckets=minimum, max_distance=exact)
    for num_buckets, max_distance in ((minimum, 2), (minimum + 1, 3), (minimum, 128)):
        module = T5RelativeBias(2, bidirectional=bidirectional, num_buckets=num_buckets,
                                max_distance=max_distance)  # fmt: skip
        theirs = T5Attention._relative_position_bucket(
            offset, bidirectional=bidirectional, num_buckets=num_buckets, max_distance=max_distance
        )
        assert torch.equal(module.buckets(offset), theirs)
        assert module(5, 9).shape == (1, 2, 5, 9)


@pytest.mark.parametrize("is_decoder", [False, True])
def test_t5_bias_equals_transformers_compute_bias(is_decoder):
    config = transformers.T5Config(d_model=32, d_kv=8, num_heads=4, is_decoder=is_decoder,
                                   relative_attention_num_buckets=16,
                                   relative_attention_max_distance=40)  # fmt: skip
    torch.manual_seed(0)
    theirs = T5Attention(config, has_relative_attention_bias=True)
    ours = T5RelativeBias(4, bidirectional=not is_decoder, num_buckets=16, max_distance=40)
    ours.relative_attention_bias.weight.data.copy_(theirs.relative_attention_bias.weight)
    torch.testing.assert_close(ours(50, 50), theirs.compute_bias(50, 50), rtol=0, atol=0)
    # a decoding step: 3 new queries after 47 cached keys, aligned bottom-right
    expected = theirs.compute_bias(3, 50, past_seen_tokens=47)
    torch.testing.assert_close(ours(3, 50), expected, rtol=0, atol=0)


def test_t5_score_mod_equals_the_dense_bias_on_tiles_and_flex():
    torch.manual_seed(1)
    module = T5RelativeBias(4, bidirectional=True, num_buckets=16, max_distance=40)
    q, k, v = (torch.randn(2, 4, n, 8) for n in (70, 90, 90))
    expected = qkv.attention(q, k, v, bias=module(70, 90), backend="reference")
    tiled = qkv.flash_attention(q, k, v, score_mod=module.score_mod(70, 90), block_q=32,
                                block_k=32)  # fmt: skip
    torch.testing.assert_close(tiled, expected, atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        flex = qkv.attention(q, k, v, score_mod=module.score_mod(70, 90), backend="flex")
    torch.testing.assert_close(flex, expected.detach(), atol=1e-5, rtol=1e-5)


def test_t5_score_mod_gradients_reach_the_table_as_the_dense_bias_does():
    """On the tiled backend, the table a score_mod captures gets the gradient the dense
    (1, H, L_q, L_k) bias gives it through autograd; so do q, k and v. Causal, GQA, tiles that
    do not divide L. (FlexAttention has no backward on the CPU.)"""
    torch.manual_seed(3)
    module = T5RelativeBias(4, bidirectional=False, num_buckets=16, max_distance=40).double()
    q = torch.randn(2, 4, 37, 8, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(2, 2, 45, 8, dtype=torch.float64, requires_grad=True) for _ in "kv")
    upstream = torch.randn(2, 4, 37, 8, dtype=torch.float64)
    inputs = (q, k, v, module.relative_attention_bias.weight)
    dense = qkv.attention(q, k, v, bias=module(37, 45), causal=True, backend="reference")
    expected = torch.autograd.grad((dense * upstream).sum(), inputs)
    output = qkv.flash_attention(
        q, k, v, causal=True, score_mod=module.score_mod(37, 45), block_q=16, block_k=16
    )
    got = torch.autograd.grad((output * upstream).sum(), inputs)
    torch.testing.assert_close(output, dense)
    for grad, want in zip(got, expected, strict=True):
        torch.testing.assert_close(grad, want)
    assert expected[3].abs().sum() > 0


def shaw_eager(q, k, v, relative_keys, max_distance):
    """Shaw et al. 2018, eq. 4-5 with relative keys: e_ij = (q_i . k_j + q_i . a_ij) / sqrt(d),
    a_ij = w_{clip(j - i, k)}; written score by score in float64."""
    B, H, L_q, D = q.shape
    L_k = k.shape[2]
    scores = torch.empty(B, H, L_q, L_k, dtype=torch.float64)
    for i in range(L_q):
        position = i + L_k - L_q
        for j in range(L_k):
            a = relative_keys[max(-max_distance, min(max_distance, j - position)) + max_distance]
            scores[:, :, i, j] = (q[:, :, i] * (k[:, :, j] + a)).sum(-1) / math.sqrt(D)
    return torch.softmax(scores, dim=-1) @ v


def test_shaw_relative_keys_equal_the_papers_equations():
    torch.manual_seed(2)
    module = ShawRelativeKeys(8, max_distance=3).double()
    q = torch.randn(2, 2, 6, 8, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(2, 2, 9, 8, dtype=torch.float64) for _ in "kv")
    output = qkv.attention(q, k, v, bias=module(q, 9))
    expected = shaw_eager(q, k, v, module.relative_keys, 3)
    torch.testing.assert_close(output, expected)
    grads = torch.autograd.grad(output.sum(), (q, module.relative_keys))
    expected_grads = torch.autograd.grad(expected.sum(), (q, module.relative_keys))
    for got, want in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(got, want)
    tiled = qkv.flash_attention(q, k, v, score_mod=module.score_mod(q, 9), block_q=4, block_k=4)
    torch.testing.assert_close(tiled, expected)
    tiled_grads = torch.autograd.grad(tiled.sum(), (q, module.relative_keys))
    for got, want in zip(tiled_grads, expected_grads, strict=True):
        torch.testing.assert_close(got, want)


def test_bad_relative_arguments_name_the_argument():
    with pytest.raises(ValueError, match="max_distance"):
        T5RelativeBias(4, bidirectional=True, num_buckets=32, max_distance=8)
    with pytest.raises(TypeError, match="bidirectional"):
        T5RelativeBias(4, bidirectional=1)
    with pytest.raises(ValueError, match="max_distance"):
        ShawRelativeKeys(8, max_distance=0)
