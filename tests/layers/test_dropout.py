"""Dropout in the layers: off in eval mode, on in train mode, and statistically right.

Attention dropout acts on the weights after the softmax: each weight is zeroed
with probability p and the survivors are scaled by 1 / (1 - p), so a row sums to 1 only in
expectation. The checks are statistical, with a fixed seed and bounds of several sigma.
"""

import pytest
import torch
import torch.nn.functional as F

from qkv.layers import DecoderBlock, EncoderBlock, FeedForward, MultiHeadAttention


def _layers():
    return {
        "attention": (MultiHeadAttention(16, 4, 2, dropout=0.5), ()),
        "feedforward": (FeedForward(16, 32, dropout=0.5), ()),
        "encoder": (EncoderBlock(16, 4, 32, dropout=0.5), ()),
        "decoder": (DecoderBlock(16, 4, 32, dropout=0.5, norm_first=True), ("memory",)),
    }


@pytest.mark.parametrize("name", ["attention", "feedforward", "encoder", "decoder"])
def test_eval_is_deterministic_and_train_is_not(name):
    torch.manual_seed(30)
    layer, extra = _layers()[name]
    x = torch.randn(2, 6, 16)
    args = (x, torch.randn(2, 5, 16)) if extra else (x,)
    layer.eval()
    first, second = layer(*args), layer(*args)
    assert torch.equal(first, second)
    layer.train()
    third, fourth = layer(*args), layer(*args)
    assert not torch.allclose(third, fourth)
    assert not torch.allclose(third, first)


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_attention_dropout_zeroes_weights_with_probability_p(p):
    torch.manual_seed(31)
    layer = MultiHeadAttention(8, 2, dropout=p)
    x = torch.randn(64, 16, 8)  # 64 * 2 heads * 16 queries = 2048 rows of 16 weights
    clean = layer.eval()(x, return_weights=True)[1]
    output, dropped = layer.train()(x, return_weights=True)
    kept = dropped != 0
    n = kept.numel()
    zero_fraction = 1.0 - kept.float().mean().item()
    assert abs(zero_fraction - p) < 6 * (p * (1 - p) / n) ** 0.5  # binomial, 6 sigma
    # The survivors are the clean weights scaled by 1 / (1 - p) (inverted dropout).
    torch.testing.assert_close(dropped[kept], clean[kept] / (1 - p))
    # Row sums are 1 in expectation, not per row.
    row_sums = dropped.sum(dim=-1)  # (B, H, L_q)
    assert not torch.allclose(row_sums, torch.ones_like(row_sums))
    row_std = ((clean.pow(2).sum(-1) * p / (1 - p)).mean() / row_sums.numel()).sqrt()
    assert abs(row_sums.mean().item() - 1.0) < 6 * row_std.item()
    # The returned weights are the ones that multiplied V.
    B, L, _ = x.shape
    v = F.linear(x, layer.v_proj.weight, layer.v_proj.bias).view(B, L, 2, 4).transpose(1, 2)
    mixed = (dropped @ v).transpose(1, 2).reshape(B, L, 8)  # (B, L, E)
    expected = F.linear(mixed, layer.out_proj.weight, layer.out_proj.bias)
    torch.testing.assert_close(output, expected, atol=1e-5, rtol=1e-5)
