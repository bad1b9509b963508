"""The GGUF that benchmarks/decode.py hands llama.cpp permutes q/k rows so that llama.cpp's RoPE
(adjacent pairs 2i, 2i + 1, Su et al. 2021's original form) gives the attention scores that
transformers' Llama RoPE (pairs i, i + D/2: `rotate_half`) gives on the unpermuted weights.

Outside reference: transformers' `LlamaRotaryEmbedding` and `apply_rotary_pos_emb`; llama.cpp's
rotation is written out here from its definition.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch
import transformers
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "peers.py"
spec = importlib.util.spec_from_file_location("benchmarks_peers", SCRIPT)
peers = importlib.util.module_from_spec(spec)
spec.loader.exec_module(peers)


def _rope_adjacent_pairs(x: torch.Tensor, positions: torch.Tensor, base: float) -> torch.Tensor:
    """x (H, L, D) rotated pair by pair: (x[2i], x[2i+1]) by the angle p * base^(-2i / D)."""
    D = x.shape[-1]
    inverse = base ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)  # (D/2,)
    angle = positions[:, None].double() * inverse  # (L, D/2)
    even, odd = x[..., 0::2], x[..., 1::2]
    rotated = torch.stack(
        (even * angle.cos() - odd * angle.sin(), even * angle.sin() + odd * angle.cos()), dim=-1
    )
    return rotated.flatten(-2)


def test_interleaved_rows_give_llama_cpp_rope_the_scores_of_transformers_rope():
    H, H_kv, D, E, L, base = 4, 2, 8, 16, 6, 10000.0
    generator = torch.Generator().manual_seed(0)
    w_q, w_k, x = (torch.randn(shape, generator=generator, dtype=torch.float64)
                   for shape in ((H * D, E), (H_kv * D, E), (L, E)))  # fmt: skip
    positions = torch.arange(L)
    config = transformers.LlamaConfig(
        hidden_size=E, num_attention_heads=H, num_key_value_heads=H_kv, head_dim=D,
        rope_theta=base,
    )  # fmt: skip
    cos, sin = LlamaRotaryEmbedding(config)(x[None].float(), positions[None])
    q = (x @ w_q.T).view(L, H, D).transpose(0, 1)[None]  # (1, H, L, D)
    k = (x @ w_k.T).view(L, H_kv, D).transpose(0, 1)[None]
    q_hf, k_hf = apply_rotary_pos_emb(q, k, cos.double(), sin.double())
    q_cpp = _rope_adjacent_pairs(
        (x @ peers.interleave_rope_rows(w_q, H).T).view(L, H, D).transpose(0, 1), positions, base
    )
    k_cpp = _rope_adjacent_pairs(
        (x @ peers.interleave_rope_rows(w_k, H_kv).T).view(L, H_kv, D).transpose(0, 1),
        positions, base,
    )  # fmt: skip
    # the same rotated vectors, in llama.cpp's order: element 2i + j is transformers' j*D/2 + i
    order = torch.arange(D).view(2, D // 2).T.flatten()
    torch.testing.assert_close(q_cpp, q_hf[0][..., order], rtol=1e-6, atol=1e-6)
    for head in range(H):  # so every score q . k is the same (GQA: head h reads k of h // 2)
        scores_hf = q_hf[0, head] @ k_hf[0, head // 2].T
        scores_cpp = q_cpp[head] @ k_cpp[head // 2].T
        torch.testing.assert_close(scores_cpp, scores_hf, rtol=1e-6, atol=1e-6)
