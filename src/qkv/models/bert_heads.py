"""BERT with heads: pre-training (MLM + NSP) and sequence classification.

Pre-training (Devlin et al. 2019, section 3.1):
- Masked language model: about 15% of the tokens are selected and must be predicted from both
  sides. The head is dense -> GELU -> LayerNorm -> a decoder whose weight IS the input token
  embedding matrix (weight tying, Press & Wolf 2017: z = E h, E in R^{V x d}), plus its own bias.
- Next sentence prediction: from the pooled [CLS] state, is sentence B the one that follows A
  (label 0) or a random one (label 1)?

Classification (Devlin et al. 2019, section 4.1): dropout and a linear layer on the pooled [CLS]
state.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from qkv.layers import LayerNorm
from qkv.layers._dropout import make_dropout
from qkv.models.bert import BertConfig, BertModel, init_bert_weights
from qkv.models.losses import cross_entropy
from qkv.models.outputs import ClassificationOutput, PreTrainingOutput
from qkv.models.pretrained import PretrainedIO
from qkv.models.serialization import register_model_class
from qkv.models.sizes import LABEL_NAME_BYTES, SizePart, check_model_fits
from qkv.validation import check_positive_int, describe

__all__ = ["BertForPreTraining", "BertForSequenceClassification", "MaskedLMHead"]


class MaskedLMHead(nn.Module):
    """logits = LayerNorm(GELU(dense(h))) @ token_embedding^T + bias: (B, L, E) -> (B, L, V).

    The decoder matrix is not a parameter of this head: the caller passes the token embedding
    weight (V, E), so input and output embeddings stay one tensor, in training too.
    """

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(config.embed_dim, config.embed_dim)
        self.norm = LayerNorm(config.embed_dim, eps=config.norm_eps)
        self.bias = nn.Parameter(torch.zeros(config.vocab_size))  # (V,)

    def forward(self, hidden: torch.Tensor, token_embedding: torch.Tensor) -> torch.Tensor:
        h = self.norm(F.gelu(self.dense(hidden)))  # (B, L, E)
        return F.linear(h, token_embedding, self.bias)  # (B, L, V)


class BertForPreTraining(PretrainedIO, nn.Module):
    """BERT with its two pre-training heads. Submodules: `bert` (BertModel), `mlm_head`
    (MaskedLMHead, decoder tied to bert.embeddings.token_embedding), `nsp_head` (Linear(E, 2))."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.config = config
        self.bert = BertModel(config)
        self.mlm_head = MaskedLMHead(config)
        self.nsp_head = nn.Linear(config.embed_dim, 2)
        self.mlm_head.apply(init_bert_weights)
        self.nsp_head.apply(init_bert_weights)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        next_sentence_label: torch.Tensor | None = None,
        *,
        masked_positions: torch.Tensor | None = None,
        sequence_lengths: Sequence[int] | None = None,
    ) -> PreTrainingOutput:
        """input_ids, attention_mask, token_type_ids, sequence_lengths as in `BertModel.forward`
        (B, L); packed (sequence_lengths), next-sentence logits and labels are one per input,
        (B * S, 2) and (B * S,).

        labels (B, L): the original ids of the selected tokens, -100 elsewhere (no loss there).
        next_sentence_label (B,): 0 if sentence B follows A, 1 if it is random.
        loss = mean MLM cross-entropy + mean NSP cross-entropy, of whichever labels are given
        (transformers' BertForPreTraining returns a loss only when both are given).
        masked_positions (B, L) bool: score only these positions (the ~15% selected), as
        Google's BERT gathers `masked_lm_positions`; logits are then (N, V) for the N True
        positions in row-major order. The MLM head (E x V) at every position is most of a small
        model's step otherwise.
        """
        encoded = self.bert(
            input_ids, attention_mask, token_type_ids, sequence_lengths=sequence_lengths
        )
        token_embedding = self.bert.embeddings.token_embedding.weight  # (V, E), tied
        hidden = encoded.last_hidden_state  # (B, L, E)
        if masked_positions is not None:
            _check_positions(masked_positions, tuple(input_ids.shape))
            hidden = hidden[masked_positions]  # (N, E)
        logits = self.mlm_head(hidden, token_embedding)  # (B, L, V), or (N, V)
        nsp_logits = self.nsp_head(encoded.pooler_output).reshape(-1, 2)  # (B, 2), or (B * S, 2)
        losses = []
        if labels is not None:
            _check_labels("labels", labels, tuple(input_ids.shape))
            if masked_positions is not None:
                labels = labels[masked_positions]  # (N,)
            flat_logits = logits.reshape(-1, logits.shape[-1])  # (B * L, V) or (N, V)
            losses.append(cross_entropy(flat_logits, labels.reshape(-1)))  # skips -100
        if next_sentence_label is not None:
            _check_labels("next_sentence_label", next_sentence_label, (nsp_logits.shape[0],))
            losses.append(F.cross_entropy(nsp_logits, next_sentence_label))
        return PreTrainingOutput(
            logits=logits,
            nsp_logits=nsp_logits,
            loss=sum(losses) if losses else None,
            last_hidden_state=encoded.last_hidden_state,
        )


