"""Texts longer than BERT's window: sliding-window chunks with a stride, aggregated per text.

BERT has a fixed maximum sequence length; two simple strategies for longer texts are
implemented here:
- Truncation: keep the first max_length tokens and drop the rest, simple but lossy
  (`truncate_ids`; `aggregation="first"` below gives the same result).
- Sliding window: split the text into overlapping chunks that each fit the model, run every
  chunk, and aggregate the chunks' outputs per text, e.g. by their mean or maximum
  (`chunk_ids`, then `embed_long` / `classify_long`).

A window is [CLS] + at most max_length - 2 content tokens + [SEP]. `stride` is what Hugging
Face tokenizers call it (`return_overflowing_tokens=True`): the number of tokens shared by two
consecutive windows, so window k starts at content token k * (max_length - 2 - stride). The
windows are exactly those of `BertTokenizerFast(text, truncation=True, max_length=...,
stride=..., return_overflowing_tokens=True)`.

    windows = chunk_texts(tokenizer, texts, max_length=256, stride=64)     # Windows, (W, L)
    vectors = embed_long(model, windows, aggregation="mean")              # (N, E)

`pattern=` runs every window with sparse attention (`qkv.sparse`); with one window per text
(`qkv.applications.whole_documents`) that is Longformer's single pass over a whole document.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from qkv.applications.windows import (
    Windows,
    chunk_batch,
    chunk_ids,
    chunk_texts,
    truncate_ids,
)
from qkv.attention.sparse import SparsePattern
from qkv.models.bert import BertModel, mean_pool
from qkv.models.bert_heads import BertForSequenceClassification
from qkv.validation import check_positive_int, describe

__all__ = [
    "AGGREGATIONS",
    "Windows",
    "aggregate_windows",
    "chunk_batch",
    "chunk_ids",
    "chunk_texts",
    "classify_long",
    "classify_long_texts",
    "embed_long",
    "embed_long_texts",
    "truncate_ids",
]

# mean: weighted by each window's token count; max: element-wise; first: the first window only,
# which is plain truncation.
AGGREGATIONS = ("mean", "max", "first")


def aggregate_windows(
    values: torch.Tensor, windows: Windows, *, aggregation: str = "mean"
) -> torch.Tensor:
    """One row per text from one row per window: (W, K) -> (N, K).

    mean: weighted by each window's number of real tokens ([CLS] and [SEP] included). For
    mean-pooled embeddings this is the mean over all tokens of all windows (a token inside an
    overlap counts once per window), and a short trailing window weighs less than a full one.
    max: element-wise maximum over the text's windows. first: the text's first window alone
    (plain truncation).
    """
    _check_aggregation(aggregation)
    if not isinstance(values, torch.Tensor) or values.dim() != 2:
        raise ValueError(f"values: expected a (W, K) tensor, got {describe(values)}")
    if values.shape[0] != windows.input_ids.shape[0]:
        raise ValueError(
            f"values: expected {windows.input_ids.shape[0]} rows (one per window), got "
            f"{values.shape[0]}"
        )
    index = windows.text_index.to(values.device)  # (W,)
    N, K = windows.num_texts, values.shape[1]
    if aggregation == "first":
        return values[_first_windows(windows).to(values.device)]  # (N, K)
    if aggregation == "max":
        result = values.new_full((N, K), float("-inf"))
        return result.scatter_reduce(0, index[:, None].expand(-1, K), values, "amax")  # (N, K)
    weights = windows.attention_mask.to(values.device).sum(dim=1).to(values.dtype)  # (W,)
    totals = values.new_zeros((N, K)).index_add(0, index, values * weights[:, None])  # (N, K)
    return totals / values.new_zeros(N).index_add(0, index, weights)[:, None]  # (N, K)


def embed_long(
    model: BertModel,
    windows: Windows,
    *,
    aggregation: str = "mean",
    normalize: bool = True,
    batch_size: int = 32,
    pattern: SparsePattern | None = None,
) -> torch.Tensor:
    """One embedding per text: each window mean-pooled over its real tokens (`mean_pool`,
    Sentence-BERT's pooling), the windows aggregated (`aggregate_windows`), then, with
    `normalize`, L2-normalised as qkv.applications.embed and sentence-transformers do -> (N, E).

    A text that fits in one window gets exactly its plain embedding. With "first", only the
    first window of each text is run: the truncation baseline. Gradients flow (wrap the call
    in torch.inference_mode() for inference); the model's train/eval mode is left as it is.
    pattern: a sparse pattern (`qkv.sparse`) for every window's attention, or None (dense).
    """
    if not isinstance(model, BertModel):
        raise TypeError(f"model: expected a qkv BertModel, got {type(model).__name__}")
    windows = _prepare(model.config.max_positions, windows, aggregation, batch_size)

    def pool(ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return mean_pool(model(ids, mask, pattern=pattern).last_hidden_state, mask)  # (b, E)

    pooled = _run_windows(pool, model, windows, batch_size)  # (W, E)
    vectors = aggregate_windows(pooled, windows, aggregation=aggregation)  # (N, E)
    return F.normalize(vectors, p=2, dim=1) if normalize else vectors


def classify_long(
    model: BertForSequenceClassification,
    windows: Windows,
    *,
    aggregation: str = "mean",
    batch_size: int = 32,
    pattern: SparsePattern | None = None,
) -> torch.Tensor:
    """Classification logits per text: the classifier's logits of each window, aggregated
    (`aggregate_windows`) -> (N, num_labels).

    Logits, not probabilities, are aggregated: the result is again logits, so softmax, argmax,
    losses, regression (num_labels=1) and multi-label heads use it unchanged; the weighted
    mean of logits is the (weighted) geometric mean of the windows' probabilities, normalised.
    "max" keeps, per class, the strongest score of any window; "first" is truncation.
    pattern: a sparse pattern (`qkv.sparse`) for every window's attention, or None (dense).
    """
    if not isinstance(model, BertForSequenceClassification):
        raise TypeError(
            f"model: expected a qkv BertForSequenceClassification, got {type(model).__name__}"
        )
    windows = _prepare(model.config.max_positions, windows, aggregation, batch_size)

    def logits(ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        if pattern is None:
            return model(ids, mask).logits  # (b, num_labels)
        # the head's own forward, with the pattern given to its encoder
        pooled = model.bert(ids, mask, pattern=pattern).pooler_output  # (b, E)
        return model.classifier(model.dropout(pooled))  # (b, num_labels)

    per_window = _run_windows(logits, model, windows, batch_size)  # (W, num_labels)
    return aggregate_windows(per_window, windows, aggregation=aggregation)


@torch.inference_mode()
def embed_long_texts(
    model: BertModel,
    tokenizer: object,
    texts: Sequence[str],
    *,
    stride: int,
    max_length: int | None = None,
    aggregation: str = "mean",
    normalize: bool = True,
    batch_size: int = 32,
    pattern: SparsePattern | None = None,
) -> torch.Tensor:
    """Strings -> (N, E) embeddings: `chunk_texts`, then `embed_long`. max_length defaults to
    the model's max_positions; e.g. for all-MiniLM-L6-v2 (trained on 256 tokens) pass 256."""
    if not isinstance(model, BertModel):
        raise TypeError(f"model: expected a qkv BertModel, got {type(model).__name__}")
    max_length = _max_length(max_length, model.config.max_positions)
    windows = chunk_texts(tokenizer, texts, max_length=max_length, stride=stride)
    return embed_long(
        model,
        windows,
        aggregation=aggregation,
        normalize=normalize,
        batch_size=batch_size,
        pattern=pattern,
    )


@torch.inference_mode()
def classify_long_texts(
    model: BertForSequenceClassification,
    tokenizer: object,
    texts: Sequence[str],
    *,
    stride: int,
    max_length: int | None = None,
    aggregation: str = "mean",
    batch_size: int = 32,
    pattern: SparsePattern | None = None,
) -> torch.Tensor:
    """Strings -> (N, num_labels) logits: `chunk_texts`, then `classify_long`."""
    if not isinstance(model, BertForSequenceClassification):
        raise TypeError(
            f"model: expected a qkv BertForSequenceClassification, got {type(model).__name__}"
        )
    max_length = _max_length(max_length, model.config.max_positions)
    windows = chunk_texts(tokenizer, texts, max_length=max_length, stride=stride)
    return classify_long(
        model, windows, aggregation=aggregation, batch_size=batch_size, pattern=pattern
    )


def _prepare(max_positions: int, windows: Windows, aggregation: str, batch_size: int) -> Windows:
    """Check a call; with "first", keep only each text's first window (the rest is not run)."""
    if not isinstance(windows, Windows):
        raise TypeError(f"windows: expected a Windows batch, got {type(windows).__name__}")
    _check_aggregation(aggregation)
    check_positive_int("batch_size", batch_size)
    length = windows.input_ids.shape[1]
    if length > max_positions:
        raise ValueError(
            f"windows: length {length} exceeds the model's max_positions={max_positions}; expected "
            f"windows cut with max_length <= {max_positions}"
        )
    if aggregation != "first":
        return windows
    first = _first_windows(windows)  # (N,)
    return Windows(
        windows.input_ids[first],
        windows.attention_mask[first],
        torch.arange(windows.num_texts),
        windows.num_texts,
    )


def _run_windows(step, model: torch.nn.Module, windows: Windows, batch_size: int) -> torch.Tensor:
    """step(ids (b, L), mask (b, L)) -> (b, K) over the windows in batches -> (W, K)."""
    device = next(model.parameters()).device
    outputs = []
    for start in range(0, windows.input_ids.shape[0], batch_size):
        mask = windows.attention_mask[start : start + batch_size]  # (b, L)
        length = int(mask.sum(dim=1).max())  # trim padding that no window of this batch needs
        ids = windows.input_ids[start : start + batch_size, :length].to(device)  # (b, l)
        outputs.append(step(ids, mask[:, :length].to(device)))
    return torch.cat(outputs)  # (W, K)


def _first_windows(windows: Windows) -> torch.Tensor:
    """The index of each text's first window: (N,)."""
    W = windows.input_ids.shape[0]
    first = torch.full((windows.num_texts,), W, dtype=torch.long)
    positions = torch.arange(W)
    return first.scatter_reduce(0, windows.text_index.cpu(), positions, "amin")  # (N,)


def _max_length(max_length: int | None, max_positions: int) -> int:
    if max_length is None:
        return max_positions
    if isinstance(max_length, bool) or not isinstance(max_length, int):
        raise TypeError(f"max_length: expected an int or None, got {type(max_length).__name__}")
    if not 3 <= max_length <= max_positions:
        raise ValueError(
            f"max_length: expected 3..{max_positions} (the model's max_positions), got {max_length}"
        )
    return max_length


def _check_aggregation(aggregation: object) -> None:
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"aggregation: expected one of {AGGREGATIONS}, got {aggregation!r}")
