"""`T5Config`: the sizes and choices of T5, the Text-to-Text Transfer Transformer, and its presets.

T5 (Raffel et al. 2020, "Exploring the Limits of Transfer Learning with a Unified Text-to-Text
Transformer", s3.1 and s3.7) is an encoder-decoder Transformer with pre-norm blocks, a scale-only
layer norm (RMSNorm), no biases anywhere, relative position biases instead of position
embeddings (s2.1), and one embedding matrix shared by the encoder, the decoder and the output
layer. The names follow the paper: d_model, d_ff, d_kv (the size of one head; num_heads * d_kv
need not equal d_model, as in T5-11B and T5 v1.1).

T5 v1.1, the checkpoints released after the paper, changes three things: a gated-GELU
feed-forward network (`feed_forward_proj="gated-gelu"`, GEGLU of Shazeer 2020, "GLU Variants
Improve Transformer", with GELU's tanh approximation), an output layer no longer tied to the
embedding (`tie_word_embeddings=False`), and no dropout in pre-training.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from qkv.validation import check_int, check_positive_float, check_positive_int, check_probability

__all__ = ["FEED_FORWARD_KINDS", "T5Config", "T5_PRESETS", "t5_parameter_count"]

FEED_FORWARD_KINDS = ("relu", "gated-gelu")


@dataclass(frozen=True)
class T5Config:
    """Everything that shapes a `qkv.models.T5Transformer` (defaults: T5-Small of the paper).

    vocab_size: V, one SentencePiece vocabulary for inputs and targets (32128 rows in the
        released checkpoints: 32000 pieces, 100 sentinels, padding to a multiple of 128).
    d_model: E, the width of the residual stream; d_kv: D, the size of one head;
        num_heads: H (the attention's inner width is H * D); d_ff: the FFN's hidden width.
    num_layers / num_decoder_layers: blocks of the encoder and of the decoder (None: as many
        as the encoder).
    relative_attention_num_buckets / relative_attention_max_distance: T5's bucketed relative
        positions (s2.1; `qkv.positional.T5RelativeBias`).
    dropout_rate: on the embeddings, on every sub-layer's output, inside the FFN, on the
        attention weights and after each stack's final norm.
    layer_norm_epsilon: eps of the RMSNorms.
    feed_forward_proj: "relu" (T5) or "gated-gelu" (T5 v1.1).
    tie_word_embeddings: the output layer is the shared embedding, read by a decoder output
        scaled by d_model ** -0.5 (T5); False: a separate output layer, no scaling (T5 v1.1).
    pad_token_id, eos_token_id; decoder_start_token_id: the decoder's first input (T5 uses
        the padding id).
    """

    vocab_size: int = 32128
    d_model: int = 512
    d_kv: int = 64
    d_ff: int = 2048
    num_layers: int = 6
    num_decoder_layers: int | None = None
    num_heads: int = 8
    relative_attention_num_buckets: int = 32
    relative_attention_max_distance: int = 128
    dropout_rate: float = 0.1
    layer_norm_epsilon: float = 1e-6
    feed_forward_proj: str = "relu"
    tie_word_embeddings: bool = True
    pad_token_id: int = 0
    eos_token_id: int = 1
    decoder_start_token_id: int = 0

    def __post_init__(self) -> None:
        if self.num_decoder_layers is None:  # symmetric stacks, as in every T5 checkpoint
            object.__setattr__(self, "num_decoder_layers", self.num_layers)
        _check_sizes(self)
        _check_choices(self)
        _check_token_ids(self)

    @property
    def inner_dim(self) -> int:
        """H * D: the width of the attention's queries, keys and values."""
        return self.num_heads * self.d_kv

    @classmethod
    def from_name(cls, name: str, **overrides: Any) -> T5Config:
        """A named preset (see `T5_PRESETS`), with any field replaced by `overrides`."""
        if name not in T5_PRESETS:
            raise ValueError(f"name: expected one of {sorted(T5_PRESETS)}, got {name!r}")
        fields = {field.name for field in dataclasses.fields(cls)}
        unknown = sorted(set(overrides) - fields)
        if unknown:
            raise TypeError(
                f"overrides: {unknown} are not fields; expected some of {sorted(fields)}"
            )
        return cls(**{**T5_PRESETS[name], **overrides})


