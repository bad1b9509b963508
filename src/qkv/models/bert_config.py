"""The sizes and options of BERT (Devlin et al. 2019), checked when made: `BertConfig`.

Its own module, like `GPTConfig` and `TransformerConfig`, so that what only reads a
configuration (the size bound of `qkv.models.sizes`, the checkpoint readers) does not import
the model.
"""

from __future__ import annotations

from dataclasses import dataclass

from qkv.validation import check_positive_float, check_positive_int, check_probability, preset

__all__ = ["BertConfig"]


@dataclass(frozen=True)
class BertConfig:
    """Sizes of a BERT encoder. The defaults are BERT-base (Devlin et al. 2019, section 3).

    vocab_size V, embed_dim E (hidden size), num_layers, num_heads H (head_dim E // H), ffn_dim
    (the FFN's hidden width, 4 * E in BERT), max_positions (rows of the learned position table:
    the longest input), type_vocab_size (segments: 2 for sentence A / B), norm_eps (LayerNorm
    epsilon), dropout (embeddings, sub-layer outputs, classifier), attention_dropout (attention
    weights), pad_token_id (its embedding row gets no gradient; None for none), share_layers
    (one block applied num_layers times, as ALBERT).
    """

    vocab_size: int = 30522
    embed_dim: int = 768
    num_layers: int = 12
    num_heads: int = 12
    ffn_dim: int = 3072
    max_positions: int = 512
    type_vocab_size: int = 2
    norm_eps: float = 1e-12
    dropout: float = 0.1
    attention_dropout: float = 0.1
    pad_token_id: int | None = 0
    share_layers: bool = False

    def __post_init__(self) -> None:
        for name in ("vocab_size", "embed_dim", "num_layers", "num_heads", "ffn_dim"):
            check_positive_int(name, getattr(self, name))
        check_positive_int("max_positions", self.max_positions)
        check_positive_int("type_vocab_size", self.type_vocab_size)
        check_positive_float("norm_eps", self.norm_eps)
        check_probability("dropout", self.dropout)
        check_probability("attention_dropout", self.attention_dropout)
        if self.embed_dim % self.num_heads:
            raise ValueError(
                f"embed_dim: {self.embed_dim} is not divisible by num_heads={self.num_heads}; "
                f"expected a multiple of num_heads (head_dim = embed_dim // num_heads)"
            )
        pad = self.pad_token_id
        if pad is not None and (isinstance(pad, bool) or not isinstance(pad, int)):
            raise TypeError(f"pad_token_id: expected an int or None, got {type(pad).__name__}")
        if pad is not None and not 0 <= pad < self.vocab_size:
            raise ValueError(
                f"pad_token_id: expected None or an id in [0, {self.vocab_size}), got {pad}"
            )
        if not isinstance(self.share_layers, bool):
            raise TypeError(
                f"share_layers: expected a bool, got {type(self.share_layers).__name__} "
                f"{self.share_layers!r}"
            )

    @property
    def head_dim(self) -> int:
        return self.embed_dim // self.num_heads

    @classmethod
    def from_name(cls, name: str, **overrides: object) -> BertConfig:
        """A named preset (see `BERT_PRESETS`), optionally with some fields replaced."""
        return preset(BERT_PRESETS, name, overrides)


BERT_PRESETS: dict[str, BertConfig] = {
    "bert-base-uncased": BertConfig(),
    "bert-large-uncased": BertConfig(embed_dim=1024, num_layers=24, num_heads=16, ffn_dim=4096),
    # sentence-transformers/all-MiniLM-L6-v2: 6 layers of width 384 (Wang et al. 2020, MiniLM)
    "all-MiniLM-L6-v2": BertConfig(embed_dim=384, num_layers=6, num_heads=12, ffn_dim=1536),
    # a small model for tests and examples: runs in milliseconds on a CPU
    "tiny": BertConfig(
        vocab_size=128, embed_dim=32, num_layers=2, num_heads=4, ffn_dim=64, max_positions=64
    ),
}
