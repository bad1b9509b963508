"""LatentPooling against PyTorch: the Perceiver's cross-attend block written with
`nn.MultiheadAttention` (kdim = vdim = input_dim), `F.layer_norm` and `F.gelu`, followed by
`nn.TransformerEncoderLayer`s (pre-norm) as the latent blocks, all with the same weights."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from qkv.layers import EncoderBlock, LatentPooling

E, H, N, INPUT_DIM, FFN = 8, 2, 3, 6, 16


def _layer_norm(module, x):
    return F.layer_norm(x, module.weight.shape, module.weight, module.bias, module.eps)


def _torch_cross_attention(pool: LatentPooling) -> nn.MultiheadAttention:
    """nn.MultiheadAttention with separate q/k/v weights, copied from the pool's."""
    attn = pool.cross_attn
    mha = nn.MultiheadAttention(E, H, kdim=INPUT_DIM, vdim=INPUT_DIM, batch_first=True,
                                dtype=torch.float64)  # fmt: skip
    with torch.no_grad():
        mha.q_proj_weight.copy_(attn.q_proj.weight)
        mha.k_proj_weight.copy_(attn.k_proj.weight)
        mha.v_proj_weight.copy_(attn.v_proj.weight)
        mha.in_proj_bias.copy_(torch.cat([attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias]))
        mha.out_proj.weight.copy_(attn.out_proj.weight)
        mha.out_proj.bias.copy_(attn.out_proj.bias)
    return mha


def _reference(pool, torch_layers, x, mask=None):
    """The Perceiver's cross-attend block and latent Transformer, in PyTorch's modules."""
    latents = pool.latents.expand(x.shape[0], -1, -1)
    context = _layer_norm(pool.input_norm, x)
    padding = None if mask is None else ~mask  # PyTorch: True = ignore this key
    attended, weights = _torch_cross_attention(pool)(
        _layer_norm(pool.latent_norm, latents), context, context, key_padding_mask=padding,
        average_attn_weights=False,
    )  # fmt: skip
    z = latents + attended
    ffn = pool.ffn
    hidden = F.gelu(F.linear(_layer_norm(pool.ffn_norm, z), ffn.up_proj.weight, ffn.up_proj.bias))
    z = z + F.linear(hidden, ffn.down_proj.weight, ffn.down_proj.bias)
    for layer in torch_layers:
        z = layer(z)
    return _layer_norm(pool.output_norm, z), weights


def _pool_and_torch_layers(num_blocks, seed=0):
    torch.manual_seed(seed)
    pool = LatentPooling(E, H, num_latents=N, input_dim=INPUT_DIM, ffn_dim=FFN,
                         num_blocks=num_blocks).double()  # fmt: skip
    layers = [
        nn.TransformerEncoderLayer(
            E,
            H,
            FFN,
            dropout=0.0,
            activation="gelu",
            norm_first=True,
            batch_first=True,
            dtype=torch.float64,
        )  # fmt: skip
        for _ in range(num_blocks)
    ]
    for index, layer in enumerate(layers):
        pool.blocks[index] = EncoderBlock.from_torch(layer)  # the same weights as PyTorch's
    for module in (pool.latent_norm, pool.input_norm, pool.ffn_norm, pool.output_norm):
        with torch.no_grad():  # non-trivial affine parameters, so that a mix-up shows
            module.weight.uniform_(0.5, 1.5)
            module.bias.uniform_(-0.5, 0.5)
    return pool.eval(), [layer.eval() for layer in layers]


@pytest.mark.parametrize("num_blocks", [0, 2])
def test_equals_pytorch_cross_attention_ffn_and_encoder_layers(num_blocks):
    pool, layers = _pool_and_torch_layers(num_blocks)
    x = torch.randn(2, 5, INPUT_DIM, dtype=torch.float64)
    expected, expected_weights = _reference(pool, layers, x)
    out, weights = pool(x, return_weights=True)
    assert out.shape == (2, N, E) and weights.shape == (2, H, N, 5)
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(weights, expected_weights, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(pool(x), out, rtol=1e-12, atol=1e-12)  # the backend may differ


def test_padding_mask_equals_pytorchs_key_padding_mask_and_dropping_the_padding():
    pool, layers = _pool_and_torch_layers(1, seed=1)
    x = torch.randn(2, 6, INPUT_DIM, dtype=torch.float64)
    mask = torch.tensor([[True] * 6, [True] * 4 + [False] * 2])
    expected, _ = _reference(pool, layers, x, mask)
    out, weights = pool(x, mask=mask, return_weights=True)
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-10)
    assert torch.all(weights[1, :, :, 4:] == 0)
    torch.testing.assert_close(out[1:], pool(x[1:, :4]), rtol=1e-10, atol=1e-10)


def test_the_latents_are_trained_and_start_small():
    torch.manual_seed(0)
    pool = LatentPooling(E, H, num_latents=N)
    latents = pool.latents.detach()
    assert latents.shape == (N, E) and float(latents.abs().max()) <= 2.0
    assert 0.005 < float(latents.std()) < 0.05
    out = pool(torch.randn(2, 5, E))  # (2, N, E), layer-normed: each row sums to the bias's sum
    (out * torch.randn_like(out)).sum().backward()  # a plain .sum() has a zero gradient
    assert pool.latents.grad is not None and float(pool.latents.grad.abs().sum()) > 0


def test_bad_inputs_name_the_argument():
    pool = LatentPooling(E, H, input_dim=INPUT_DIM)
    with pytest.raises(ValueError, match=rf"x: expected shape \(B, L, {INPUT_DIM}\)"):
        pool(torch.randn(2, 5, E))
    with pytest.raises(ValueError, match=r"mask: expected shape \(2, 5\)"):
        pool(torch.randn(2, 5, INPUT_DIM), mask=torch.ones(2, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="num_latents"):
        LatentPooling(E, H, num_latents=0)
    with pytest.raises(ValueError, match="num_blocks"):
        LatentPooling(E, H, num_blocks=-1)
    with pytest.raises(ValueError, match="embed_dim"):
        LatentPooling(E, 3)
