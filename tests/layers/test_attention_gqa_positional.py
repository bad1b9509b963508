"""GQA/MQA, RoPE and ALiBi inside MultiHeadAttention, against outside references.

- GQA/MQA: an explicit computation on the layer's own projection weights, with the attention
  done by PyTorch's F.scaled_dot_product_attention(enable_gqa=True).
- RoPE: Hugging Face transformers' LlamaAttention (GQA + RoPE) with the same weights.
- ALiBi: BLOOM's build_alibi_tensor (transformers), added to SDPA's mask.
"""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import LlamaConfig
from transformers.models.bloom.modeling_bloom import build_alibi_tensor
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRotaryEmbedding

import qkv
from qkv.layers import MultiHeadAttention
from qkv.positional import RotaryEmbedding
from tests.layers.helpers import randomize_


def _sdpa_layer_reference(layer, x, context=None, attn_mask=None, is_causal=False):
    """The layer's function written out: projections, SDPA with enable_gqa, output projection."""
    B, L_q, _ = x.shape
    source = x if context is None else context
    L_k, D = source.shape[1], layer.head_dim
    q = F.linear(x, layer.q_proj.weight, layer.q_proj.bias)
    k = F.linear(source, layer.k_proj.weight, layer.k_proj.bias)
    v = F.linear(source, layer.v_proj.weight, layer.v_proj.bias)
    q = q.view(B, L_q, -1, D).transpose(1, 2)  # (B, H, L_q, D)
    k = k.view(B, L_k, -1, D).transpose(1, 2)  # (B, H_kv, L_k, D)
    v = v.view(B, L_k, -1, D).transpose(1, 2)  # (B, H_kv, L_k, D)
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=attn_mask, is_causal=is_causal, enable_gqa=True
    )
    out = out.transpose(1, 2).reshape(B, L_q, -1)  # (B, L_q, H * D)
    return F.linear(out, layer.out_proj.weight, layer.out_proj.bias)


@pytest.mark.parametrize("num_kv_heads", [8, 4, 2, 1])
@pytest.mark.parametrize("masks", ["none", "causal", "padding"])
def test_gqa_and_mqa_match_sdpa_enable_gqa(num_kv_heads, masks):
    torch.manual_seed(0)
    layer = randomize_(MultiHeadAttention(32, 8, num_kv_heads), seed=4)
    assert layer.k_proj.weight.shape == (num_kv_heads * 4, 32)
    x = torch.randn(3, 6, 32)
    padding = qkv.masks.padding(torch.tensor([6, 4, 1]), 6) if masks == "padding" else None
    expected = _sdpa_layer_reference(layer, x, attn_mask=padding, is_causal=masks == "causal")
    output = layer(x, mask=padding, causal=masks == "causal")
    # 1e-5: qkv.attention may compute with another backend than SDPA (another order of sums)
    torch.testing.assert_close(output, expected, atol=1e-5, rtol=0)


@st.composite
def _gqa_calls(draw):
    num_kv_heads, group = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    head_dim = draw(st.integers(1, 4))
    cross = draw(st.booleans())
    return {
        "seed": draw(st.integers(0, 2**31 - 1)),
        "num_heads": num_kv_heads * group,
        "num_kv_heads": num_kv_heads,
        "embed_dim": num_kv_heads * group * head_dim,
        "B": draw(st.integers(1, 3)),
        "L_q": draw(st.integers(1, 7)),
        "L_k": draw(st.integers(1, 7)) if cross else None,
        "context_dim": draw(st.sampled_from([None, 5])) if cross else None,
        "padded": draw(st.booleans()),
        "causal": draw(st.booleans()) and not cross,
    }


