"""MultiHeadAttention.from_torch / to_torch against PyTorch's nn.MultiheadAttention itself.

The masks cross the border through qkv.masks' explicit converters (nn.MultiheadAttention takes
True = blocked, qkv True = may attend); outputs and per-head weights must agree in fp32.
"""

import pytest
import torch
from torch import nn

import qkv
from qkv.layers import MultiHeadAttention
from tests.layers.helpers import randomize_

E, H, B, L_Q = 16, 4, 2, 5
KINDS = {  # name: (kdim for nn.MultiheadAttention, key length)
    "self": (None, L_Q),
    "cross": (None, 7),
    "cross_kdim": (12, 7),
}


def _torch_mha(kdim, batch_first, bias=True):
    module = nn.MultiheadAttention(E, H, bias=bias, kdim=kdim, vdim=kdim, batch_first=batch_first)
    return randomize_(module, seed=1).eval()


def _run_torch(module, x, context, attn_mask, key_padding_mask):
    """nn.MultiheadAttention on batch-first inputs; returns batch-first output, per-head weights."""
    if not module.batch_first:
        x, context = x.transpose(0, 1), context.transpose(0, 1)  # (L, B, E)
    output, weights = module(
        x,
        context,
        context,
        attn_mask=attn_mask,
        key_padding_mask=key_padding_mask,
        need_weights=True,
        average_attn_weights=False,
    )
    if not module.batch_first:
        output = output.transpose(0, 1)  # (B, L_q, E)
    return output, weights


def _inputs(kind):
    kdim, L_k = KINDS[kind]
    torch.manual_seed(2)
    x = torch.randn(B, L_Q, E)
    context = x if kind == "self" else torch.randn(B, L_k, kdim or E)
    return x, context, L_k


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("masks", ["none", "causal", "padding", "both"])
def test_from_torch_matches_nn_multihead_attention(batch_first, kind, masks):
    module = _torch_mha(KINDS[kind][0], batch_first)
    layer = MultiHeadAttention.from_torch(module)
    x, context, L_k = _inputs(kind)
    causal = masks in ("causal", "both")
    padding = (
        qkv.masks.padding(torch.tensor([L_k, L_k - 3]), L_k)
        if masks in ("padding", "both")
        else None
    )
    attn_mask = qkv.masks.to_torch_attn_mask(qkv.masks.causal(L_Q, L_k)) if causal else None
    key_padding_mask = None if padding is None else qkv.masks.to_torch_key_padding_mask(padding)

    expected, expected_weights = _run_torch(module, x, context, attn_mask, key_padding_mask)
    ctx = None if kind == "self" else context
    output, weights = layer(x, ctx, mask=padding, causal=causal, return_weights=True)
    fused = layer(x, ctx, mask=padding, causal=causal)  # the sdpa backend, no weights

    torch.testing.assert_close(output, expected, atol=1e-6, rtol=0)
    torch.testing.assert_close(fused, expected, atol=1e-6, rtol=0)
    torch.testing.assert_close(weights, expected_weights, atol=1e-6, rtol=0)


@pytest.mark.parametrize("bias", [True, False])
def test_from_torch_copies_in_proj_in_q_k_v_order(bias):
    module = _torch_mha(None, True, bias=bias)
    layer = MultiHeadAttention.from_torch(module)
    w_q, w_k, w_v = module.in_proj_weight.chunk(3)
    assert torch.equal(layer.q_proj.weight, w_q)
    assert torch.equal(layer.k_proj.weight, w_k)
    assert torch.equal(layer.v_proj.weight, w_v)
    assert (layer.q_proj.bias is None) == (not bias)
    assert layer.dropout == module.dropout


@pytest.mark.parametrize("kind", list(KINDS))
def test_to_torch_round_trip(kind):
    kdim, _ = KINDS[kind]
    layer = randomize_(MultiHeadAttention(E, H, context_dim=kdim, dropout=0.1), seed=3).eval()
    module = layer.to_torch().eval()
    assert module.batch_first and module.dropout == 0.1
    x, context, L_k = _inputs(kind)
    padding = qkv.masks.padding(torch.tensor([L_k, 2]), L_k)
    expected, expected_weights = _run_torch(
        module, x, context, None, qkv.masks.to_torch_key_padding_mask(padding)
    )
    output, weights = layer(
        x, None if kind == "self" else context, mask=padding, return_weights=True
    )
    torch.testing.assert_close(output, expected, atol=1e-6, rtol=0)
    torch.testing.assert_close(weights, expected_weights, atol=1e-6, rtol=0)

    back = MultiHeadAttention.from_torch(module)
    for (name, ours), (_, again) in zip(
        layer.named_parameters(), back.named_parameters(), strict=True
    ):
        assert torch.equal(ours, again), name


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_error_within_twice_torch(dtype):
    """Against the fp64 result, qkv's error is at most twice nn.MultiheadAttention's own."""
    module = _torch_mha(None, True)
    x, context, L_k = _inputs("cross")
    padding = qkv.masks.padding(torch.tensor([L_k, 3]), L_k)
    key_padding_mask = qkv.masks.to_torch_key_padding_mask(padding)
    exact, _ = _run_torch(module.double(), x.double(), context.double(), None, key_padding_mask)
    low = module.to(dtype)
    torch_low, _ = _run_torch(low, x.to(dtype), context.to(dtype), None, key_padding_mask)
    ours = MultiHeadAttention.from_torch(low)(x.to(dtype), context.to(dtype), mask=padding)
    assert ours.dtype == dtype
    torch_error = (torch_low.double() - exact).abs().max()
    our_error = (ours.double() - exact).abs().max()
    assert our_error <= 2 * torch_error, (our_error, torch_error)
