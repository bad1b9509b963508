"""`TransformerConfig`: the sizes and choices of the encoder-decoder Transformer, and its presets.

The presets follow Vaswani et al. 2017 ("Attention Is All You Need"), Table 3: the base model
(d_model 512, 8 heads, 6 + 6 layers, d_ff 2048, P_drop 0.1, eps_ls 0.1, 65M parameters) and the
big model (d_model 1024, 16 heads, d_ff 4096, P_drop 0.3, 213M parameters). Both share one
embedding matrix between the source, the target and the pre-softmax projection (section 3.4)
over the shared source-target BPE vocabulary of about 37000 tokens used for WMT 2014
English-German (section 5.1). The special token ids (pad 0, bos 1, eos 2) are qkv's choice: the
paper does not fix them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from qkv.validation import check_int, check_positive_int, check_probability

__all__ = ["TRANSFORMER_PRESETS", "TransformerConfig"]


@dataclass(frozen=True)
class TransformerConfig:
    """Everything that shapes a `qkv.models.Transformer` (defaults: the base model's sizes).

    src_vocab_size / tgt_vocab_size: V of the source and of the target vocabulary.
    embed_dim: E (d_model); num_heads: H, dividing E; ffn_dim: the FFN's hidden width (d_ff).
    num_encoder_layers / num_decoder_layers: N of each stack (6 in the paper).
    dropout: P_drop, on the embeddings + positions, on every sub-layer's output, on the attention
        weights and inside the FFN (as `nn.Transformer`).
    max_positions: rows of the precomputed sinusoid table; longer inputs still work, their encodings
        are computed on the fly (sinusoids are defined for any position; Vaswani et al. 2017,
        section 3.5).
    pad_token_id: padding in both vocabularies; bos_token_id: the decoder's start token
        (`shift_right`); eos_token_id: the end of a target sentence.
    share_embeddings: ONE matrix for the source embedding, the target embedding and the output
        projection (Vaswani et al. 2017 section 3.4); needs one vocabulary (src_vocab_size ==
        tgt_vocab_size) and implies tie_output.
    tie_output: the target embedding is the output projection's weight (Press & Wolf 2017).
    label_smoothing: eps_ls of the training loss (section 5.4).
    norm_first: pre-norm blocks (Xiong et al. 2020) instead of the paper's post-norm.
    """

    src_vocab_size: int
    tgt_vocab_size: int
    embed_dim: int = 512
    num_heads: int = 8
    num_encoder_layers: int = 6
    num_decoder_layers: int = 6
    ffn_dim: int = 2048
    dropout: float = 0.1
    max_positions: int = 1024
    pad_token_id: int = 0
    bos_token_id: int = 1
    eos_token_id: int = 2
    share_embeddings: bool = False
    tie_output: bool = True
    label_smoothing: float = 0.1
    norm_first: bool = False

    def __post_init__(self) -> None:
        _check_sizes(self)
        _check_token_ids(self)
        _check_flags(self)

    @classmethod
    def from_name(cls, name: str, **overrides: Any) -> TransformerConfig:
        """A named preset ("transformer-base", "transformer-big", "transformer-tiny"), with
        any field replaced by `overrides` (e.g. `dropout=0.0`, `src_vocab_size=8000`)."""
        if name not in TRANSFORMER_PRESETS:
            raise ValueError(f"name: expected one of {sorted(TRANSFORMER_PRESETS)}, got {name!r}")
        fields = {field.name for field in dataclasses.fields(cls)}
        unknown = sorted(set(overrides) - fields)
        if unknown:
            raise TypeError(
                f"overrides: {unknown} are not fields; expected some of {sorted(fields)}"
            )
        return cls(**{**TRANSFORMER_PRESETS[name], **overrides})


_PAPER_VOCAB = 37000  # WMT 2014 En-De, shared source-target byte-pair encoding (section 5.1)

TRANSFORMER_PRESETS: dict[str, dict[str, Any]] = {
    # Vaswani et al. 2017, Table 3, row "base": N=6, d_model=512, d_ff=2048, h=8, P_drop=0.1.
    "transformer-base": {
        "src_vocab_size": _PAPER_VOCAB,
        "tgt_vocab_size": _PAPER_VOCAB,
        "share_embeddings": True,
    },
    # Table 3, row "big": d_model=1024, d_ff=4096, h=16, P_drop=0.3 (0.1 for En-Fr).
    "transformer-big": {
        "src_vocab_size": _PAPER_VOCAB,
        "tgt_vocab_size": _PAPER_VOCAB,
        "embed_dim": 1024,
        "num_heads": 16,
        "ffn_dim": 4096,
        "dropout": 0.3,
        "share_embeddings": True,
    },
    # Small enough for tests and for a toy translation task on 2 CPU cores.
    "transformer-tiny": {
        "src_vocab_size": 128,
        "tgt_vocab_size": 128,
        "embed_dim": 32,
        "num_heads": 4,
        "num_encoder_layers": 2,
        "num_decoder_layers": 2,
        "ffn_dim": 64,
        "max_positions": 128,
        "share_embeddings": True,
    },
}


def _check_sizes(config: TransformerConfig) -> None:
    for name in (
        "src_vocab_size",
        "tgt_vocab_size",
        "embed_dim",
        "num_heads",
        "num_encoder_layers",
        "num_decoder_layers",
        "ffn_dim",
        "max_positions",
    ):
        check_positive_int(name, getattr(config, name))
    if config.embed_dim % config.num_heads:
        raise ValueError(
            f"embed_dim: {config.embed_dim} is not divisible by num_heads={config.num_heads}; "
            f"expected a multiple of num_heads"
        )
    if config.embed_dim % 2:
        raise ValueError(
            f"embed_dim: expected an even number (the sinusoidal encoding pairs sin and cos), "
            f"got {config.embed_dim}"
        )
    check_probability("dropout", config.dropout)
    check_probability("label_smoothing", config.label_smoothing)


def _check_token_ids(config: TransformerConfig) -> None:
    """pad is looked up in both vocabularies; bos and eos are target tokens."""
    limits = {
        "pad_token_id": min(config.src_vocab_size, config.tgt_vocab_size),
        "bos_token_id": config.tgt_vocab_size,
        "eos_token_id": config.tgt_vocab_size,
    }
    for name, limit in limits.items():
        value = check_int(name, getattr(config, name))
        if not 0 <= value < limit:
            raise ValueError(f"{name}: expected an id in [0, {limit}), got {value}")


def _check_flags(config: TransformerConfig) -> None:
    for name in ("share_embeddings", "tie_output", "norm_first"):
        value = getattr(config, name)
        if not isinstance(value, bool):
            raise TypeError(f"{name}: expected a bool, got {type(value).__name__} {value!r}")
    if config.share_embeddings and config.src_vocab_size != config.tgt_vocab_size:
        raise ValueError(
            f"share_embeddings: True needs one vocabulary, got src_vocab_size="
            f"{config.src_vocab_size} and tgt_vocab_size={config.tgt_vocab_size}; expected "
            f"equal sizes, or share_embeddings=False"
        )
    if config.share_embeddings and not config.tie_output:
        raise ValueError(
            "tie_output: False contradicts share_embeddings=True (one matrix for both embeddings "
            "and the output projection); expected tie_output=True, or share_embeddings=False"
        )