@settings(max_examples=100, deadline=None)
@given(call=_gqa_calls())
def test_property_mha_gqa_self_and_cross_match_sdpa_in_float64(call):
    torch.manual_seed(call["seed"])
    layer = MultiHeadAttention(
        call["embed_dim"],
        call["num_heads"],
        call["num_kv_heads"],
        context_dim=call["context_dim"],
        dtype=torch.float64,
    )
    B, L_q = call["B"], call["L_q"]
    x = torch.randn(B, L_q, call["embed_dim"], dtype=torch.float64)
    context = None
    if call["L_k"] is not None:
        width = call["context_dim"] or call["embed_dim"]
        context = torch.randn(B, call["L_k"], width, dtype=torch.float64)
    L_k = L_q if context is None else call["L_k"]
    mask = None
    if call["padded"]:  # at least one real key per row: SDPA gives NaN on empty rows
        mask = qkv.masks.padding(torch.randint(1, L_k + 1, (B,)), L_k)
    expected = _sdpa_layer_reference(layer, x, context, attn_mask=mask, is_causal=call["causal"])
    output = layer(x, context, mask=mask, causal=call["causal"])
    torch.testing.assert_close(output, expected, atol=1e-10, rtol=1e-10)


def _llama_pair(num_heads=4, num_kv_heads=2, hidden=32, base=10000.0):
    config = LlamaConfig(
        hidden_size=hidden,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        intermediate_size=2 * hidden,
        attention_bias=False,
        rope_theta=base,
        max_position_embeddings=128,
    )
    config._attn_implementation = "eager"
    llama = randomize_(LlamaAttention(config, layer_idx=0), seed=5).eval()
    rope = RotaryEmbedding(hidden // num_heads, base=base)
    layer = MultiHeadAttention(hidden, num_heads, num_kv_heads, bias=False, rope=rope)
    with torch.no_grad():
        for name in ("q_proj", "k_proj", "v_proj"):
            getattr(layer, name).weight.copy_(getattr(llama, name).weight)
        layer.out_proj.weight.copy_(llama.o_proj.weight)
    return llama, LlamaRotaryEmbedding(config), layer


@pytest.mark.parametrize("base", [10000.0, 500000.0])
@pytest.mark.parametrize("positions", ["default", "offset", "per_batch"])
def test_rope_matches_transformers_llama_attention(base, positions):
    llama, llama_rope, layer = _llama_pair(base=base)
    B, L = 2, 7
    torch.manual_seed(6)
    x = torch.randn(B, L, 32)
    position_ids = {
        "default": torch.arange(L).expand(B, L),
        "offset": (torch.arange(L) + 40).expand(B, L),
        "per_batch": torch.stack((torch.arange(L) + 3, torch.arange(L) * 2)),
    }[positions]
    additive_causal = qkv.masks.to_additive(qkv.masks.causal(L)).expand(B, 1, L, L)
    expected, _ = llama(x, llama_rope(x, position_ids), additive_causal)
    ours_positions = None if positions == "default" else position_ids
    if positions == "offset":
        ours_positions = position_ids[0]  # (L,): shared by the batch
    output = layer(x, causal=True, positions=ours_positions)
    torch.testing.assert_close(output, expected, atol=2e-6, rtol=0)


@pytest.mark.parametrize("num_heads", [4, 6])
def test_alibi_matches_bloom_build_alibi_tensor(num_heads):
    torch.manual_seed(7)
    B, L, E = 2, 9, num_heads * 4
    layer = randomize_(MultiHeadAttention(E, num_heads, alibi=True), seed=8)
    x = torch.randn(B, L, E)
    # BLOOM's bias is slope * key_position; under a causal mask it equals -slope * (i - j) up
    # to a per-row constant, which softmax ignores (Press et al. 2022, section 3).
    bloom = build_alibi_tensor(torch.ones(B, L), num_heads, torch.float32)  # (B * H, 1, L)
    bloom = bloom.view(B, num_heads, 1, L)  # (B, H, 1, L)
    mask = bloom + qkv.masks.to_additive(qkv.masks.causal(L))  # (B, H, L, L)
    expected = _sdpa_layer_reference(layer, x, attn_mask=mask)
    torch.testing.assert_close(layer(x, causal=True), expected, atol=2e-6, rtol=0)
    output, _ = layer(x, causal=True, return_weights=True)  # the reference backend
    torch.testing.assert_close(output, expected, atol=2e-6, rtol=0)
