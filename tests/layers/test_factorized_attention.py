"""Factorised space-time attention against full attention under block masks.

The outside reference is `torch.nn.functional.scaled_dot_product_attention` over all T * N
tokens of a clip with a dense boolean mask (True = attend, SDPA's polarity and qkv's), the
projections done by hand with `F.linear` on the layer's own weights: spatial attention (one
sequence per frame) equals it under "same frame", temporal attention (one sequence per patch
position) under "same patch position", forward and gradients, in float64. The blocks are
checked against the same reference composed with `F.layer_norm` and an eager FFN, and the
joint block against `nn.TransformerEncoderLayer`.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from qkv.layers import EncoderBlock, MultiHeadAttention
from qkv.layers.factorized_attention import (
    FactorizedBlock,
    SpaceTimeBlock,
    same_frame_mask,
    same_position_mask,
    spatial_attention,
    temporal_attention,
)
from tests.layers.helpers import randomize_

B, T, N, E, H, FFN = 2, 3, 5, 8, 2, 16


def _sdpa_reference(attention: MultiHeadAttention, tokens: torch.Tensor, mask: torch.Tensor):
    """Full multi-head attention over tokens (B, L, E) under a dense bool mask (L, L), from the
    layer's weights, through PyTorch's SDPA."""
    B_, L, _ = tokens.shape
    D = attention.head_dim

    def heads(projection: nn.Linear) -> torch.Tensor:
        projected = F.linear(tokens, projection.weight, projection.bias)  # (B, L, H * D)
        return projected.view(B_, L, -1, D).transpose(1, 2)  # (B, H, L, D)

    q, k, v = heads(attention.q_proj), heads(attention.k_proj), heads(attention.v_proj)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # (B, H, L, D)
    out = out.transpose(1, 2).reshape(B_, L, -1)  # (B, L, H * D)
    return F.linear(out, attention.out_proj.weight, attention.out_proj.bias)


def _layer(seed: int) -> MultiHeadAttention:
    torch.manual_seed(seed)
    return randomize_(MultiHeadAttention(E, H), seed=seed).double()


def _video(seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(B, T, N, E, generator=generator, dtype=torch.float64)


def test_masks_equal_their_definitions_token_by_token():
    """Token i is patch i % N of frame i // N; checked against a loop over all pairs."""
    frame, position = same_frame_mask(T, N), same_position_mask(T, N)
    assert frame.shape == position.shape == (T * N, T * N)
    assert frame.dtype == position.dtype == torch.bool
    for i in range(T * N):
        for j in range(T * N):
            assert bool(frame[i, j]) == (i // N == j // N)
            assert bool(position[i, j]) == (i % N == j % N)
    assert int(frame.sum()) == T * N * N and int(position.sum()) == N * T * T
    assert torch.equal(frame & position, torch.eye(T * N, dtype=torch.bool))


@pytest.mark.parametrize(
    ("factorised", "mask"),
    [(spatial_attention, same_frame_mask), (temporal_attention, same_position_mask)],
    ids=["spatial", "temporal"],
)
def test_factorised_attention_equals_masked_full_attention_forward_and_backward(factorised, mask):
    attention = _layer(1)
    x = _video(2).requires_grad_(True)
    reference_x = x.detach().clone().requires_grad_(True)
    output = factorised(attention, x)  # (B, T, N, E)
    tokens = reference_x.reshape(B, T * N, E)  # frame by frame
    expected = _sdpa_reference(attention, tokens, mask(T, N)).view(B, T, N, E)
    torch.testing.assert_close(output, expected, rtol=1e-10, atol=1e-10)

    upstream = torch.randn(B, T, N, E, dtype=torch.float64)
    weights = list(attention.parameters())
    grads = torch.autograd.grad(output, [x, *weights], upstream)
    expected_grads = torch.autograd.grad(expected, [reference_x, *weights], upstream)
    for got, want in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_the_layer_under_the_mask_computes_the_same_as_the_reshape():
    """qkv's own masked path (MultiHeadAttention(mask=...)) agrees too, and the two masks
    differ: spatial and temporal attention are different functions."""
    attention, x = _layer(3), _video(4)
    tokens = x.reshape(B, T * N, E)
    for factorised, mask in ((spatial_attention, same_frame_mask),
                             (temporal_attention, same_position_mask)):  # fmt: skip
        masked = attention(tokens, mask=mask(T, N)).view(B, T, N, E)
        torch.testing.assert_close(factorised(attention, x), masked, rtol=1e-10, atol=1e-10)
    assert not torch.allclose(spatial_attention(attention, x), temporal_attention(attention, x))


def _reference_ffn(block: FactorizedBlock, h: torch.Tensor) -> torch.Tensor:
    up, down = block.ffn.up_proj, block.ffn.down_proj
    return F.linear(F.gelu(F.linear(h, up.weight, up.bias)), down.weight, down.bias)


def _layer_norm(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return F.layer_norm(x, (E,), norm.weight, norm.bias, eps=1e-6)


def test_factorized_block_equals_the_masked_reference_block_forward_and_backward():
    """ViViT model 3 written out over all T * N tokens: x + attn_frame(LN(x)), then
    x + attn_position(LN(x)), then x + FFN(LN(x)), with SDPA under the two masks."""
    torch.manual_seed(5)
    block = randomize_(FactorizedBlock(E, H, FFN), seed=5).double().eval()
    x = _video(6).requires_grad_(True)
    reference_x = x.detach().clone().requires_grad_(True)
    tokens = reference_x.reshape(B, T * N, E)
    tokens = tokens + _sdpa_reference(block.spatial_attn, _layer_norm(block.norm1, tokens),
                                      same_frame_mask(T, N))  # fmt: skip
    tokens = tokens + _sdpa_reference(block.temporal_attn, _layer_norm(block.norm2, tokens),
                                      same_position_mask(T, N))  # fmt: skip
    tokens = tokens + _reference_ffn(block, _layer_norm(block.norm3, tokens))
    output = block(x)
    torch.testing.assert_close(output, tokens.view(B, T, N, E), rtol=1e-10, atol=1e-10)
    upstream = torch.randn(B, T, N, E, dtype=torch.float64)
    (got,) = torch.autograd.grad(output, x, upstream)
    (want,) = torch.autograd.grad(tokens.view(B, T, N, E), reference_x, upstream)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_space_time_block_equals_transformer_encoder_layer_over_all_tokens():
    reference = nn.TransformerEncoderLayer(
        E, H, dim_feedforward=FFN, dropout=0.0, activation="gelu", batch_first=True,
        norm_first=True, layer_norm_eps=1e-6,
    )  # fmt: skip
    reference = randomize_(reference, seed=7).eval()
    block = SpaceTimeBlock(E, H, FFN).eval()
    block.block.load_state_dict(EncoderBlock.from_torch(reference).state_dict())
    x = _video(8).float()
    expected = reference(x.reshape(B, T * N, E)).view(B, T, N, E)
    torch.testing.assert_close(block(x), expected, rtol=1e-5, atol=1e-5)


def test_frames_and_positions_are_not_mixed_up():
    """Changing one frame moves spatial attention's output in that frame only; changing one
    patch position moves temporal attention's output at that position only."""
    attention, x = _layer(9), _video(10)
    changed = x.clone()
    changed[:, 1] += 1.0  # frame 1
    moved = (spatial_attention(attention, changed) - spatial_attention(attention, x)).abs()
    assert moved[:, 1].amax() > 1e-3 and moved[:, [0, 2]].amax() == 0
    changed = x.clone()
    changed[:, :, 3] += 1.0  # patch position 3 of every frame
    moved = (temporal_attention(attention, changed) - temporal_attention(attention, x)).abs()
    assert moved[:, :, 3].amax() > 1e-3 and moved[:, :, [0, 1, 2, 4]].amax() == 0


@pytest.mark.parametrize(
    ("call", "named"),
    [
        (lambda: same_frame_mask(0, 4), "num_frames"),
        (lambda: same_position_mask(3, -1), "num_patches"),
        (lambda: spatial_attention(MultiHeadAttention(E, H), torch.randn(2, 3, E)), "x"),
        (lambda: temporal_attention(MultiHeadAttention(E, H), torch.randn(1, 2, 3, E + 1)), "x"),
        (lambda: FactorizedBlock(E, H, FFN)(torch.randn(2, 3, E)), "x"),
    ],
)
def test_bad_input_names_the_argument(call, named):
    with pytest.raises(ValueError, match=f"^{named}: "):
        call()
