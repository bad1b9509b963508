"""`GPTConfig`: one frozen dataclass for every decoder-only model (GPT-2, Llama, Mistral).

A decoder-only language model is a stack of pre-norm blocks (causal self-attention, then a
feed-forward network) between a token embedding and a vocabulary projection, optionally tied to the
embedding (Press & Wolf 2017). The families differ only in components, and the config names them:

    component       GPT-2 (Radford et al. 2019)     Llama 2 (Touvron et al. 2023) / Mistral
    position        "learned" (added to embeddings)  "rope" (rotates q and k; Su et al. 2021)
    norm            "layernorm" (with bias)          "rmsnorm"
    ffn             "gelu_tanh" (4 * E)              "swiglu" (gated, ~8/3 * E; Shazeer 2020)
    K/V heads       = num_heads (MHA)                fewer for GQA (70B, Mistral)
    output head     tied to the embedding            separate lm_head
    sliding_window  None                             4096 in Mistral 7B

The presets carry the published sizes (Hugging Face config.json of each checkpoint), so that
parameter counts and KV-cache sizes computed from them are the real ones.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from qkv.layers.attention import check_heads
from qkv.positional import RopeScaling
from qkv.positional.rope_scaling_hf import rope_scaling_from_hf
from qkv.validation import check_choice, check_positive_int, check_probability, preset

__all__ = ["FFN_KINDS", "GPTConfig", "NORM_KINDS", "POSITION_KINDS", "PRESETS"]

# "none": no positions at all (causal masking alone orders the tokens; Haviv et al. 2022).
POSITION_KINDS = ("learned", "rope", "sinusoidal", "alibi", "t5", "none")
NORM_KINDS = ("layernorm", "rmsnorm")
FFN_KINDS = ("gelu_tanh", "swiglu")


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    """Sizes and component choices of a decoder-only Transformer (`qkv.models.GPT`).

    vocab_size V, embed_dim E, num_layers, num_heads H, num_kv_heads H_kv (None: = H, plain
    MHA; 1 < H_kv < H: GQA; 1: MQA), ffn_dim (the FFN's hidden width), max_positions (the
    learned or sinusoidal table's rows, or the trained context length with RoPE), position /
    norm / ffn (the component kinds above), relative_buckets and relative_max_distance (T5's
    bias: `qkv.positional.T5RelativeBias`, causal), rope_base (theta of RoPE), rope_scaling
    (None, or a `qkv.positional.RopeScaling` rule for contexts past the training one, which
    `context_length` reports; a dict of its fields or a Hugging Face `rope_scaling` dict is
    converted to one, rope_type "default" to None), norm_eps, bias (on every projection and
    LayerNorm), tie_embeddings (lm_head shares the token embedding), sliding_window (None, or
    W: each query sees itself and the W - 1 keys before it), dropout (embeddings and residual
    branches) and attention_dropout (attention weights).
    """

    vocab_size: int
    embed_dim: int
    num_layers: int
    num_heads: int
    ffn_dim: int
    num_kv_heads: int | None = None
    max_positions: int = 2048
    position: str = "rope"
    relative_buckets: int = 32
    relative_max_distance: int = 128
    rope_base: float = 10000.0
    rope_scaling: RopeScaling | None = None
    norm: str = "rmsnorm"
    norm_eps: float = 1e-5
    ffn: str = "swiglu"
    bias: bool = False
    tie_embeddings: bool = False
    sliding_window: int | None = None
    dropout: float = 0.0
    attention_dropout: float = 0.0

    def __post_init__(self) -> None:
        for name in ("vocab_size", "embed_dim", "num_layers", "num_heads", "ffn_dim"):
            check_positive_int(name, getattr(self, name))
        check_positive_int("max_positions", self.max_positions)
        check_positive_int("relative_buckets", self.relative_buckets)
        check_positive_int("relative_max_distance", self.relative_max_distance)
        if self.relative_max_distance <= self.relative_buckets // 2:
            raise ValueError(
                f"relative_max_distance: expected more than relative_buckets // 2 = "
                f"{self.relative_buckets // 2} (the buckets of one distance each), got "
                f"{self.relative_max_distance}"
            )
        if self.num_kv_heads is None:
            object.__setattr__(self, "num_kv_heads", self.num_heads)  # frozen: resolve once
        check_positive_int("num_kv_heads", self.num_kv_heads)
        check_heads(self.embed_dim, self.num_heads, self.num_kv_heads)
        check_choice("position", self.position, POSITION_KINDS)
        check_choice("norm", self.norm, NORM_KINDS)
        check_choice("ffn", self.ffn, FFN_KINDS)
        _check_positive_float("norm_eps", self.norm_eps)
        _check_rope(self)
        for name in ("bias", "tie_embeddings"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name}: expected a bool, got {getattr(self, name)!r}")
        if self.sliding_window is not None:
            check_positive_int("sliding_window", self.sliding_window)
        check_probability("dropout", self.dropout)
        check_probability("attention_dropout", self.attention_dropout)

    @property
    def head_dim(self) -> int:
        """D = E // H, the width of one attention head."""
        return self.embed_dim // self.num_heads

    @property
    def context_length(self) -> int:
        """The tokens one sequence may hold: max_positions, or with RoPE scaling the extended
        context factor * L_orig (L_orig: original_max_positions, else max_positions) when that
        is longer. Llama 3.1 (max_positions 131072 = 16 * 8192, factor 8) keeps 131072; a
        linear factor of 4 on a 4096-token model gives 16384 (Chen et al. 2023)."""
        scaling = self.rope_scaling
        if scaling is None:
            return self.max_positions
        original = scaling.original_max_positions or self.max_positions
        return max(self.max_positions, int(scaling.factor * original))

    @classmethod
    def from_name(cls, name: str, **overrides: object) -> GPTConfig:
        """A named preset (see `PRESETS`), optionally with some fields replaced.

        Example: `GPTConfig.from_name("gpt2", dropout=0.0)`.
        """
        return preset(PRESETS, name, overrides)


def _check_positive_float(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name}: expected a positive float, got {type(value).__name__} {value!r}")
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"{name}: expected a finite float > 0, got {value}")


