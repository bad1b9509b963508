"""The fields of the named `GPTConfig`s (`GPTConfig.from_name`): the published sizes of GPT-2,
Llama 2 and Mistral (Hugging Face config.json of each checkpoint), so that parameter counts and
KV-cache sizes computed from them are the real ones, and tiny ones for tests and examples."""

from __future__ import annotations

from typing import Any

__all__ = ["PRESETS"]


def _gpt2(embed_dim: int, num_layers: int, num_heads: int) -> dict[str, Any]:
    """GPT-2 (Radford et al. 2019): learned positions, LayerNorm, GELU(tanh) FFN of 4 * E,
    biases everywhere, tied output head; 1024 positions, vocabulary 50257 (byte-level BPE)."""
    return dict(
        vocab_size=50257,
        embed_dim=embed_dim,
        num_layers=num_layers,
        num_heads=num_heads,
        ffn_dim=4 * embed_dim,
        max_positions=1024,
        position="learned",
        norm="layernorm",
        ffn="gelu_tanh",
        bias=True,
        tie_embeddings=True,
        dropout=0.1,
        attention_dropout=0.1,
    )


def _llama(
    embed_dim: int, num_layers: int, num_heads: int, num_kv_heads: int, ffn_dim: int
) -> dict[str, Any]:
    """Llama 2 (Touvron et al. 2023): RoPE (theta 10000), RMSNorm (eps 1e-5), SwiGLU, no
    biases, separate lm_head; 4096 positions, vocabulary 32000 (SentencePiece)."""
    return dict(
        vocab_size=32000,
        embed_dim=embed_dim,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        ffn_dim=ffn_dim,
        max_positions=4096,
    )


_TINY_LLAMA = dict(
    vocab_size=100, embed_dim=32, num_layers=2, num_heads=4, num_kv_heads=2, ffn_dim=64,
    max_positions=64,
)  # fmt: skip

PRESETS: dict[str, dict[str, Any]] = {  # the fields of each GPTConfig
    "gpt2": _gpt2(768, 12, 12),  # 124,439,808 parameters (tied head)
    "gpt2-medium": _gpt2(1024, 24, 16),
    "gpt2-large": _gpt2(1280, 36, 20),
    "gpt2-xl": _gpt2(1600, 48, 25),
    "llama-2-7b": _llama(4096, 32, 32, 32, 11008),
    "llama-2-13b": _llama(5120, 40, 40, 40, 13824),
    "llama-2-70b": _llama(8192, 80, 64, 8, 28672),  # GQA: 8 K/V heads for 64 query heads
    # Mistral 7B v0.1 (Jiang et al. 2023): GQA 8, sliding window 4096, 32768 positions.
    "mistral-7b": {
        **_llama(4096, 32, 32, 8, 14336),
        "max_positions": 32768,
        "sliding_window": 4096,
    },
    # ~52M parameters, Llama-style with GQA: the size benchmarks/models.py times.
    "llama-50m": _llama(512, 6, 8, 4, 1536),
    # Tiny models for tests and examples (vocabulary 100, E = 32, 2 layers).
    "tiny-gpt2": {
        **_gpt2(32, 2, 4),
        "vocab_size": 100,
        "max_positions": 64,
        "dropout": 0.0,
        "attention_dropout": 0.0,
    },
    "tiny-llama": _TINY_LLAMA,
    "tiny-llama-mqa": {**_TINY_LLAMA, "num_kv_heads": 1},  # MQA (Shazeer 2019)
    "tiny-mistral": {**_TINY_LLAMA, "sliding_window": 4},
}
