"""Recurrent encoder-decoders for translation, as they were before the Transformer.

    source ids -> embedding -> bidirectional GRU -> annotations h_j = [fwd h_j; bwd h_j]  (B, S, C)
                                                  -> fixed context c = [fwd h_S; bwd h_1]  (B, C)
    s_0 = tanh(W_s c); at each target step the decoder reads y_{i-1}, updates its GRU state and
    emits the attentional hidden state tanh(W_c [context; state]) -> output projection -> logits

One encoder (a bidirectional GRU, Bahdanau et al. 2015 s3.2; `qkv.layers.GRU`) serves every
kind, so that the kinds differ only in the context each target step reads (`attention`):

- "none": the fixed context vector c, the encoder's final states alone, fed to every step
  with y_{i-1} and to the output (Cho et al. 2014 s2.2, "Learning Phrase Representations using
  RNN Encoder-Decoder"; Sutskever et al. 2014 pass the final state alone). Whatever the source
  length, it must fit in C numbers.
- "additive": Bahdanau et al. 2015 ("Neural Machine Translation by Jointly Learning to Align
  and Translate", s3.1): c_i from the previous state s_{i-1} (`AdditiveAttention`), then
  s_i = GRU([E y_{i-1}; c_i], s_{i-1}). The context enters the recurrence, so this decoder runs
  one step at a time even under teacher forcing.
- "dot", "general": Luong et al. 2015 ("Effective Approaches to Attention-based Neural Machine
  Translation", s3.1): s_t = GRU(E y_{t-1}, s_{t-1}) first, then c_t from s_t (`DotAttention`,
  `GeneralAttention`) and h~_t = tanh(W_c [c_t; s_t]) (their eq. 5), without input feeding
  (s3.3), so teacher forcing runs the GRU over the whole target at once.

Every kind ends in the same readout tanh(W_c [context; s_i]) and output projection (Luong et
al.'s eq. 5-6), in place of Bahdanau et al.'s maxout layer (appendix A.2.2), and every kind
starts from s_0 = tanh(W_s c), both final states, where Bahdanau et al. use the backward one
alone. The decoder's state has the annotations' width C = 2 * hidden_size, which the dot score
needs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from qkv.layers._dropout import make_dropout
from qkv.layers.recurrent import GRU, GRUCell
from qkv.layers.rnn_attention import AdditiveAttention, DotAttention, GeneralAttention
from qkv.models._inputs import check_ids
from qkv.models.encoder_decoder import teacher_forcing_inputs
from qkv.models.losses import sequence_cross_entropy
from qkv.validation import check_choice, check_int, check_positive_int, check_probability, describe

__all__ = [
    "ATTENTION_KINDS",
    "RNNDecoderState",
    "RNNSeq2Seq",
    "RNNSeq2SeqConfig",
    "RNNSeq2SeqOutput",
]

ATTENTION_KINDS = ("none", "additive", "dot", "general")


@dataclass(frozen=True)
class RNNSeq2SeqConfig:
    """Sizes of an `RNNSeq2Seq`. hidden_size is each encoder direction's; the annotations and
    the decoder state have 2 * hidden_size. attention_dim: the additive score's hidden width."""

    src_vocab_size: int
    tgt_vocab_size: int
    attention: str = "additive"
    embed_dim: int = 64
    hidden_size: int = 64
    attention_dim: int = 64
    num_encoder_layers: int = 1
    dropout: float = 0.0
    share_embeddings: bool = False
    label_smoothing: float = 0.0
    pad_token_id: int = 0
    bos_token_id: int = 1
    eos_token_id: int = 2

    def __post_init__(self) -> None:
        check_choice("attention", self.attention, ATTENTION_KINDS)
        for name in ("src_vocab_size", "tgt_vocab_size", "embed_dim", "hidden_size",
                     "attention_dim", "num_encoder_layers"):  # fmt: skip
            check_positive_int(name, getattr(self, name))
        check_probability("dropout", self.dropout)
        check_probability("label_smoothing", self.label_smoothing)
        for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
            value = check_int(name, getattr(self, name), minimum=0)
            if value >= min(self.src_vocab_size, self.tgt_vocab_size):
                raise ValueError(
                    f"{name}: expected an id below both vocabulary sizes "
                    f"({self.src_vocab_size}, {self.tgt_vocab_size}), got {value}"
                )
        if self.share_embeddings and self.src_vocab_size != self.tgt_vocab_size:
            raise ValueError(
                f"share_embeddings: expected src_vocab_size == tgt_vocab_size, got "
                f"{self.src_vocab_size} and {self.tgt_vocab_size}"
            )

    @property
    def state_dim(self) -> int:
        """C: the width of the annotations, of the fixed context and of the decoder state."""
        return 2 * self.hidden_size


