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

The named presets (`GPTConfig.from_name`) are in gpt_presets.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from qkv.layers.attention_checks import check_heads
from qkv.models.gpt_config_checks import check_rope_fields
from qkv.models.gpt_presets import PRESETS
from qkv.positional import RopeScaling
from qkv.validation import (
    check_choice,
    check_positive_float,
    check_positive_int,
    check_probability,
    preset,
)

__all__ = ["FFN_KINDS", "GPTConfig", "NORM_KINDS", "POSITION_KINDS"]

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
        check_positive_float("norm_eps", self.norm_eps)
        check_rope_fields(self)
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
        """A named preset (see `qkv.models.gpt_presets.PRESETS`), optionally with some fields
        replaced.

        Example: `GPTConfig.from_name("gpt2", dropout=0.0)`.
        """
        return preset(PRESETS, name, overrides, cls)
