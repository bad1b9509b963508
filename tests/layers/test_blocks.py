"""EncoderBlock / DecoderBlock (from_torch) against nn.TransformerEncoderLayer / DecoderLayer.

Post-norm ("Add & Norm", Vaswani et al. 2017) and pre-norm, ReLU and GELU, with padding and
causal masks, in eval mode. PyTorch's masks are built from qkv's with the explicit converters.
"""

import pytest
import torch
from torch import nn

import qkv
from qkv.layers import DecoderBlock, EncoderBlock
from tests.layers.helpers import randomize_

E, H, FFN, B, L, L_MEM = 16, 4, 32, 3, 6, 8
TGT_LENGTHS, MEM_LENGTHS = torch.tensor([6, 4, 1]), torch.tensor([8, 5, 2])


def _torch_layer(cls, norm_first, activation, batch_first=True, bias=True):
    layer = cls(
        E,
        H,
        dim_feedforward=FFN,
        dropout=0.1,
        activation=activation,
        batch_first=batch_first,
        norm_first=norm_first,
        layer_norm_eps=1e-6,
        bias=bias,
    )
    return randomize_(layer, seed=11).eval()


@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
@pytest.mark.parametrize("causal", [False, True])
def test_encoder_block_matches_transformer_encoder_layer(norm_first, activation, causal):
    reference = _torch_layer(nn.TransformerEncoderLayer, norm_first, activation)
    block = EncoderBlock.from_torch(reference).eval()
    assert block.norm_first == norm_first and block.ffn.activation == activation
    torch.manual_seed(12)
    x = torch.randn(B, L, E)
    padding = qkv.masks.padding(TGT_LENGTHS, L)
    expected = reference(
        x,
        src_mask=qkv.masks.to_torch_attn_mask(qkv.masks.causal(L)) if causal else None,
        src_key_padding_mask=qkv.masks.to_torch_key_padding_mask(padding),
    )
    output = block(x, mask=padding, causal=causal)
    torch.testing.assert_close(output, expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_decoder_block_matches_transformer_decoder_layer(norm_first, activation):
    reference = _torch_layer(nn.TransformerDecoderLayer, norm_first, activation)
    block = DecoderBlock.from_torch(reference).eval()
    torch.manual_seed(13)
    x, memory = torch.randn(B, L, E), torch.randn(B, L_MEM, E)
    tgt_padding = qkv.masks.padding(TGT_LENGTHS, L)
    memory_padding = qkv.masks.padding(MEM_LENGTHS, L_MEM)
    expected = reference(
        x,
        memory,
        tgt_mask=qkv.masks.to_torch_attn_mask(qkv.masks.causal(L)),
        tgt_key_padding_mask=qkv.masks.to_torch_key_padding_mask(tgt_padding),
        memory_key_padding_mask=qkv.masks.to_torch_key_padding_mask(memory_padding),
    )
    output = block(x, memory, mask=tgt_padding, memory_mask=memory_padding)
    torch.testing.assert_close(output, expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("cls", [nn.TransformerEncoderLayer, nn.TransformerDecoderLayer])
def test_from_torch_sequence_first_layer_without_biases(cls):
    """batch_first=False and bias=False: the weights are the same, the block is batch-first."""
    reference = _torch_layer(cls, norm_first=True, activation="gelu", batch_first=False, bias=False)
    torch.manual_seed(14)
    x, memory = torch.randn(B, L, E), torch.randn(B, L_MEM, E)
    if cls is nn.TransformerEncoderLayer:
        block = EncoderBlock.from_torch(reference).eval()
        expected = reference(x.transpose(0, 1))
        output = block(x)
    else:
        block = DecoderBlock.from_torch(reference).eval()
        expected = reference(x.transpose(0, 1), memory.transpose(0, 1))
        output = block(x, memory, causal=False)
    assert block.norm1.bias is None and block.ffn.up_proj.bias is None
    torch.testing.assert_close(output, expected.transpose(0, 1), atol=1e-5, rtol=0)
