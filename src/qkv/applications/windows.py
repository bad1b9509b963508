"""Texts longer than BERT's window, cut into windows: sliding-window chunks with a stride.

A window is [CLS] + at most max_length - 2 content tokens + [SEP]. `stride` is what Hugging
Face tokenizers call it (`return_overflowing_tokens=True`): the number of tokens shared by two
consecutive windows, so window k starts at content token k * (max_length - 2 - stride). The
windows are exactly those of `BertTokenizerFast(text, truncation=True, max_length=...,
stride=..., return_overflowing_tokens=True)`. `qkv.applications.long_text` runs a model over
them and aggregates per text.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from qkv.validation import check_int, describe

__all__ = ["Windows", "chunk_batch", "chunk_ids", "chunk_texts", "truncate_ids"]


@dataclass(frozen=True)
class Windows:
    """Several texts cut into windows, padded into one batch.

    input_ids (W, L) window ids, right-padded; attention_mask (W, L) 1 on real tokens;
    text_index (W,) the text each window comes from (a text's windows are consecutive and in
    order); num_texts N. Every text has at least one window.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    text_index: torch.Tensor
    num_texts: int

    def __post_init__(self) -> None:
        ids, mask, index = self.input_ids, self.attention_mask, self.text_index
        for name, value in (("input_ids", ids), ("attention_mask", mask)):
            if not isinstance(value, torch.Tensor) or value.dim() != 2:
                raise ValueError(f"{name}: expected a (W, L) tensor, got {describe(value)}")
        if mask.shape != ids.shape:
            raise ValueError(
                f"attention_mask: expected shape {tuple(ids.shape)} (that of input_ids), got "
                f"{tuple(mask.shape)}"
            )
        if not isinstance(index, torch.Tensor) or index.shape != (ids.shape[0],):
            raise ValueError(f"text_index: expected shape ({ids.shape[0]},), got {describe(index)}")
        if isinstance(self.num_texts, bool) or not isinstance(self.num_texts, int):
            raise TypeError(f"num_texts: expected an int, got {type(self.num_texts).__name__}")
        if index.is_floating_point() or index.dtype == torch.bool:
            raise TypeError(f"text_index: expected an integer tensor, got dtype {index.dtype}")
        seen = index.cpu().tolist()
        if sorted(set(seen)) != list(range(self.num_texts)) or seen != sorted(seen):
            raise ValueError(
                f"text_index: expected every text 0..{self.num_texts - 1} to own at least one "
                f"window, a text's windows consecutive and in order, got {seen}"
            )


def truncate_ids(
    token_ids: Sequence[int], *, max_length: int, cls_id: int, sep_id: int
) -> list[int]:
    """Plain truncation, the baseline: [CLS] + the first max_length - 2 tokens + [SEP].

    token_ids: one text's ids without special tokens. Equals a tokenizer's
    `truncation=True, max_length=max_length`; whatever follows the window is lost.
    """
    _check_lengths(max_length, 0)
    return [cls_id, *list(token_ids)[: max_length - 2], sep_id]


def chunk_ids(
    token_ids: Sequence[int], *, max_length: int, stride: int, cls_id: int, sep_id: int
) -> list[list[int]]:
    """Overlapping windows of one text: each [CLS] + at most max_length - 2 tokens + [SEP].

    Consecutive windows share `stride` content tokens (Hugging Face's `stride`), so window k
    starts at k * (max_length - 2 - stride); the last window ends at the text's last token and
    may be shorter. A text that fits (or an empty one) gives one window, the truncated text.
    """
    _check_lengths(max_length, stride)
    token_ids = list(token_ids)
    content = max_length - 2
    step = content - stride
    windows = []
    for start in range(0, max(len(token_ids), 1), step):
        stop = min(start + content, len(token_ids))
        windows.append([cls_id, *token_ids[start:stop], sep_id])
        if stop == len(token_ids):
            break
    return windows


