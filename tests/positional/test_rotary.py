"""RoPE against outside references: Hugging Face Llama (half layout), Meta's complex-number
formulation (interleaved layout), the weight permutation of HF's Llama conversion script."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from qkv.positional import (
    RotaryEmbedding,
    apply_rope,
    half_split_to_interleaved,
    interleaved_to_half_split,
    rope_cos_sin,
)


def hf_cos_sin(position_ids, head_dim, base, dtype=torch.float32):
    """cos, sin (B, L, D) from transformers' own LlamaRotaryEmbedding."""
    num_heads = 4
    config = LlamaConfig(
        hidden_size=head_dim * num_heads,
        num_attention_heads=num_heads,
        head_dim=head_dim,
        rope_parameters={"rope_type": "default", "rope_theta": base},
    )
    rotary = LlamaRotaryEmbedding(config)
    return rotary(torch.zeros(1, dtype=dtype), position_ids)


def meta_rope(x, positions, base):
    """Meta's original Llama `apply_rotary_emb`: pairs (2i, 2i+1) as complex numbers times
    e^{i m theta_i}, in float64. x: (B, H, L, D); positions: (L,)."""
    D = x.shape[-1]
    freqs = 1.0 / (base ** (torch.arange(0, D, 2)[: D // 2].double() / D))
    angles = torch.outer(positions.double(), freqs)  # (L, D/2)
    freqs_cis = torch.polar(torch.ones_like(angles), angles)
    x_complex = torch.view_as_complex(x.double().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(x_complex * freqs_cis).flatten(-2)


def hf_permute(w, n_heads):
    """`permute` of transformers' convert_llama_weights_to_hf.py (for 2-D weights)."""
    dim1, dim2 = w.shape
    return w.view(n_heads, dim1 // n_heads // 2, 2, dim2).transpose(1, 2).reshape(dim1, dim2)


@pytest.mark.parametrize(("head_dim", "base"), [(16, 10000.0), (64, 500000.0), (8, 100.0)])
def test_cos_sin_match_hugging_face_llama(head_dim, base):
    generator = torch.Generator().manual_seed(0)
    position_ids = torch.randint(0, 5000, (3, 11), generator=generator)
    expected_cos, expected_sin = hf_cos_sin(position_ids, head_dim, base)
    cos, sin = rope_cos_sin(position_ids, head_dim, base=base)
    torch.testing.assert_close(cos, expected_cos, rtol=0, atol=1e-6)
    torch.testing.assert_close(sin, expected_sin, rtol=0, atol=1e-6)


@pytest.mark.parametrize("batched_cos", [False, True])
def test_apply_rope_half_matches_hugging_face(batched_cos):
    torch.manual_seed(1)
    B, H, H_kv, L, D = 2, 4, 2, 7, 16
    q, k = torch.randn(B, H, L, D), torch.randn(B, H_kv, L, D)
    if batched_cos:
        position_ids = torch.stack([torch.arange(L) + 3, torch.arange(L) * 2])  # (B, L)
    else:
        position_ids = torch.arange(L).expand(B, L)
    cos, sin = hf_cos_sin(position_ids, D, 10000.0)  # (B, L, D)
    expected_q, expected_k = apply_rotary_pos_emb(q, k, cos, sin)
    if not batched_cos:
        cos, sin = cos[0], sin[0]  # (L, D)
    torch.testing.assert_close(apply_rope(q, cos, sin), expected_q)
    torch.testing.assert_close(apply_rope(k, cos, sin), expected_k)


def test_rotary_embedding_module_matches_hugging_face_gqa():
    torch.manual_seed(2)
    B, H, H_kv, L, D = 2, 6, 2, 5, 32
    q, k = torch.randn(B, H, L, D), torch.randn(B, H_kv, L, D)
    position_ids = torch.stack([torch.arange(L) + 10, torch.arange(L) + 100])  # (B, L)
    rotary = RotaryEmbedding(D, base=10000.0)
    for positions in (position_ids, None):
        hf_ids = torch.arange(L).expand(B, L) if positions is None else positions
        cos, sin = hf_cos_sin(hf_ids, D, 10000.0)
        expected_q, expected_k = apply_rotary_pos_emb(q, k, cos, sin)
        q_rotated, k_rotated = rotary(q, k, positions)
        torch.testing.assert_close(q_rotated, expected_q)
        torch.testing.assert_close(k_rotated, expected_k)
    assert (rotary.head_dim, rotary.base, rotary.layout) == (D, 10000.0, "half")


@pytest.mark.parametrize("layout", ["half", "interleaved"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_module_rotates_exactly_as_apply_rope_and_hugging_face(layout, dtype):
    """RotaryEmbedding's fewer-op path (a roll against a sign-flipped sin) is bit-identical."""
    torch.manual_seed(3)
    B, H, H_kv, L, D = 2, 4, 2, 3, 16
    q, k = torch.randn(B, H, L, D).to(dtype), torch.randn(B, H_kv, L, D).to(dtype)
    batched = torch.stack([torch.arange(L) + 7, torch.arange(L) + 40])  # (B, L)
    for positions in (torch.arange(L) + 5, batched):
        cos, sin = rope_cos_sin(positions, D, layout=layout)  # float32 tables
        q_rotated, k_rotated = RotaryEmbedding(D, layout=layout)(q, k, positions)
        assert torch.equal(q_rotated, apply_rope(q, cos, sin, layout=layout))
        assert torch.equal(k_rotated, apply_rope(k, cos, sin, layout=layout))
        if layout == "half" and dtype == torch.float32:
            hf_cos, hf_sin = hf_cos_sin(positions.expand(B, L), D, 10000.0)
            assert torch.equal(q_rotated, apply_rotary_pos_emb(q, k, hf_cos, hf_sin)[0])


def test_bf16_error_at_most_twice_hugging_face():
    """The low-precision rule: in bf16, at most twice the error of the reference library."""
    torch.manual_seed(3)
    B, H, L, D = 2, 4, 64, 64
    q = torch.randn(B, H, L, D)
    position_ids = torch.arange(L).expand(B, L) + 1000
    exact = meta_rope(half_split_to_interleaved_rows(q), position_ids[0], 10000.0)
    exact = interleaved_rows_to_half(exact)
    cos16, sin16 = hf_cos_sin(position_ids, D, 10000.0, dtype=torch.bfloat16)
    hf_out, _ = apply_rotary_pos_emb(q.bfloat16(), q.bfloat16(), cos16, sin16)
    cos, sin = rope_cos_sin(position_ids, D)
    ours = apply_rope(q.bfloat16(), cos, sin)
    assert ours.dtype == torch.bfloat16
    hf_error = (hf_out.double() - exact).abs().max()
    our_error = (ours.double() - exact).abs().max()
    assert our_error <= 2 * hf_error


def half_split_to_interleaved_rows(x):
    """Coordinates of each head vector from the half layout to the interleaved one."""
    first, second = x.chunk(2, dim=-1)
    return torch.stack((first, second), dim=-1).flatten(-2)


def interleaved_rows_to_half(x):
    pairs = x.unflatten(-1, (-1, 2))
    return torch.cat((pairs[..., 0], pairs[..., 1]), dim=-1)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_interleaved_matches_meta_complex_formulation(dtype):
    torch.manual_seed(4)
    B, H, L, D = 2, 3, 9, 16
    x = torch.randn(B, H, L, D, dtype=dtype)
    positions = torch.arange(L) + 40
    cos, sin = rope_cos_sin(positions, D, layout="interleaved", dtype=dtype)
    ours = apply_rope(x, cos, sin, layout="interleaved")
    assert ours.dtype == dtype
    expected = meta_rope(x, positions, 10000.0).to(dtype)
    tolerance = {"rtol": 1e-12, "atol": 1e-12} if dtype == torch.float64 else {}
    torch.testing.assert_close(ours, expected, **tolerance)


def project_heads(x, weight, bias, num_heads):
    B, L, _ = x.shape
    return F.linear(x, weight, bias).view(B, L, num_heads, -1).transpose(1, 2)  # (B, H, L, D)


def test_weight_conversion_preserves_scores_against_meta_and_hf():
    """Interleaved RoPE (Meta's complex code) on the original projections == half RoPE (HF's
    apply_rotary_pos_emb) on the converted projections."""
    torch.manual_seed(5)
    B, L, E, H, H_kv, D = 2, 6, 24, 4, 2, 8
    x = torch.randn(B, L, E, dtype=torch.float64)
    w_q, b_q = torch.randn(H * D, E, dtype=torch.float64), torch.randn(H * D, dtype=torch.float64)
    w_k, b_k = torch.randn(H_kv * D, E, dtype=torch.float64), torch.randn(H_kv * D).double()
    positions = torch.arange(L) + 7
    q = meta_rope(project_heads(x, w_q, b_q, H), positions, 10000.0)
    k = meta_rope(project_heads(x, w_k, b_k, H_kv), positions, 10000.0)
    expected = q @ k.repeat_interleave(H // H_kv, dim=1).transpose(-1, -2)  # (B, H, L, L)

    q_half = project_heads(
        x, interleaved_to_half_split(w_q, H), interleaved_to_half_split(b_q, H), H
    )
    k_half = project_heads(
        x, interleaved_to_half_split(w_k, H_kv), interleaved_to_half_split(b_k, H_kv), H_kv
    )
    cos, sin = hf_cos_sin(positions.expand(B, L), D, 10000.0, dtype=torch.float64)
    q_half, k_half = apply_rotary_pos_emb(q_half, k_half, cos, sin)
    scores = q_half @ k_half.repeat_interleave(H // H_kv, dim=1).transpose(-1, -2)
    torch.testing.assert_close(scores, expected, rtol=1e-5, atol=1e-5)


def test_conversion_is_hf_permute_and_the_two_are_inverse():
    torch.manual_seed(6)
    for num_heads, head_dim, in_features in [(4, 8, 12), (1, 2, 3), (3, 16, 5)]:
        weight = torch.randn(num_heads * head_dim, in_features)
        bias = torch.randn(num_heads * head_dim)
        converted = interleaved_to_half_split(weight, num_heads)
        assert torch.equal(converted, hf_permute(weight, num_heads))
        assert torch.equal(
            interleaved_to_half_split(bias, num_heads),
            hf_permute(bias[:, None], num_heads)[:, 0],
        )
        for tensor in (weight, bias):
            there = interleaved_to_half_split(tensor, num_heads)
            back = half_split_to_interleaved(tensor, num_heads)
            assert torch.equal(half_split_to_interleaved(there, num_heads), tensor)
            assert torch.equal(interleaved_to_half_split(back, num_heads), tensor)


def test_half_to_interleaved_conversion_preserves_scores():
    """The other direction, in float64 with tight tolerance: half RoPE on W equals interleaved
    RoPE on half_split_to_interleaved(W)."""
    torch.manual_seed(7)
    B, L, E, H, D = 1, 5, 10, 2, 8
    x = torch.randn(B, L, E, dtype=torch.float64)
    w_q, w_k = torch.randn(H * D, E).double(), torch.randn(H * D, E).double()
    positions = torch.arange(L) + 3
    cos, sin = hf_cos_sin(positions[None], D, 10000.0, dtype=torch.float64)
    q, k = apply_rotary_pos_emb(
        project_heads(x, w_q, None, H), project_heads(x, w_k, None, H), cos, sin
    )
    expected = q @ k.transpose(-1, -2)
    q_int = meta_rope(project_heads(x, half_split_to_interleaved(w_q, H), None, H), positions, 1e4)
    k_int = meta_rope(project_heads(x, half_split_to_interleaved(w_k, H), None, H), positions, 1e4)
    torch.testing.assert_close(q_int @ k_int.transpose(-1, -2), expected, rtol=1e-5, atol=1e-5)


SCORE_VECTORS = torch.randn(2, 32, generator=torch.Generator().manual_seed(8), dtype=torch.float64)


def rotated_score(query_position, key_position, layout):
    q = SCORE_VECTORS[0].view(1, 1, 1, -1)  # (B, H, L, D)
    k = SCORE_VECTORS[1].view(1, 1, 1, -1)
    rotary = RotaryEmbedding(32, layout=layout)
    q_rotated, _ = rotary(q, q, torch.tensor([query_position]))
    _, k_rotated = rotary(k, k, torch.tensor([key_position]))
    return float((q_rotated * k_rotated).sum())


@settings(max_examples=60, deadline=None)
@given(
    query_position=st.integers(0, 4096),
    key_position=st.integers(0, 4096),
    shift=st.integers(-4096, 4096),
    layout=st.sampled_from(["half", "interleaved"]),
)
def test_score_depends_only_on_relative_position(query_position, key_position, shift, layout):
    """Su et al. 2021: q_m . k_n after RoPE depends only on m - n."""
    score = rotated_score(query_position, key_position, layout)
    shifted = rotated_score(query_position + shift, key_position + shift, layout)
    assert shifted == pytest.approx(score, rel=1e-9, abs=1e-9)


def test_positions_none_is_arange():
    torch.manual_seed(9)
    q, k = torch.randn(1, 2, 4, 8), torch.randn(1, 1, 4, 8)
    rotary = RotaryEmbedding(8, layout="interleaved")
    implicit = rotary(q, k)
    explicit = rotary(q, k, torch.arange(4))
    for got, expected in zip(implicit, explicit, strict=True):
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
    torch.testing.assert_close(implicit[0], meta_rope(q, torch.arange(4), 1e4).float())


def test_bad_arguments():
    positions = torch.arange(4)
    with pytest.raises(ValueError, match=r"head_dim: expected an even dimension.*got 15"):
        rope_cos_sin(positions, 15)
    with pytest.raises(ValueError, match=r"layout: expected one of .*got 'complex'"):
        rope_cos_sin(positions, 16, layout="complex")
    with pytest.raises(ValueError, match=r"base: expected a number > 1.*got 1.0"):
        rope_cos_sin(positions, 16, base=1.0)
    with pytest.raises(TypeError, match=r"positions: expected an integer or real .*torch.bool"):
        rope_cos_sin(positions > 1, 16)
    with pytest.raises(TypeError, match=r"dtype: expected a floating-point torch.dtype"):
        rope_cos_sin(positions, 16, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"head_dim: expected an even dimension.*got 7"):
        RotaryEmbedding(7)
    with pytest.raises(TypeError, match=r"head_dim: expected an int >= 1, got float 8.0"):
        RotaryEmbedding(8.0)
    with pytest.raises(ValueError, match=r"layout: expected one of .*got 'neox'"):
        RotaryEmbedding(8, layout="neox")


def test_bad_tensors():
    x = torch.randn(1, 2, 4, 8)
    cos, sin = rope_cos_sin(torch.arange(4), 8)
    with pytest.raises(ValueError, match=r"cos: expected shape \(L, D\) = \(4, 8\).*got \(5, 8\)"):
        apply_rope(x, torch.ones(5, 8), sin)
    with pytest.raises(ValueError, match=r"sin: expected shape .*got \(3, 4, 8\)"):
        apply_rope(x, cos, torch.ones(3, 4, 8))
    with pytest.raises(ValueError, match=r"x: expected shape \(B, heads, L, D\).*got \(2, 4, 8\)"):
        apply_rope(x[0], cos, sin)
    with pytest.raises(ValueError, match=r"layout: expected one of"):
        apply_rope(x, cos, sin, layout="HALF")
    rotary = RotaryEmbedding(8)
    with pytest.raises(ValueError, match=r"positions: q has length L_q=4 and k has L_k=3"):
        rotary(x, x[:, :, :3])
    with pytest.raises(ValueError, match=r"positions: expected shape \(L,\) or \(B, L\).*\(5,\)"):
        rotary(x, x, torch.arange(5))
    with pytest.raises(ValueError, match=r"positions: expected shape .*got \(3, 4\)"):
        rotary(x, x, torch.arange(4).expand(3, 4))
    with pytest.raises(TypeError, match=r"positions: expected an integer or real floating"):
        rotary(x, x, torch.ones(4, dtype=torch.complex64))
    with pytest.raises(ValueError, match=r"q: expected shape .*head_dim=8.*\(1, 2, 4, 6\)"):
        rotary(torch.randn(1, 2, 4, 6), x)
    with pytest.raises(TypeError, match=r"k: expected a floating-point tensor"):
        rotary(x, x.long())


def test_bad_projection_weights():
    with pytest.raises(ValueError, match=r"num_heads: expected a divisor of weight.shape\[0\]=32"):
        interleaved_to_half_split(torch.randn(32, 4), 3)
    with pytest.raises(ValueError, match=r"num_heads: .*even head_dim, got num_heads=32"):
        half_split_to_interleaved(torch.randn(32, 4), 32)
    with pytest.raises(ValueError, match=r"weight: expected shape .*got \(2, 16, 4\)"):
        interleaved_to_half_split(torch.randn(2, 16, 4), 2)
    with pytest.raises(ValueError, match=r"num_heads: expected an int >= 1, got 0"):
        half_split_to_interleaved(torch.randn(16), 0)
