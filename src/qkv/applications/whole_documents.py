"""One BERT pass over a whole document with sparse attention, instead of windows.

Longformer (Beltagy et al. 2020, s3.1 and s4) reads a long document in one pass: every token
attends to a window of w tokens on each side, and [CLS] is global (it attends to every token
and every token attends to it), so the classification vector sees the whole document while
attention costs O(L w) instead of O(L^2). BigBird (Zaheer et al. 2020) adds random blocks
(`qkv.sparse.bigbird`). `longformer_pattern` builds the pattern, `whole_documents` one window
per text, and `embed_long` / `classify_long` (`qkv.applications.long_text`) run it with
`pattern=`:

    pattern = longformer_pattern(64)                                  # Window(64, 64) | [CLS]
    docs = whole_documents(tokenizer, texts, max_length=512)          # Windows, one per text
    vectors = embed_long(model, docs, aggregation="first", pattern=pattern)         # (N, E)

The limit is the position table, not attention: BERT's positions are learned and absolute, and
all-MiniLM-L6-v2 has 512 of them (its training used 256), so one pass reads at most 512 tokens
([CLS] + 510 + [SEP]). Longformer copies the table to reach 4096 and then trains further; qkv
does not extend it. A longer text is therefore an error here, unless overflow="truncate" asks
for its first max_length - 2 tokens (then this is the 512-token truncation baseline with
sparse attention, and the rest of the text is not read); windows (`chunk_texts`) read it all.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from qkv.applications.windows import Windows, chunk_texts
from qkv.attention.sparse import GlobalTokens, SparsePattern, Window
from qkv.validation import check_choice, check_int

__all__ = ["OVERFLOWS", "longformer_pattern", "whole_documents"]

# error: refuse a text longer than the pass; truncate: keep its first max_length - 2 tokens
OVERFLOWS = ("error", "truncate")


def longformer_pattern(window: int, *, global_tokens: int = 1) -> SparsePattern:
    """Longformer's pattern for classification: `window` keys on each side of every query
    and the first `global_tokens` positions ([CLS]) global (Beltagy et al. 2020, s3.1)."""
    check_int("window", window, minimum=0)
    return Window(window, window) | GlobalTokens.first(global_tokens)


def whole_documents(
    tokenizer: object, texts: Sequence[str], *, max_length: int, overflow: str = "error"
) -> Windows:
    """One window per text, [CLS] + the whole text + [SEP], right-padded (see `Windows`).

    max_length: the longest pass, at most the model's max_positions (512 for MiniLM). A text
    of more than max_length - 2 tokens raises ValueError with overflow="error" (naming how
    many texts and the longest); overflow="truncate" keeps its first max_length - 2 tokens.
    """
    check_choice("overflow", overflow, OVERFLOWS)
    windows = chunk_texts(tokenizer, texts, max_length=max_length, stride=0)
    counts = torch.bincount(windows.text_index, minlength=windows.num_texts)  # (N,) windows
    longer = torch.nonzero(counts > 1).flatten().tolist()
    if longer and overflow == "error":
        raise ValueError(
            f"texts: {len(longer)} of {len(texts)} texts (the first at index {longer[0]}) are "
            f"longer than max_length={max_length} tokens ([CLS] + {max_length - 2} + [SEP]); "
            f"BERT's learned positions stop at max_positions, so one pass cannot read them. "
            f"Pass overflow='truncate' to read their first {max_length - 2} tokens only, or cut "
            f"them into windows (chunk_texts) and aggregate (embed_long)"
        )
    first = torch.cumsum(counts, dim=0) - counts  # (N,) each text's first window
    mask = windows.attention_mask[first]
    length = int(mask.sum(dim=1).max())  # drop the padding that only later windows needed
    return Windows(
        windows.input_ids[first, :length],
        mask[:, :length],
        torch.arange(windows.num_texts),
        windows.num_texts,
    )
