"""BERT: a bidirectional Transformer encoder (Devlin et al. 2019).

    input_ids, token_type_ids                                                     (B, L)
    -> token + learned position + segment embeddings, LayerNorm, dropout          (B, L, E)
    -> num_layers post-norm encoder blocks: self-attention, then a GELU FFN       (B, L, E)
    -> last_hidden_state, and pooler_output = tanh(W h_[CLS] + b)                 (B, E)

BERT keeps only the Transformer's encoder stack, so every token attends to its left and right
context at once. Each input starts with [CLS]; its final hidden state, passed through the
pooler, is the sequence summary that classification heads read (Devlin et al. 2019, section 3).
The FFN uses the exact (erf) GELU (Hendrycks & Gimpel 2016). `share_layers=True` applies one
block num_layers times, ALBERT's cross-layer parameter sharing (Lan et al. 2019).

The pre-training and classification heads live in `qkv.models.bert_heads`; checkpoint names
(`word_embeddings`, `attention.self.query`, ...) only in `qkv.models.checkpoints.bert`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from qkv.layers import EncoderBlock, LayerNorm
from qkv.layers._checks import check_positive_float, check_positive_int, check_probability
from qkv.layers._dropout import make_dropout
from qkv.models.checkpoints import HuggingFaceIO
from qkv.models.outputs import EncoderOutput
from qkv.models.sizes import check_model_fits
from qkv.positional import LearnedPositionalEmbedding

__all__ = ["BertConfig", "BertEmbeddings", "BertModel", "init_bert_weights", "mean_pool"]


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
        if name not in BERT_PRESETS:
            raise ValueError(f"name: expected one of {sorted(BERT_PRESETS)}, got {name!r}")
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(overrides) - fields)
        if unknown:
            raise TypeError(
                f"overrides: unknown fields {unknown}; expected some of {sorted(fields)}"
            )
        return dataclasses.replace(BERT_PRESETS[name], **overrides)


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


class BertEmbeddings(nn.Module):
    """x = LayerNorm(token(input_ids) + segment(token_type_ids) + position(0..L-1)), dropout.

    The three embeddings are summed (Devlin et al. 2019, Figure 2); the segment embedding tells
    sentence A (type 0) from sentence B (type 1) in a [CLS] A [SEP] B [SEP] input.
    """

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        E = config.embed_dim
        self.token_embedding = nn.Embedding(config.vocab_size, E, padding_idx=config.pad_token_id)
        self.segment_embedding = nn.Embedding(config.type_vocab_size, E)
        self.position_embedding = LearnedPositionalEmbedding(config.max_positions, E)
        self.norm = LayerNorm(E, eps=config.norm_eps)
        self.dropout = make_dropout(config.dropout)

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor) -> torch.Tensor:
        """input_ids, token_type_ids (B, L) -> (B, L, E)."""
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)  # (L,)
        x = self.token_embedding(input_ids) + self.segment_embedding(token_type_ids)  # (B, L, E)
        x = x + self.position_embedding(positions)  # (B, L, E) + (L, E)
        return self.dropout(self.norm(x))


def _encoder_block(config: BertConfig) -> EncoderBlock:
    """One post-norm block with BERT's dropouts (transformers' `BertLayer`): attention weights
    at `attention_dropout`, sub-layer outputs at `dropout`, none inside the FFN."""
    return EncoderBlock(
        config.embed_dim,
        config.num_heads,
        config.ffn_dim,
        dropout=config.dropout,
        attention_dropout=config.attention_dropout,
        ffn_dropout=0.0,
        activation="gelu",
        norm_first=False,
        eps=config.norm_eps,
    )


@torch.no_grad()
def init_bert_weights(module: nn.Module, std: float = 0.02) -> None:
    """BERT's initialisation: N(0, 0.02^2) weights, zero biases, LayerNorm 1 and 0, and a zero
    padding row. Use it with `model.apply(init_bert_weights)`."""
    if isinstance(module, nn.Linear):
        nn.init.normal_(module.weight, std=std)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, (nn.Embedding, LearnedPositionalEmbedding)):
        nn.init.normal_(module.weight, std=std)
        if getattr(module, "padding_idx", None) is not None:
            module.weight[module.padding_idx].zero_()
    elif isinstance(module, LayerNorm):
        nn.init.ones_(module.weight)
        if module.bias is not None:
            nn.init.zeros_(module.bias)


class BertModel(HuggingFaceIO, nn.Module):
    """The BERT encoder: embeddings, num_layers post-norm blocks, tanh pooler over [CLS].

    Submodules: `embeddings` (BertEmbeddings), `layers` (num_layers EncoderBlocks, or one when
    config.share_layers), `pooler` (Linear(E, E), followed by tanh).
    """

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        if not isinstance(config, BertConfig):
            raise TypeError(f"config: expected a BertConfig, got {type(config).__name__}")
        check_model_fits(config)  # before allocating: sizes may come from a file
        self.config = config
        self.embeddings = BertEmbeddings(config)
        num_blocks = 1 if config.share_layers else config.num_layers
        self.layers = nn.ModuleList(_encoder_block(config) for _ in range(num_blocks))
        self.pooler = nn.Linear(config.embed_dim, config.embed_dim)
        self.apply(init_bert_weights)

    def layer(self, index: int) -> EncoderBlock:
        """The block applied at depth `index` (always the one block when layers are shared)."""
        return self.layers[0 if self.config.share_layers else index]

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
    ) -> EncoderOutput:
        """input_ids (B, L) token ids; attention_mask (B, L), 1/True on real tokens and 0/False
        on padding (the polarity of `qkv.masks`); token_type_ids (B, L) segment ids, default 0.

        Returns EncoderOutput(last_hidden_state (B, L, E), pooler_output (B, E)).
        """
        key_mask, token_type_ids = _check_inputs(
            self.config, input_ids, attention_mask, token_type_ids
        )
        x = self.embeddings(input_ids, token_type_ids)  # (B, L, E)
        # An all-real mask is dropped so attention takes its mask-free fast path (as GPT does).
        if key_mask is not None and bool(key_mask.all()):
            key_mask = None
        mask = None if key_mask is None else key_mask[:, None, None, :]  # (B, 1, 1, L)
        for index in range(self.config.num_layers):
            x = self.layer(index)(x, mask=mask)
        pooled = torch.tanh(self.pooler(x[:, 0]))  # (B, E), from the [CLS] position
        return EncoderOutput(last_hidden_state=x, pooler_output=pooled)


def mean_pool(
    last_hidden_state: torch.Tensor, attention_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """The mean of the hidden states over real tokens: (B, L, E), (B, L) -> (B, E).

    This is Sentence-BERT's pooling (Reimers & Gurevych 2019), what sentence-transformers does
    for all-MiniLM-L6-v2. attention_mask: 1/True on real tokens; None averages every position.
    """
    if not isinstance(last_hidden_state, torch.Tensor) or last_hidden_state.dim() != 3:
        raise ValueError(
            f"last_hidden_state: expected a tensor of shape (B, L, E), got "
            f"{_describe(last_hidden_state)}"
        )
    if attention_mask is None:
        return last_hidden_state.mean(dim=1)
    if (
        not isinstance(attention_mask, torch.Tensor)
        or attention_mask.shape != last_hidden_state.shape[:2]
    ):
        raise ValueError(
            f"attention_mask: expected shape {tuple(last_hidden_state.shape[:2])} (B, L), got "
            f"{_describe(attention_mask)}"
        )
    weights = (attention_mask != 0).to(last_hidden_state.dtype).unsqueeze(-1)  # (B, L, 1)
    total = (last_hidden_state * weights).sum(dim=1)  # (B, E)
    # the clamp keeps an all-padding row at 0 instead of 0/0, as sentence-transformers does
    return total / weights.sum(dim=1).clamp(min=1e-9)  # (B, E)


def _check_inputs(
    config: BertConfig,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    token_type_ids: torch.Tensor | None,
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Validate a BERT call; returns (key mask as bool (B, L) or None, token_type_ids (B, L))."""
    _check_ids("input_ids", input_ids, None, config.vocab_size)
    B, L = input_ids.shape
    if config.max_positions < L:
        raise ValueError(
            f"input_ids: length {L} exceeds max_positions={config.max_positions}; expected at "
            f"most {config.max_positions} tokens (truncate or split the text)"
        )
    if token_type_ids is None:
        token_type_ids = torch.zeros_like(input_ids)
    else:
        _check_ids("token_type_ids", token_type_ids, (B, L), config.type_vocab_size)
    if attention_mask is None:
        return None, token_type_ids
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.shape != (B, L):
        raise ValueError(
            f"attention_mask: expected shape ({B}, {L}) (that of input_ids, 1 on real tokens), "
            f"got {_describe(attention_mask)}"
        )
    return attention_mask != 0, token_type_ids


def _check_ids(name: str, ids: object, shape: tuple | None, upper: int) -> None:
    if not isinstance(ids, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor of token ids, got {type(ids).__name__}")
    if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise TypeError(f"{name}: expected an integer tensor, got dtype {ids.dtype}")
    expected = "(B, L)" if shape is None else str(shape)
    if ids.dim() != 2 or (shape is not None and tuple(ids.shape) != shape) or ids.shape[1] == 0:
        raise ValueError(f"{name}: expected shape {expected}, got {tuple(ids.shape)}")
    smallest, largest = int(ids.min()), int(ids.max())
    if smallest < 0 or largest >= upper:
        raise ValueError(
            f"{name}: expected values in [0, {upper}), got values in [{smallest}, {largest}]"
        )


def _describe(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    return f"{type(value).__name__}"
