"""What every qkv model returns: a small frozen dataclass with named fields.

One calling convention for every model: `model(input_ids, attention_mask=None, ...)`, where
`attention_mask` is (B, L) with 1/True on real tokens (the polarity of `qkv.masks`). Encoders
fill `last_hidden_state`; models with a head fill `logits`; `loss` is set when labels are given.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class EncoderOutput:
    last_hidden_state: torch.Tensor  # (B, L, E)
    pooler_output: torch.Tensor | None = None  # (B, E), e.g. BERT's tanh-pooled [CLS]


@dataclass(frozen=True)
class CausalLMOutput:
    logits: torch.Tensor  # (B, L, V)
    loss: torch.Tensor | None = None  # mean next-token cross-entropy when labels are given
    last_hidden_state: torch.Tensor | None = None  # (B, L, E), after the final norm
    # A decoding step that reduces its last logits itself (a compiled one) also gives each
    # row's largest logit (B,) and its first index (B,) int64, as `torch.argmax` would.
    top_logit: torch.Tensor | None = None
    top_token: torch.Tensor | None = None


@dataclass(frozen=True)
class PreTrainingOutput:
    logits: torch.Tensor  # (B, L, V) masked-language-model scores
    nsp_logits: torch.Tensor  # (B, 2) next-sentence prediction: 0 = is next, 1 = random
    loss: torch.Tensor | None = None  # MLM + NSP when labels are given
    last_hidden_state: torch.Tensor | None = None


@dataclass(frozen=True)
class ClassificationOutput:
    logits: torch.Tensor  # (B, num_labels)
    loss: torch.Tensor | None = None


@dataclass(frozen=True)
class Seq2SeqOutput:
    logits: torch.Tensor  # (B, L_tgt, V)
    loss: torch.Tensor | None = None  # label-smoothed cross-entropy when labels are given
    encoder_last_hidden_state: torch.Tensor | None = None  # (B, L_src, E)
