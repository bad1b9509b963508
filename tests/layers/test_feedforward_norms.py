"""FeedForward, SwiGLU, LayerNorm and RMSNorm against PyTorch and transformers.

Low precision follows the project's rule: compare with an fp64 reference, and allow at most
twice the error PyTorch's own implementation makes at the same precision.
"""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig
from transformers.activations import ACT2FN
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm

from qkv.layers import FeedForward, LayerNorm, RMSNorm, SwiGLU
from tests.layers.helpers import randomize_

E, HIDDEN = 24, 40


def _x(dtype=torch.float32, seed=20, scale=3.0):
    torch.manual_seed(seed)
    return (torch.randn(4, 7, E, dtype=torch.float64) * scale + 0.5).to(dtype)


def test_swiglu_matches_transformers_llama_mlp():
    config = LlamaConfig(
        hidden_size=E, intermediate_size=HIDDEN, hidden_act="silu", num_attention_heads=4
    )
    llama = randomize_(LlamaMLP(config), seed=21)
    ours = SwiGLU(E, HIDDEN)
    ours.load_state_dict(llama.state_dict())  # same names: gate_proj, up_proj, down_proj
    torch.testing.assert_close(ours(_x()), llama(_x()), atol=1e-6, rtol=0)


@pytest.mark.parametrize(
    ("activation", "reference"),
    [
        ("relu", nn.ReLU()),
        ("gelu", ACT2FN["gelu"]),  # the exact x * Phi(x), BERT
        ("gelu_tanh", ACT2FN["gelu_new"]),  # GPT-2's tanh approximation, written out in Python
    ],
)
def test_feedforward_matches_linear_activation_linear(activation, reference):
    ffn = randomize_(FeedForward(E, HIDDEN, activation=activation, dropout=0.3), seed=22).eval()
    x = _x()
    expected = ffn.down_proj.bias + reference(x @ ffn.up_proj.weight.T + ffn.up_proj.bias) @ (
        ffn.down_proj.weight.T
    )
    torch.testing.assert_close(ffn(x), expected, atol=1e-5, rtol=1e-5)


def test_gelu_is_x_times_gaussian_cdf():
    x = _x(torch.float64)
    ffn = FeedForward(E, E, activation="gelu", bias=False, dtype=torch.float64)
    with torch.no_grad():
        ffn.up_proj.weight.copy_(torch.eye(E))
        ffn.down_proj.weight.copy_(torch.eye(E))
    phi = 0.5 * (1.0 + torch.erf(x / math.sqrt(2.0)))  # Hendrycks & Gimpel 2016
    torch.testing.assert_close(ffn(x), x * phi, atol=1e-12, rtol=1e-12)


def _affine(dim, seed, dtype):
    generator = torch.Generator().manual_seed(seed)
    weight = (1.0 + 0.5 * torch.randn(dim, generator=generator)).to(dtype)
    bias = (0.5 * torch.randn(dim, generator=generator)).to(dtype)
    return weight, bias


def _assert_within_twice_torch_error(ours, torch_low, reference_fp64):
    """Mean absolute error at most twice PyTorch's; the max error, a noisier statistic over a
    few hundred values, at most three times (Llama's RMSNorm rounds twice: once before the
    weight multiplies, once after, and measured 1.0x to 2.1x PyTorch's max error over seeds)."""
    torch_error = (torch_low.double() - reference_fp64).abs()
    our_error = (ours.double() - reference_fp64).abs()
    assert our_error.mean() <= 2 * torch_error.mean(), (our_error.mean(), torch_error.mean())
    assert our_error.max() <= 3 * torch_error.max(), (our_error.max(), torch_error.max())


@pytest.mark.parametrize("bias", [True, False])
def test_layer_norm_matches_torch_in_fp32(bias):
    weight, shift = _affine(E, 23, torch.float32)
    ours = LayerNorm(E, eps=1e-5, bias=bias)
    reference = nn.LayerNorm(E, eps=1e-5, bias=bias)
    with torch.no_grad():
        for module in (ours, reference):
            module.weight.copy_(weight)
            if bias:
                module.bias.copy_(shift)
    x = _x()
    torch.testing.assert_close(ours(x), reference(x), atol=1e-5, rtol=1e-6)
    functional = F.layer_norm(x, (E,), weight, shift if bias else None, eps=1e-5)
    torch.testing.assert_close(ours(x), functional, atol=1e-5, rtol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_layer_norm_low_precision_error_within_twice_torch(dtype):
    weight, shift = _affine(E, 24, dtype)
    ours = LayerNorm(E, dtype=dtype)
    with torch.no_grad():
        ours.weight.copy_(weight)
        ours.bias.copy_(shift)
    x = _x(dtype)
    exact = F.layer_norm(x.double(), (E,), weight.double(), shift.double(), eps=1e-5)
    _assert_within_twice_torch_error(ours(x), F.layer_norm(x, (E,), weight, shift, eps=1e-5), exact)
    assert ours(x).dtype == dtype


def test_rms_norm_matches_torch_and_llama_in_fp32():
    weight, _ = _affine(E, 25, torch.float32)
    ours, torch_rms, llama = RMSNorm(E, eps=1e-6), nn.RMSNorm(E, eps=1e-6), LlamaRMSNorm(E, 1e-6)
    with torch.no_grad():
        for module in (ours, torch_rms, llama):
            module.weight.copy_(weight)
    x = _x()
    torch.testing.assert_close(ours(x), torch_rms(x), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(ours(x), llama(x), atol=0, rtol=0)


def test_rms_norm_bf16_is_llama_rms_norm_and_close_to_fp64():
    weight, _ = _affine(E, 26, torch.bfloat16)
    ours = RMSNorm(E, dtype=torch.bfloat16)
    llama = LlamaRMSNorm(E, eps=1e-6).to(torch.bfloat16)
    with torch.no_grad():
        ours.weight.copy_(weight)
        llama.weight.copy_(weight)
    x = _x(torch.bfloat16)
    assert torch.equal(ours(x), llama(x))  # the same recipe: fp32 statistics, cast, then scale
    exact = F.rms_norm(x.double(), (E,), weight.double(), eps=1e-6)
    torch_bf16 = F.rms_norm(x, (E,), weight, eps=1e-6)
    _assert_within_twice_torch_error(ours(x), torch_bf16, exact)