def chunk_batch(
    texts_token_ids: Sequence[Sequence[int]],
    *,
    max_length: int,
    stride: int,
    cls_id: int,
    sep_id: int,
    pad_id: int,
) -> Windows:
    """`chunk_ids` for several texts, padded into one batch of W windows (see `Windows`).

    The result equals a fast tokenizer's `padding=True, return_overflowing_tokens=True`
    output: input_ids, attention_mask and `overflow_to_sample_mapping` (our text_index).
    """
    if isinstance(texts_token_ids, (str, torch.Tensor)) or not isinstance(
        texts_token_ids, Sequence
    ):
        raise TypeError(
            f"texts_token_ids: expected a sequence of id lists (one per text), got "
            f"{type(texts_token_ids).__name__}"
        )
    if len(texts_token_ids) == 0:
        raise ValueError("texts_token_ids: expected at least one text, got an empty sequence")
    rows, owners = [], []
    for text, token_ids in enumerate(texts_token_ids):
        windows = chunk_ids(
            token_ids, max_length=max_length, stride=stride, cls_id=cls_id, sep_id=sep_id
        )
        rows.extend(windows)
        owners.extend([text] * len(windows))
    L = max(len(row) for row in rows)
    input_ids = torch.full((len(rows), L), pad_id, dtype=torch.long)  # (W, L)
    attention_mask = torch.zeros((len(rows), L), dtype=torch.long)  # (W, L)
    for row, window in enumerate(rows):
        input_ids[row, : len(window)] = torch.tensor(window, dtype=torch.long)
        attention_mask[row, : len(window)] = 1
    text_index = torch.tensor(owners, dtype=torch.long)  # (W,)
    return Windows(input_ids, attention_mask, text_index, len(texts_token_ids))


def chunk_texts(
    tokenizer: object, texts: Sequence[str], *, max_length: int, stride: int
) -> Windows:
    """Tokenise strings with a `tokenizers.Tokenizer` (a BERT WordPiece one, e.g. MiniLM's
    tokenizer.json) and cut them into windows. The tokenizer's own truncation and padding are
    ignored (a copy is used; the caller's tokenizer is left as it was)."""
    from tokenizers import Tokenizer

    if not isinstance(tokenizer, Tokenizer):
        raise TypeError(
            f"tokenizer: expected a tokenizers.Tokenizer, got {type(tokenizer).__name__}"
        )
    if isinstance(texts, str) or not isinstance(texts, Sequence):
        raise TypeError(f"texts: expected a sequence of strings, got {type(texts).__name__}")
    bad = next((i for i, text in enumerate(texts) if not isinstance(text, str)), None)
    if bad is not None:
        raise TypeError(f"texts: expected strings, got {type(texts[bad]).__name__} at index {bad}")
    plain = Tokenizer.from_str(tokenizer.to_str())
    plain.no_truncation()  # the whole text, however long: windows replace truncation
    plain.no_padding()
    special = {}
    for token in ("[CLS]", "[SEP]", "[PAD]"):
        special[token] = plain.token_to_id(token)
        if special[token] is None:
            raise ValueError(f"tokenizer: expected a BERT vocabulary with {token}, found none")
    encodings = plain.encode_batch(list(texts), add_special_tokens=False)
    return chunk_batch(
        [encoding.ids for encoding in encodings],
        max_length=max_length,
        stride=stride,
        cls_id=special["[CLS]"],
        sep_id=special["[SEP]"],
        pad_id=special["[PAD]"],
    )


def _check_lengths(max_length: object, stride: object) -> None:
    check_int("max_length", max_length)
    check_int("stride", stride)
    if max_length < 3:
        raise ValueError(
            f"max_length: expected at least 3 ([CLS], one token, [SEP]), got {max_length}"
        )
    if not 0 <= stride < max_length - 2:
        raise ValueError(
            f"stride: expected 0 <= stride < max_length - 2 = {max_length - 2} (the tokens "
            f"two windows share must leave each window at least one new token), got {stride}"
        )
