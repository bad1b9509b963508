"""Causal language modelling data: the corpus as one token stream, cut into equal blocks.

GPT learns to predict every next token from the ones before it (causal attention: position
i sees only positions j <= i). The documents are tokenised, each followed by the end-of-text
token (GPT-2's <|endoftext|>, so the model learns where a text stops and does not read one
document as the continuation of another), concatenated, and cut into blocks of block_size
tokens; the last partial block is dropped. This is the `group_texts` of transformers'
run_clm.py example.

`qkv.models.GPT.forward(input_ids, labels=...)` shifts the labels itself (logits[:, i] against
labels[:, i + 1], `next_token_loss`), so a block is both the input and the labels, as in
transformers; a block of block_size tokens gives block_size - 1 predictions.

    blocks = causal_lm_blocks(pydoc_texts(), tokenizer, block_size=128)
    batch = torch.utils.data.default_collate([blocks[0], blocks[1]])   # input_ids, labels (2, 128)
    loss = gpt(**batch).loss
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from tokenizers import Tokenizer

from qkv.data.tokenizers import END_OF_TEXT
from qkv.validation import check_positive_int

__all__ = ["TokenBlocks", "causal_lm_blocks", "token_stream"]


class TokenBlocks:
    """A dataset of equal blocks of tokens: blocks[i] -> {"input_ids": (block_size,) long,
    "labels": the same tensor}. Indexable, so any sampler (shuffled, distributed) can draw from
    it and a training loop can record its position; `blocks.blocks` is the (N, block_size)
    tensor itself."""

    def __init__(self, blocks: torch.Tensor) -> None:
        if not isinstance(blocks, torch.Tensor) or blocks.ndim != 2 or blocks.is_floating_point():
            raise TypeError(
                f"blocks: expected an (N, block_size) integer tensor, got {blocks!r:.80}"
            )
        self.blocks = blocks  # (N, block_size)

    @property
    def block_size(self) -> int:
        return self.blocks.shape[1]

    def __len__(self) -> int:
        return self.blocks.shape[0]

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        block = self.blocks[index]  # (block_size,)
        return {"input_ids": block, "labels": block}


def token_stream(
    texts: Sequence[str], tokenizer: Tokenizer, *, end_of_text: str = END_OF_TEXT
) -> torch.Tensor:
    """All texts tokenised (no special tokens added by the tokenizer), each followed by the
    end_of_text id: a (T,) long tensor, in the order of `texts`."""
    if isinstance(texts, str) or not isinstance(texts, Sequence):
        raise TypeError(f"texts: expected a sequence of strings, got {type(texts).__name__}")
    end_id = tokenizer.token_to_id(end_of_text)
    if end_id is None:
        raise ValueError(
            f"end_of_text: {end_of_text!r} is not in the tokenizer's vocabulary; expected the "
            f"special that separates documents (train_bpe adds {END_OF_TEXT!r})"
        )
    ids: list[int] = []
    for encoding in tokenizer.encode_batch(list(texts), add_special_tokens=False):
        ids.extend(encoding.ids)
        ids.append(end_id)
    return torch.tensor(ids, dtype=torch.long)  # (T,)


def causal_lm_blocks(
    texts: Sequence[str],
    tokenizer: Tokenizer,
    *,
    block_size: int,
    end_of_text: str = END_OF_TEXT,
) -> TokenBlocks:
    """Tokenise `texts` into one stream (`token_stream`) and cut it into blocks of block_size
    tokens: block i is stream[i * block_size : (i + 1) * block_size]. Deterministic; the tail
    shorter than a block is dropped."""
    check_positive_int("block_size", block_size)
    stream = token_stream(texts, tokenizer, end_of_text=end_of_text)  # (T,)
    count = len(stream) // block_size
    if count == 0:
        raise ValueError(
            f"block_size: the texts make {len(stream)} tokens, fewer than one block of "
            f"{block_size}; expected more text or a smaller block_size"
        )
    return TokenBlocks(stream[: count * block_size].view(count, block_size))  # (N, block_size)