def _check_rope(config: GPTConfig) -> None:
    _check_positive_float("rope_base", config.rope_base)
    scaling = config.rope_scaling
    if isinstance(scaling, dict):  # frozen: resolve once
        if "kind" in scaling:  # RopeScaling's own fields (dataclasses.asdict)
            scaling = RopeScaling(**scaling)
        else:  # Hugging Face's rope_scaling object; rope_type "default" is plain RoPE: None
            _check_hf_theta(scaling, config.rope_base)
            scaling = rope_scaling_from_hf(scaling, max_positions=config.max_positions)
        object.__setattr__(config, "rope_scaling", scaling)
    if scaling is not None and not isinstance(scaling, RopeScaling):
        raise TypeError(
            f"rope_scaling: expected None, a qkv.positional.RopeScaling or a Hugging Face "
            f"rope_scaling dict, got {type(scaling).__name__} {scaling!r:.80}"
        )
    if scaling is not None and config.position != "rope":
        raise ValueError(
            f"rope_scaling: given ({scaling.kind!r}) but position={config.position!r}; "
            f"expected position='rope' or rope_scaling=None"
        )
    if config.position == "rope" and config.head_dim % 2:
        raise ValueError(
            f"embed_dim: head_dim = {config.embed_dim} // {config.num_heads} = {config.head_dim} "
            f"is odd; RoPE rotates pairs of coordinates, expected an even head_dim"
        )
    if scaling is not None:
        scaling.check_head_dim(config.head_dim)


def _check_hf_theta(rope_scaling: dict, rope_base: float) -> None:
    """The base is rope_base; a Hugging Face object's rope_theta must not say otherwise."""
    theta = rope_scaling.get("rope_theta")
    if theta is not None and theta != rope_base:
        raise ValueError(
            f"rope_scaling: rope_theta is {theta!r}, but rope_base={rope_base}; expected the "
            f"same base in both (set rope_base), or no rope_theta"
        )


def _gpt2(embed_dim: int, num_layers: int, num_heads: int) -> GPTConfig:
    """GPT-2 (Radford et al. 2019): learned positions, LayerNorm, GELU(tanh) FFN of 4 * E,
    biases everywhere, tied output head; 1024 positions, vocabulary 50257 (byte-level BPE)."""
    return GPTConfig(
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


def _llama(embed_dim: int, num_layers: int, num_heads: int, num_kv_heads: int, ffn_dim: int):
    """Llama 2 (Touvron et al. 2023): RoPE (theta 10000), RMSNorm (eps 1e-5), SwiGLU, no
    biases, separate lm_head; 4096 positions, vocabulary 32000 (SentencePiece)."""
    return GPTConfig(
        vocab_size=32000,
        embed_dim=embed_dim,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        ffn_dim=ffn_dim,
        max_positions=4096,
    )


_TINY_LLAMA = GPTConfig(
    vocab_size=100, embed_dim=32, num_layers=2, num_heads=4, num_kv_heads=2, ffn_dim=64,
    max_positions=64,
)  # fmt: skip

PRESETS: dict[str, GPTConfig] = {
    "gpt2": _gpt2(768, 12, 12),  # 124,439,808 parameters (tied head)
    "gpt2-medium": _gpt2(1024, 24, 16),
    "gpt2-large": _gpt2(1280, 36, 20),
    "gpt2-xl": _gpt2(1600, 48, 25),
    "llama-2-7b": _llama(4096, 32, 32, 32, 11008),
    "llama-2-13b": _llama(5120, 40, 40, 40, 13824),
    "llama-2-70b": _llama(8192, 80, 64, 8, 28672),  # GQA: 8 K/V heads for 64 query heads
    # Mistral 7B v0.1 (Jiang et al. 2023): GQA 8, sliding window 4096, 32768 positions.
    "mistral-7b": dataclasses.replace(
        _llama(4096, 32, 32, 8, 14336), max_positions=32768, sliding_window=4096
    ),
    # ~52M parameters, Llama-style with GQA: the size benchmarks/models.py times.
    "llama-50m": _llama(512, 6, 8, 4, 1536),
    # Tiny models for tests and examples (vocabulary 100, E = 32, 2 layers).
    "tiny-gpt2": dataclasses.replace(
        _gpt2(32, 2, 4), vocab_size=100, max_positions=64, dropout=0.0, attention_dropout=0.0
    ),
    "tiny-llama": _TINY_LLAMA,
    "tiny-llama-mqa": dataclasses.replace(_TINY_LLAMA, num_kv_heads=1),  # MQA (Shazeer 2019)
    "tiny-mistral": dataclasses.replace(_TINY_LLAMA, sliding_window=4),
}