@dataclass
class RNNDecoderState:
    """What the decoder reads, and carries from one call to the next.

    hidden: s, the decoder's GRU state (B, C), updated by every call; memory: the annotations
    (B, S, C); memory_mask: (B, S), True on real source tokens; summary: the fixed context c
    (B, C); projected_memory: U_a h_j (B, S, A), the additive decoder's, computed on first use.
    """

    hidden: torch.Tensor
    memory: torch.Tensor
    memory_mask: torch.Tensor
    summary: torch.Tensor
    projected_memory: torch.Tensor | None = None


@dataclass
class RNNSeq2SeqOutput:
    """logits (B, L_tgt, V); loss when labels are given; encoder_last_hidden_state: the
    annotations (B, S, C); alignments: the attention weights (B, L_tgt, S), None for "none"."""

    logits: torch.Tensor
    loss: torch.Tensor | None = None
    encoder_last_hidden_state: torch.Tensor | None = None
    alignments: torch.Tensor | None = None


class FixedContextDecoder(nn.Module):
    """s_i = GRU([E y_{i-1}; c], s_{i-1}); features tanh(W_c [c; s_i]) (Cho et al. 2014 s2.2)."""

    def __init__(self, config: RNNSeq2SeqConfig) -> None:
        super().__init__()
        C = config.state_dim
        self.gru = GRU(config.embed_dim + C, C)
        self.readout = nn.Linear(2 * C, C)

    def forward(self, embedded: torch.Tensor, state: RNNDecoderState) -> tuple[torch.Tensor, None]:
        """embedded (B, L, E) -> (features (B, L, C), None); state.hidden moves L steps."""
        context = state.summary[:, None].expand(-1, embedded.shape[1], -1)  # (B, L, C)
        outputs, final = self.gru(torch.cat([embedded, context], dim=-1), state.hidden[None])
        state.hidden = final[0]
        return torch.tanh(self.readout(torch.cat([context, outputs], dim=-1))), None


