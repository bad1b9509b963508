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

from collections.abc import Sequence

import torch
from torch import nn

from qkv.attention.option_checks import check_pattern
from qkv.attention.sparse import Packed, SparsePattern
from qkv.layers import EncoderBlock, LayerNorm
from qkv.layers._dropout import make_dropout
from qkv.models.bert_config import BertConfig
from qkv.models.outputs import EncoderOutput
from qkv.models.pretrained import PretrainedIO
from qkv.models.sizes import check_model_fits
from qkv.positional import LearnedPositionalEmbedding
from qkv.validation import describe

__all__ = ["BertConfig", "BertEmbeddings", "BertModel", "init_bert_weights", "mean_pool"]


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

    def forward(
        self,
        input_ids: torch.Tensor,
        token_type_ids: torch.Tensor,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """input_ids, token_type_ids (B, L) -> (B, L, E); positions (L,), default 0 .. L - 1."""
        if positions is None:
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


class BertModel(PretrainedIO, nn.Module):
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
        *,
        sequence_lengths: Sequence[int] | None = None,
        pattern: SparsePattern | None = None,
    ) -> EncoderOutput:
        """input_ids (B, L) token ids; attention_mask (B, L), 1/True on real tokens and 0/False
        on padding (the polarity of `qkv.masks`); token_type_ids (B, L) segment ids, default 0.
        sequence_lengths: several inputs packed along L without padding (lengths summing to L,
        each at most max_positions): each attends only to itself (`qkv.sparse.Packed`) and its
        positions restart at 0.
        pattern: a sparse pattern (`qkv.sparse`) given to every self-attention layer and
        intersected there with the padding mask: Longformer's window + global [CLS] for long
        inputs (`Window(w, w) | GlobalTokens.first(1)`, Beltagy et al. 2020) or BigBird's
        `bigbird(...)` (Zaheer et al. 2020). Positions stay learned and absolute, so L is still
        at most max_positions. Not with sequence_lengths (which is a pattern itself).

        Returns EncoderOutput(last_hidden_state (B, L, E), pooler_output (B, E) from the
        [CLS] position; (B, S, E) with sequence_lengths, one per packed input).
        """
        if pattern is not None and sequence_lengths is not None:
            raise ValueError("pattern: packed inputs (sequence_lengths) are a pattern of their "
                             "own; expected pattern=None with sequence_lengths")  # fmt: skip
        packed, positions, starts = _packed(self.config, input_ids, attention_mask,
                                            sequence_lengths)  # fmt: skip
        key_mask, token_type_ids = _check_inputs(
            self.config, input_ids, attention_mask, token_type_ids, packed=packed is not None
        )
        if pattern is None:
            pattern = packed
        else:  # a wrong type fails here, naming `pattern`, not inside the first layer
            check_pattern(pattern, input_ids.shape[1], input_ids.shape[1])
        x = self.embeddings(input_ids, token_type_ids, positions)  # (B, L, E)
        # An all-real mask is dropped so attention takes its mask-free fast path (as GPT does).
        if key_mask is not None and bool(key_mask.all()):
            key_mask = None
        mask = None if key_mask is None else key_mask[:, None, None, :]  # (B, 1, 1, L)
        for index in range(self.config.num_layers):
            x = self.layer(index)(x, mask=mask, pattern=pattern)
        first = x[:, 0] if starts is None else x[:, starts]  # (B, E), or (B, S, E) packed
        pooled = torch.tanh(self.pooler(first))  # from the [CLS] position(s)
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
            f"{describe(last_hidden_state)}"
        )
    if attention_mask is None:
        return last_hidden_state.mean(dim=1)
    if (
        not isinstance(attention_mask, torch.Tensor)
        or attention_mask.shape != last_hidden_state.shape[:2]
    ):
        raise ValueError(
            f"attention_mask: expected shape {tuple(last_hidden_state.shape[:2])} (B, L), got "
            f"{describe(attention_mask)}"
        )
    weights = (attention_mask != 0).to(last_hidden_state.dtype).unsqueeze(-1)  # (B, L, 1)
    total = (last_hidden_state * weights).sum(dim=1)  # (B, E)
    # the clamp keeps an all-padding row at 0 instead of 0/0, as sentence-transformers does
    return total / weights.sum(dim=1).clamp(min=1e-9)  # (B, E)


def _packed(config: BertConfig, input_ids, attention_mask, sequence_lengths):
    """(pattern, positions (L,), starts (S,)) of a packed call, or (None, None, None)."""
    if sequence_lengths is None:
        return None, None, None
    if attention_mask is not None:
        raise ValueError(
            "attention_mask: packed inputs (sequence_lengths) have no padding; expected None"
        )
    _check_ids("input_ids", input_ids, None, config.vocab_size)
    pattern = Packed.from_lengths(sequence_lengths)
    L = input_ids.shape[-1]
    if pattern.query_offsets[-1] != L:
        raise ValueError(
            f"sequence_lengths: {list(sequence_lengths)} sum to {pattern.query_offsets[-1]}, "
            f"expected the packed length L={L}"
        )
    if max(sequence_lengths) > config.max_positions:
        raise ValueError(
            f"sequence_lengths: an input of {max(sequence_lengths)} tokens exceeds "
            f"max_positions={config.max_positions}"
        )
    starts = torch.tensor(pattern.query_offsets[:-1], device=input_ids.device)
    return pattern, pattern.positions(input_ids.device), starts  # positions (L,)


def _check_inputs(
    config: BertConfig,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    token_type_ids: torch.Tensor | None,
    *,
    packed: bool = False,
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Validate a BERT call; returns (key mask as bool (B, L) or None, token_type_ids (B, L))."""
    _check_ids("input_ids", input_ids, None, config.vocab_size)
    B, L = input_ids.shape
    if config.max_positions < L and not packed:  # packed: each input is checked alone
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
            f"got {describe(attention_mask)}"
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