class BertForSequenceClassification(PretrainedIO, nn.Module):
    """BERT, then dropout and Linear(E, num_labels) on the pooled [CLS] state.

    label_names: optional names of the classes (config.json's id2label), kept through
    from_pretrained / save_pretrained; default "LABEL_0", "LABEL_1", ... as transformers does.
    Submodules: `bert`, `dropout`, `classifier`.
    """

    def __init__(
        self,
        config: BertConfig,
        num_labels: int = 2,
        *,
        label_names: Sequence[str] | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(config, BertConfig):
            raise TypeError(f"config: expected a BertConfig, got {type(config).__name__}")
        self.config = config
        self.num_labels = check_positive_int("num_labels", num_labels)
        # before the label names and the classifier are allocated: num_labels may come from a file
        E = config.embed_dim
        classifier = SizePart(
            f"num_labels={num_labels} classifier (embed_dim={E})",
            num_labels * (E + 1),
            0 if label_names is not None else num_labels * LABEL_NAME_BYTES,
        )
        check_model_fits(config, extra=(classifier,))
        if label_names is None:
            label_names = [f"LABEL_{i}" for i in range(num_labels)]
        if isinstance(label_names, str) or len(label_names) != num_labels:
            raise ValueError(
                f"label_names: expected {num_labels} names (one per label), got {label_names!r}"
            )
        self.label_names = tuple(str(name) for name in label_names)
        self.bert = BertModel(config)
        self.dropout = make_dropout(config.dropout)
        self.classifier = nn.Linear(config.embed_dim, num_labels)
        self.classifier.apply(init_bert_weights)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
    ) -> ClassificationOutput:
        """input_ids, attention_mask, token_type_ids as in `BertModel.forward` (B, L).

        labels, as transformers infers the problem from them: num_labels == 1 -> regression
        targets (B,) and mean squared error; integer labels (B,) -> cross-entropy; float labels
        (B, num_labels) -> multi-label binary cross-entropy with logits.
        """
        pooled = self.bert(input_ids, attention_mask, token_type_ids).pooler_output  # (B, E)
        logits = self.classifier(self.dropout(pooled))  # (B, num_labels)
        loss = None if labels is None else self._loss(logits, labels)
        return ClassificationOutput(logits=logits, loss=loss)

    def _loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        B = logits.shape[0]
        if not isinstance(labels, torch.Tensor):
            raise TypeError(f"labels: expected a torch.Tensor, got {type(labels).__name__}")
        if self.num_labels == 1:
            if labels.numel() != B:
                raise ValueError(f"labels: expected {B} regression targets, got {labels.shape}")
            return F.mse_loss(logits.reshape(B), labels.reshape(B).to(logits.dtype))
        if labels.is_floating_point():
            if labels.shape != logits.shape:
                raise ValueError(
                    f"labels: float labels are multi-label targets, expected shape "
                    f"{tuple(logits.shape)}, got {tuple(labels.shape)}"
                )
            return F.binary_cross_entropy_with_logits(logits, labels)
        _check_labels("labels", labels, (B,))
        return F.cross_entropy(logits, labels)


def _check_labels(name: str, labels: object, shape: tuple[int, ...]) -> None:
    if not isinstance(labels, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(labels).__name__}")
    if labels.is_floating_point() or labels.dtype == torch.bool:
        raise TypeError(f"{name}: expected an integer tensor, got dtype {labels.dtype}")
    if tuple(labels.shape) != shape:
        raise ValueError(f"{name}: expected shape {shape}, got {tuple(labels.shape)}")


register_model_class(BertModel, BertConfig)
register_model_class(BertForPreTraining, BertConfig)


def _check_positions(masked_positions: object, shape: tuple[int, int]) -> None:
    if (
        not isinstance(masked_positions, torch.Tensor)
        or masked_positions.dtype != torch.bool
        or tuple(masked_positions.shape) != shape
    ):
        raise ValueError(
            f"masked_positions: expected a bool tensor of shape (B, L) = {shape}, got "
            f"{describe(masked_positions)}"
        )