class BahdanauDecoder(nn.Module):
    """c_i = attend(s_{i-1}); s_i = GRU([E y_{i-1}; c_i], s_{i-1}); features tanh(W_c [c_i; s_i])
    (Bahdanau et al. 2015 s3.1)."""

    def __init__(self, config: RNNSeq2SeqConfig) -> None:
        super().__init__()
        C = config.state_dim
        self.attention = AdditiveAttention(C, C, config.attention_dim)
        self.cell = GRUCell(config.embed_dim + C, C)
        self.readout = nn.Linear(2 * C, C)

    def forward(
        self, embedded: torch.Tensor, state: RNNDecoderState
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """embedded (B, L, E) -> (features (B, L, C), weights (B, L, S)), one step at a time."""
        if state.projected_memory is None:
            state.projected_memory = self.attention.project_memory(state.memory)  # (B, S, A)
        s, features, weights = state.hidden, [], []
        for i in range(embedded.shape[1]):
            context, alpha = self.attention(
                s, state.memory, mask=state.memory_mask, projected_memory=state.projected_memory
            )  # (B, C), (B, S): from s_{i-1}
            s = self.cell(torch.cat([embedded[:, i], context], dim=-1), s)
            features.append(torch.tanh(self.readout(torch.cat([context, s], dim=-1))))
            weights.append(alpha)
        state.hidden = s
        return torch.stack(features, dim=1), torch.stack(weights, dim=1)


class LuongDecoder(nn.Module):
    """s_t = GRU(E y_{t-1}, s_{t-1}); c_t = attend(s_t); features h~_t = tanh(W_c [c_t; s_t])
    (Luong et al. 2015 s3.1, eq. 5). attention: a `DotAttention` or `GeneralAttention`."""

    def __init__(self, config: RNNSeq2SeqConfig, *, attention: nn.Module) -> None:
        super().__init__()
        C = config.state_dim
        self.gru = GRU(config.embed_dim, C)
        self.attention = attention
        self.readout = nn.Linear(2 * C, C)

    def forward(
        self, embedded: torch.Tensor, state: RNNDecoderState
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """embedded (B, L, E) -> (features (B, L, C), weights (B, L, S))."""
        outputs, final = self.gru(embedded, state.hidden[None])  # (B, L, C)
        state.hidden = final[0]
        context, weights = self.attention(outputs, state.memory, mask=state.memory_mask)
        return torch.tanh(self.readout(torch.cat([context, outputs], dim=-1))), weights


def _decoder(config: RNNSeq2SeqConfig) -> nn.Module:
    C = config.state_dim
    if config.attention == "none":
        return FixedContextDecoder(config)
    if config.attention == "additive":
        return BahdanauDecoder(config)
    attention = DotAttention() if config.attention == "dot" else GeneralAttention(C, C)
    return LuongDecoder(config, attention=attention)


class RNNSeq2Seq(nn.Module):
    """A GRU encoder-decoder (see the module docstring), built from an `RNNSeq2SeqConfig`.

    Submodules: source_embedding and target_embedding (one module when share_embeddings),
    encoder (`GRU`, bidirectional), initial_state (W_s: c -> s_0), decoder (one of
    `FixedContextDecoder`, `BahdanauDecoder`, `LuongDecoder`), lm_head (C -> V_tgt).
    """

    def __init__(self, config: RNNSeq2SeqConfig) -> None:
        super().__init__()
        if not isinstance(config, RNNSeq2SeqConfig):
            raise TypeError(f"config: expected an RNNSeq2SeqConfig, got {type(config).__name__}")
        self.config = config
        E, H, C, pad = config.embed_dim, config.hidden_size, config.state_dim, config.pad_token_id
        self.source_embedding = nn.Embedding(config.src_vocab_size, E, padding_idx=pad)
        self.target_embedding = (
            self.source_embedding
            if config.share_embeddings
            else nn.Embedding(config.tgt_vocab_size, E, padding_idx=pad)
        )
        self.dropout = make_dropout(config.dropout)
        self.encoder = GRU(
            E, H, num_layers=config.num_encoder_layers, bidirectional=True, dropout=config.dropout
        )
        self.initial_state = nn.Linear(C, C)
        self.decoder = _decoder(config)
        self.lm_head = nn.Linear(C, config.tgt_vocab_size)

    def encode(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
    ) -> RNNDecoderState:
        """Source ids (B, S), right-padded, attention_mask (B, S) 1/True on real tokens -> the
        decoder's starting state: annotations, fixed context, s_0 = tanh(W_s c)."""
        check_ids("input_ids", input_ids, vocab_size=self.config.src_vocab_size)
        mask, lengths = _right_padded(attention_mask, input_ids)
        embedded = self.dropout(self.source_embedding(input_ids))  # (B, S, E)
        memory, finals = self.encoder(embedded, lengths=lengths)  # (B, S, C), (2 * layers, B, H)
        summary = torch.cat([finals[-2], finals[-1]], dim=-1)  # (B, C): last layer, both ways
        return RNNDecoderState(
            hidden=torch.tanh(self.initial_state(summary)), memory=memory, memory_mask=mask,
            summary=summary,
        )  # fmt: skip

    def decode(
        self, decoder_input_ids: torch.Tensor, state: RNNDecoderState
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Target ids (B, L) after the state's last step -> (logits (B, L, V_tgt), alignment
        weights (B, L, S) or None for "none"); state.hidden moves L steps."""
        check_ids("decoder_input_ids", decoder_input_ids, vocab_size=self.config.tgt_vocab_size)
        embedded = self.dropout(self.target_embedding(decoder_input_ids))  # (B, L, E)
        features, weights = self.decoder(embedded, state)  # (B, L, C)
        return self.lm_head(self.dropout(features)), weights

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        decoder_input_ids: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
    ) -> RNNSeq2SeqOutput:
        """Teacher-forced pass, the calling convention of `qkv.models.Transformer`: without
        decoder_input_ids they are the labels shifted right behind [BOS]; labels (B, L_tgt),
        -100 where nothing is predicted; loss: label-smoothed cross-entropy."""
        if labels is not None:
            check_ids("labels", labels, vocab_size=self.config.tgt_vocab_size, allow_ignored=True)
        decoder_input_ids = teacher_forcing_inputs(
            decoder_input_ids, labels, start_token_id=self.config.bos_token_id,
            pad_token_id=self.config.pad_token_id,
        )  # fmt: skip
        state = self.encode(input_ids, attention_mask)
        logits, weights = self.decode(decoder_input_ids, state)
        loss = None
        if labels is not None:
            loss = sequence_cross_entropy(
                logits, labels, label_smoothing=self.config.label_smoothing
            )
        return RNNSeq2SeqOutput(logits, loss, state.memory, weights)

    @torch.no_grad()
    def greedy_decode(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        *,
        max_new_tokens: int,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The most likely token at each step, up to [EOS] or max_new_tokens.

        Returns (sequences (B, 1 + T): [BOS], the tokens, pad_token_id after each [EOS];
        alignments (B, T, S): the weights each token was chosen with, 0 after its [EOS], or
        None for "none"). Call `model.eval()` first (dropout).
        """
        check_positive_int("max_new_tokens", max_new_tokens)
        config = self.config
        state = self.encode(input_ids, attention_mask)
        B = input_ids.shape[0]
        tokens = input_ids.new_full((B, 1), config.bos_token_id)  # (B, 1)
        alive = torch.ones(B, dtype=torch.bool, device=input_ids.device)
        alignments = []
        for _ in range(max_new_tokens):
            logits, weights = self.decode(tokens[:, -1:], state)  # (B, 1, V)
            chosen = torch.where(alive, logits[:, -1].argmax(dim=-1), config.pad_token_id)
            if weights is not None:
                alignments.append(weights[:, -1] * alive[:, None])  # (B, S)
            tokens = torch.cat([tokens, chosen[:, None]], dim=1)
            alive &= chosen != config.eos_token_id
            if not alive.any():
                break
        return tokens, torch.stack(alignments, dim=1) if alignments else None


def _right_padded(
    attention_mask: torch.Tensor | None, input_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(mask (B, S) bool, lengths (B,)) of a right-padded batch: the real tokens come first."""
    B, S = input_ids.shape
    if attention_mask is None:
        return torch.ones(B, S, dtype=torch.bool, device=input_ids.device), torch.full(
            (B,), S, dtype=torch.long, device=input_ids.device
        )
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.shape != (B, S):
        raise ValueError(
            f"attention_mask: expected shape ({B}, {S}), got {describe(attention_mask)}"
        )
    if attention_mask.is_floating_point():
        raise TypeError(f"attention_mask: expected bool or 0/1 ints, got {attention_mask.dtype}")
    mask = attention_mask.bool()
    lengths = mask.sum(dim=1)  # (B,)
    if not torch.equal(mask, torch.arange(S, device=mask.device) < lengths[:, None]):
        raise ValueError(
            "attention_mask: expected right padding (each row's real tokens first, then "
            "padding), got a row with padding before a real token"
        )
    return mask, lengths