T5_PRESETS: dict[str, dict[str, Any]] = {
    # Raffel et al. 2020, s3.7: Small (60M), Base (220M); d_kv = 64 in every size.
    "t5-small": {},
    "t5-base": {"d_model": 768, "d_ff": 3072, "num_layers": 12, "num_heads": 12},
    # T5 v1.1 Small (its config.json: dropout 0.1, for fine-tuning): gated-GELU, untied
    # output layer, d_ff 1024, 8 + 8 layers, 6 heads.
    "t5-v1_1-small": {
        "d_ff": 1024,
        "num_layers": 8,
        "num_heads": 6,
        "feed_forward_proj": "gated-gelu",
        "tie_word_embeddings": False,
    },  # fmt: skip
    # Small enough for tests on 2 CPU cores; buckets that reach the logarithmic range early.
    "t5-tiny": {
        "vocab_size": 128,
        "d_model": 32,
        "d_kv": 8,
        "d_ff": 64,
        "num_layers": 2,
        "num_heads": 4,
        "relative_attention_num_buckets": 8,
        "relative_attention_max_distance": 16,
        "dropout_rate": 0.0,
    },  # fmt: skip
}


def t5_parameter_count(config: T5Config) -> int:
    """Parameters of the model `config` builds (the tied output layer counted once)."""
    E, F, inner = config.d_model, config.d_ff, config.inner_dim
    attention = 4 * E * inner
    ffn = (3 if config.feed_forward_proj == "gated-gelu" else 2) * E * F
    encoder = config.num_layers * (attention + ffn + 2 * E) + E
    decoder = config.num_decoder_layers * (2 * attention + ffn + 3 * E) + E
    biases = 2 * config.relative_attention_num_buckets * config.num_heads
    tables = (1 if config.tie_word_embeddings else 2) * config.vocab_size * E
    return tables + encoder + decoder + biases


def _check_sizes(config: T5Config) -> None:
    for name in ("vocab_size", "d_model", "d_kv", "d_ff", "num_layers", "num_decoder_layers",
                 "num_heads", "relative_attention_num_buckets",
                 "relative_attention_max_distance"):  # fmt: skip
        check_positive_int(name, getattr(config, name))
    check_probability("dropout_rate", config.dropout_rate)
    check_positive_float("layer_norm_epsilon", config.layer_norm_epsilon)
    # The decoder's causal buckets give half of them to exact distances: the logarithmic
    # buckets need a max_distance beyond those (the encoder needs half as much).
    exact = config.relative_attention_num_buckets // 2
    if config.relative_attention_max_distance <= exact:
        raise ValueError(
            f"relative_attention_max_distance: expected more than the exact buckets of the "
            f"decoder (relative_attention_num_buckets // 2 = {exact}), got "
            f"{config.relative_attention_max_distance}"
        )


def _check_choices(config: T5Config) -> None:
    if config.feed_forward_proj not in FEED_FORWARD_KINDS:
        raise ValueError(
            f"feed_forward_proj: expected one of {list(FEED_FORWARD_KINDS)}, got "
            f"{config.feed_forward_proj!r}"
        )
    if not isinstance(config.tie_word_embeddings, bool):
        raise TypeError(
            f"tie_word_embeddings: expected a bool, got "
            f"{type(config.tie_word_embeddings).__name__} {config.tie_word_embeddings!r}"
        )


def _check_token_ids(config: T5Config) -> None:
    for name in ("pad_token_id", "eos_token_id", "decoder_start_token_id"):
        value = check_int(name, getattr(config, name))
        if not 0 <= value < config.vocab_size:
            raise ValueError(f"{name}: expected an id in [0, {config.vocab_size}), got {value}")
