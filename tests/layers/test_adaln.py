"""adaLN-Zero (Peebles & Xie 2023, DiT s3.2): the block against an eager float64 formula
written from the paper (shift, scale and gate from SiLU + Linear of the condition, LayerNorm
without affine, softmax attention by hand), and the identity at initialisation."""

import math

import pytest
import torch
import torch.nn.functional as F

from qkv.layers import AdaLNModulation, AdaLNZeroBlock

E, H, FFN = 16, 2, 24


def _randomised(block: AdaLNZeroBlock, seed: int) -> AdaLNZeroBlock:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in block.parameters():
            parameter.copy_(0.3 * torch.randn(parameter.shape, generator=generator))
    return block


def _layer_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    mean = x.mean(-1, keepdim=True)
    variance = ((x - mean) ** 2).mean(-1, keepdim=True)
    return (x - mean) / torch.sqrt(variance + eps)


def _attention(layer, x: torch.Tensor, source: torch.Tensor, keep: torch.Tensor | None):
    """softmax(Q K^T / sqrt(D)) V per head, then the output projection, by hand."""
    B, L, _ = x.shape
    D = E // H
    q = (x @ layer.q_proj.weight.T + layer.q_proj.bias).view(B, L, H, D).transpose(1, 2)
    k = (source @ layer.k_proj.weight.T + layer.k_proj.bias).view(B, -1, H, D).transpose(1, 2)
    v = (source @ layer.v_proj.weight.T + layer.v_proj.bias).view(B, -1, H, D).transpose(1, 2)
    scores = q @ k.transpose(-1, -2) / math.sqrt(D)  # (B, H, L, S)
    if keep is not None:
        scores = scores.masked_fill(~keep[:, None, None, :], float("-inf"))
    heads = torch.softmax(scores, dim=-1) @ v  # (B, H, L, D)
    joined = heads.transpose(1, 2).reshape(B, L, E)
    return joined @ layer.out_proj.weight.T + layer.out_proj.bias


def _eager_block(block: AdaLNZeroBlock, x, cond, context, keep):
    eps = block.eps
    proj = block.modulation.proj
    chunks = (F.silu(cond) @ proj.weight.T + proj.bias)[:, None, :].split(E, dim=-1)
    shift1, scale1, gate1, shift2, scale2, gate2, shift3, scale3, gate3 = chunks
    h = _layer_norm(x, eps) * (1 + scale1) + shift1
    x = x + gate1 * _attention(block.self_attn, h, h, None)
    h = _layer_norm(x, eps) * (1 + scale2) + shift2
    x = x + gate2 * _attention(block.cross_attn, h, context, keep)
    h = _layer_norm(x, eps) * (1 + scale3) + shift3
    ffn = block.ffn
    hidden = F.gelu(h @ ffn.up_proj.weight.T + ffn.up_proj.bias)
    return x + gate3 * (hidden @ ffn.down_proj.weight.T + ffn.down_proj.bias)


def _inputs(seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn((2, 5, E), generator=generator, dtype=torch.float64)
    cond = torch.randn((2, E), generator=generator, dtype=torch.float64)
    context = torch.randn((2, 4, E), generator=generator, dtype=torch.float64)
    keep = torch.tensor([[True, True, True, True], [True, True, False, False]])
    return x, cond, context, keep


def test_block_is_the_dit_formula():
    block = _randomised(AdaLNZeroBlock(E, H, FFN), seed=1).double().eval()
    x, cond, context, keep = _inputs()
    got = block(x, cond, context, context_mask=keep[:, None, None, :])
    torch.testing.assert_close(got, _eager_block(block, x, cond, context, keep), rtol=1e-10,
                               atol=1e-10)  # fmt: skip


def test_zero_initialised_gates_make_the_block_the_identity():
    torch.manual_seed(0)
    block = AdaLNZeroBlock(E, H, FFN).double()
    assert torch.equal(block.modulation.proj.weight, torch.zeros_like(block.modulation.proj.weight))
    x, cond, context, keep = _inputs(seed=2)
    assert torch.equal(block(x, cond, context, context_mask=keep[:, None, None, :]), x)
    # and its gradient still reaches the gates: training moves them off zero
    block(x, cond, context).sum().backward()
    assert block.modulation.proj.weight.grad.abs().sum() > 0


def test_modulation_chunks_in_order():
    modulation = AdaLNModulation(3, 4, 2)
    with torch.no_grad():
        modulation.proj.bias.copy_(torch.arange(8.0))
    shift, scale = modulation(torch.zeros((1, 3)))
    assert shift.shape == (1, 1, 4) and shift.flatten().tolist() == [0, 1, 2, 3]
    assert scale.flatten().tolist() == [4, 5, 6, 7]
    with pytest.raises(ValueError, match="cond: expected shape"):
        modulation(torch.zeros(3))
