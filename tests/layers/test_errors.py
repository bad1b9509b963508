"""Bad input fails early, with an error that names the argument, the value seen and expected."""

import pytest
import torch
from torch import nn

from qkv.layers import (
    DecoderBlock,
    EncoderBlock,
    FeedForward,
    LayerNorm,
    MultiHeadAttention,
    RMSNorm,
    SwiGLU,
)
from qkv.positional import RotaryEmbedding


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"embed_dim": 10, "num_heads": 4}, r"embed_dim: 10 is not divisible by num_heads=4"),
        (
            {"embed_dim": 16, "num_heads": 4, "num_kv_heads": 3},
            r"num_kv_heads: 3 does not divide num_heads=4",
        ),
        ({"embed_dim": 0, "num_heads": 4}, r"embed_dim: expected a positive int, got 0"),
        ({"embed_dim": 16, "num_heads": -2}, r"num_heads: expected a positive int, got -2"),
        (
            {"embed_dim": 16, "num_heads": 4, "num_kv_heads": 0},
            r"num_kv_heads: expected a positive int, got 0",
        ),
        (
            {"embed_dim": 16, "num_heads": 4, "context_dim": 0},
            r"context_dim: expected a positive int, got 0",
        ),
        ({"embed_dim": 16, "num_heads": 4, "dropout": 1.0}, r"dropout: .*\[0, 1\), got 1.0"),
        ({"embed_dim": 16, "num_heads": 4, "dropout": -0.1}, r"dropout: .*\[0, 1\), got -0.1"),
        (
            {"embed_dim": 16, "num_heads": 4, "rope": RotaryEmbedding(8)},
            r"rope: built for head_dim=8, expected head_dim=4",
        ),
    ],
)
def test_multihead_attention_constructor_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MultiHeadAttention(**kwargs)


def test_multihead_attention_type_errors():
    with pytest.raises(TypeError, match=r"num_heads: expected a positive int, got float 4.0"):
        MultiHeadAttention(16, 4.0)
    with pytest.raises(TypeError, match=r"alibi: expected a bool"):
        MultiHeadAttention(16, 4, alibi="yes")
    with pytest.raises(TypeError, match=r"rope: expected a qkv.positional.RotaryEmbedding"):
        MultiHeadAttention(16, 4, rope="rope")


def test_multihead_attention_call_errors():
    layer = MultiHeadAttention(16, 4)
    x = torch.randn(2, 5, 16)
    with pytest.raises(ValueError, match=r"x: expected shape \(B, L, 16\), got \(2, 5, 8\)"):
        layer(torch.randn(2, 5, 8))
    with pytest.raises(ValueError, match=r"x: expected shape \(B, L, 16\), got \(5, 16\)"):
        layer(torch.randn(5, 16))
    with pytest.raises(ValueError, match=r"context: expected batch size 2 \(that of x\), got 3"):
        layer(x, torch.randn(3, 4, 16))
    with pytest.raises(ValueError, match=r"context: expected shape \(B, L, 16\), got"):
        layer(x, torch.randn(2, 4, 12))
    with pytest.raises(ValueError, match=r"positions: given, but this layer has no rope"):
        layer(x, positions=torch.arange(5))
    with pytest.raises(ValueError, match=r"mask: shape \(3, 5\) does not broadcast"):
        layer(x, mask=torch.ones(3, 5, dtype=torch.bool))


@pytest.mark.parametrize("positional", ["rope", "alibi"])
def test_cross_attention_with_rope_or_alibi_is_refused(positional):
    options = {"rope": RotaryEmbedding(4)} if positional == "rope" else {"alibi": True}
    layer = MultiHeadAttention(16, 4, **options)
    with pytest.raises(ValueError, match=r"context: cross-attention with rope or alibi"):
        layer(torch.randn(2, 5, 16), torch.randn(2, 3, 16))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"add_bias_kv": True}, r"add_bias_kv=True is not supported"),
        ({"add_zero_attn": True}, r"add_zero_attn=True is not supported"),
        ({"kdim": 8, "vdim": 12}, r"kdim=8 and vdim=12 differ"),
    ],
)
def test_from_torch_refuses_what_it_cannot_model(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MultiHeadAttention.from_torch(nn.MultiheadAttention(16, 4, **kwargs))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_kv_heads": 2}, r"num_kv_heads=2 != num_heads=4 \(nn.MultiheadAttention has no GQA"),
        ({"rope": RotaryEmbedding(4)}, r"rope is set"),
        ({"alibi": True}, r"alibi=True"),
    ],
)
def test_to_torch_only_for_plain_mha(kwargs, match):
    with pytest.raises(
        ValueError, match=r"to_torch: expected plain multi-head attention.*" + match
    ):
        MultiHeadAttention(16, 4, **kwargs).to_torch()


def test_feedforward_and_norm_errors():
    with pytest.raises(ValueError, match=r"activation: expected one of .*'gelu'.*, got 'tanh'"):
        FeedForward(16, 32, activation="tanh")
    with pytest.raises(ValueError, match=r"hidden_dim: expected a positive int, got 0"):
        FeedForward(16, 0)
    with pytest.raises(ValueError, match=r"dropout: expected a probability in \[0, 1\), got 1.5"):
        FeedForward(16, 32, dropout=1.5)
    with pytest.raises(ValueError, match=r"embed_dim: expected a positive int, got -1"):
        SwiGLU(-1, 8)
    with pytest.raises(ValueError, match=r"eps: expected a positive float, got 0.0"):
        LayerNorm(16, eps=0.0)
    with pytest.raises(ValueError, match=r"x: expected a last axis of size 16, got shape \(2, 8\)"):
        RMSNorm(16)(torch.randn(2, 8))


def test_block_errors():
    with pytest.raises(ValueError, match=r"embed_dim: 18 is not divisible by num_heads=4"):
        EncoderBlock(18, 4, 32)
    with pytest.raises(ValueError, match=r"activation: expected one of"):
        DecoderBlock(16, 4, 32, activation="swish")
    with pytest.raises(TypeError, match=r"norm_first: expected a bool"):
        EncoderBlock(16, 4, 32, norm_first=1)
    custom = nn.TransformerEncoderLayer(16, 4, 32, activation=torch.tanh, batch_first=True)
    with pytest.raises(ValueError, match=r"activation: expected F.relu, F.gelu"):
        EncoderBlock.from_torch(custom)
