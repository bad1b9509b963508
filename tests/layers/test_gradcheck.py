"""torch.autograd.gradcheck in float64 on tiny layers: finite differences are the reference."""

import pytest
import torch
from torch.autograd import gradcheck
from torch.func import functional_call

import qkv
from qkv.layers import DecoderBlock, MultiHeadAttention, RMSNorm
from qkv.positional import RotaryEmbedding


@pytest.mark.parametrize("variant", ["mha_weights", "gqa_rope_causal", "mqa_cross_padded"])
def test_multihead_attention_gradcheck(variant):
    torch.manual_seed(40)
    options = {
        "mha_weights": {"num_kv_heads": 2},
        "gqa_rope_causal": {"num_kv_heads": 1, "rope": RotaryEmbedding(4)},
        "mqa_cross_padded": {"num_kv_heads": 1, "context_dim": 3},
    }[variant]
    layer = MultiHeadAttention(8, 2, dtype=torch.float64, **options)
    x = torch.randn(2, 3, 8, dtype=torch.float64, requires_grad=True)
    context = torch.randn(2, 4, 3, dtype=torch.float64, requires_grad=True)
    params = {name: p.detach().clone().requires_grad_() for name, p in layer.named_parameters()}
    names = list(params)

    def forward(x, context, *weights):
        state = dict(zip(names, weights, strict=True))
        if variant == "mha_weights":  # the reference backend, output and weights
            return functional_call(layer, state, (x,), {"return_weights": True})
        if variant == "gqa_rope_causal":
            return functional_call(layer, state, (x,), {"causal": True})
        mask = qkv.masks.padding(torch.tensor([4, 2]), 4)
        return functional_call(layer, state, (x, context), {"mask": mask})

    assert gradcheck(forward, (x, context, *params.values()), eps=1e-6, atol=1e-5)


def test_decoder_block_and_rms_norm_gradcheck():
    torch.manual_seed(41)
    block = DecoderBlock(4, 2, 6, norm_first=True, activation="gelu", dtype=torch.float64)
    norm = RMSNorm(4, dtype=torch.float64)
    x = torch.randn(1, 3, 4, dtype=torch.float64, requires_grad=True)
    memory = torch.randn(1, 2, 4, dtype=torch.float64, requires_grad=True)
    assert gradcheck(lambda x, memory: norm(block(x, memory)), (x, memory), eps=1e-6, atol=1e-5)
