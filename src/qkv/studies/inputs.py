"""What several studies train on: the CPython documentation as language-model blocks, and the
seeded draw of examples each training step reads."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qkv.data import causal_lm_blocks, pydoc_texts, token_stream, train_bpe, train_validation_split

__all__ = ["DocumentationLM", "data_order", "documentation_lm"]


@dataclass(frozen=True)
class DocumentationLM:
    """blocks (N, block_size) of the training documents, valid_stream (T,) the validation
    documents' tokens, and the size of the byte-level BPE trained on the training documents."""

    blocks: torch.Tensor
    valid_stream: torch.Tensor
    vocab_size: int


def documentation_lm(
    *, vocab_size: int, block_size: int, validation_fraction: float
) -> DocumentationLM:
    """`pydoc_data.topics` split by document (seed 0), a byte-level BPE (Radford et al. 2019,
    s2.2) trained on the training part, and its tokens cut into blocks."""
    train, valid = train_validation_split(
        pydoc_texts(), validation_fraction=validation_fraction, seed=0
    )
    tokenizer = train_bpe(train, vocab_size=vocab_size)
    blocks = causal_lm_blocks(train, tokenizer, block_size=block_size).blocks  # (N, block_size)
    return DocumentationLM(blocks, token_stream(valid, tokenizer), tokenizer.get_vocab_size())


def data_order(count: int, *, steps: int, batch_size: int, seed: int) -> torch.Tensor:
    """The examples each step reads: (steps, batch_size) indices in [0, count), drawn once so
    that every model of a study sees the same data in the same order."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(count, (steps, batch_size), generator=generator)  # (steps, B)
