"""The `translate` task: German number words -> English number words, generated, no download.

`num2words` writes any integer in many languages. German builds numbers as one word with the
units before the tens ("einundzwanzig" = one-and-twenty), English puts the tens first and
separates the thousands ("twenty-one", "twelve thousand, three hundred and forty-five"). So a
model cannot copy word by word: cross-attention must learn a real alignment with reordering
(Vaswani et al. 2017, s3.2.3: encoder-decoder attention).

Numbers are drawn without replacement from 0 .. max_number with equal weight for each
magnitude (1 digit, 2 digits, ...), not uniformly: a uniform draw from 0 .. 999999 is 99.9% six-
and five-digit numbers, and a model trained on it translates "dreihundertzwölf" (312) as "three
hundred and twelve thousand and twelve". Small magnitudes run out (there are only 900
three-digit numbers), so every one of them is drawn. The drawn set is then shuffled and cut into
test, validation and training numbers: disjoint by construction.

One byte-pair vocabulary (Sennrich et al. 2016), trained with the `tokenizers` library on the
training pairs of both languages, serves source and target, as the shared source-target BPE of
Vaswani et al. 2017 (section 5.1) does. Its pre-tokeniser is Metaspace (spaces become a
visible "▁"), so decoding gives back the exact text.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from qkv.data.tokenizers import check_vocab_size

__all__ = [
    "SPECIAL_TOKENS",
    "TranslationDataset",
    "TranslationPairs",
    "number_pairs",
    "read_pairs",
    "train_translation_tokenizer",
]

logger = logging.getLogger(__name__)

# The ids the encoder-decoder's config expects: pad 0, bos 1, eos 2 (`TransformerConfig`).
SPECIAL_TOKENS = ("[PAD]", "[BOS]", "[EOS]", "[UNK]")
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2

Pair = tuple[str, str]  # (source text, target text)


@dataclass(frozen=True)
class TranslationPairs:
    """Three disjoint lists of (source, target) sentence pairs."""

    train: list[Pair]
    valid: list[Pair]
    test: list[Pair]


def number_pairs(
    *,
    max_number: int = 999_999,
    num_train: int = 40_000,
    num_valid: int = 500,
    num_test: int = 1_000,
    seed: int = 0,
) -> TranslationPairs:
    """German -> English number words for disjoint random numbers in [0, max_number].

    E.g. (312) -> ("dreihundertzwölf", "three hundred and twelve").
    """
    from num2words import num2words

    _check_split_sizes(max_number + 1, num_train=num_train, num_valid=num_valid, num_test=num_test)
    generator = torch.Generator().manual_seed(seed)
    numbers = torch.arange(max_number + 1)
    powers_of_ten = torch.tensor([10**p for p in range(1, len(str(max_number)))])
    magnitude = torch.bucketize(numbers, powers_of_ten, right=True)  # digits - 1
    weights = 1.0 / torch.bincount(magnitude).double()[magnitude]  # each magnitude weighs 1
    total = num_test + num_valid + num_train
    drawn = torch.multinomial(weights, total, replacement=False, generator=generator)
    order = drawn[torch.randperm(total, generator=generator)].tolist()

    def pairs(numbers: list[int]) -> list[Pair]:
        return [(num2words(n, lang="de"), num2words(n, lang="en")) for n in numbers]

    test = order[:num_test]
    valid = order[num_test : num_test + num_valid]
    train = order[num_test + num_valid : num_test + num_valid + num_train]
    return TranslationPairs(train=pairs(train), valid=pairs(valid), test=pairs(test))


def read_pairs(
    path: str | os.PathLike,
    *,
    valid_fraction: float = 0.05,
    test_fraction: float = 0.05,
    seed: int = 0,
) -> TranslationPairs:
    """User data: one "source<TAB>target" pair a line, split at random into train/valid/test."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"data: {path} is not a file; expected tab-separated source/target pairs")
    pairs: list[Pair] = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        fields = line.split("\t")
        if len(fields) != 2 or not fields[0].strip() or not fields[1].strip():
            raise ValueError(
                f"data: {path} line {number}: expected 'source<TAB>target', got {line[:80]!r}"
            )
        pairs.append((fields[0].strip(), fields[1].strip()))
    num_valid = max(1, round(valid_fraction * len(pairs)))
    num_test = max(1, round(test_fraction * len(pairs)))
    num_train = len(pairs) - num_valid - num_test
    _check_split_sizes(len(pairs), num_train=num_train, num_valid=num_valid, num_test=num_test)
    order = torch.randperm(len(pairs), generator=torch.Generator().manual_seed(seed)).tolist()
    chosen = [pairs[i] for i in order]
    return TranslationPairs(
        test=chosen[:num_test],
        valid=chosen[num_test : num_test + num_valid],
        train=chosen[num_test + num_valid :],
    )


def train_translation_tokenizer(pairs: list[Pair], *, vocab_size: int = 200):
    """A shared source-target BPE `tokenizers.Tokenizer` trained on `pairs`, specials first:
    [PAD] = 0, [BOS] = 1, [EOS] = 2, [UNK] = 3. Deterministic for the same pairs."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    check_vocab_size(vocab_size, minimum=9)
    tokenizer = Tokenizer(models.BPE(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), show_progress=False
    )
    tokenizer.train_from_iterator((text for pair in pairs for text in pair), trainer)
    return tokenizer


class TranslationDataset:
    """Pairs encoded once; `collate(indices)` pads a batch for `qkv.models.Transformer`.

    Each target ends in [EOS]; the decoder's input is the labels shifted right behind [BOS],
    which the model builds itself from `labels` (teacher forcing).
    """

    def __init__(self, pairs: list[Pair], tokenizer, *, max_length: int = 64) -> None:
        if not pairs:
            raise ValueError("pairs: expected at least one (source, target) pair, got none")
        self.pairs = pairs
        self.sources = [_encode(tokenizer, s, max_length) for s, _ in pairs]
        self.targets = [_encode(tokenizer, t, max_length - 1) + [EOS_ID] for _, t in pairs]

    def __len__(self) -> int:
        return len(self.pairs)

    def collate(self, indices: list[int]) -> dict[str, torch.Tensor]:
        """input_ids (B, L_src), attention_mask (B, L_src) True on real tokens, labels
        (B, L_tgt) with -100 after each target's [EOS]."""
        input_ids = pad_sequences([self.sources[i] for i in indices], PAD_ID)
        labels = pad_sequences([self.targets[i] for i in indices], -100)
        return {"input_ids": input_ids, "attention_mask": input_ids != PAD_ID, "labels": labels}


def check_texts(texts: object) -> list[str]:
    """The `texts` of `qkv.training.tasks.translate.translate`: a list of str, none of them
    blank (an empty source would be encoded as padding alone and still get a translation)."""
    if isinstance(texts, (str, bytes)) or not isinstance(texts, Sequence):
        raise TypeError(f"texts: expected a list of str, got {type(texts).__name__} {texts!r:.60}")
    for index, text in enumerate(texts):
        if not isinstance(text, str):
            raise TypeError(
                f"texts: item {index} is {type(text).__name__} {text!r:.60}; expected a str"
            )
        if not text.strip():
            raise ValueError(
                f"texts: item {index} is {text!r}, empty or only whitespace; expected text to "
                f"translate"
            )
    return list(texts)


def pad_sequences(sequences: list[list[int]], value: int) -> torch.Tensor:
    """Right-pad lists of ids to one (B, L_max) long tensor."""
    width = max(len(sequence) for sequence in sequences)
    out = torch.full((len(sequences), width), value, dtype=torch.long)
    for row, sequence in enumerate(sequences):
        out[row, : len(sequence)] = torch.tensor(sequence, dtype=torch.long)
    return out


def _encode(tokenizer, text: str, max_length: int) -> list[int]:
    ids = tokenizer.encode(text).ids
    if len(ids) > max_length:
        logger.warning("a %d-token text was truncated to max_length=%d", len(ids), max_length)
    return ids[:max_length]


def _check_split_sizes(available: int, *, num_train: int, num_valid: int, num_test: int) -> None:
    for name, value in (("num_train", num_train), ("num_valid", num_valid), ("num_test", num_test)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}: expected a positive int, got {value!r}")
    if num_train + num_valid + num_test > available:
        raise ValueError(
            f"num_train + num_valid + num_test: {num_train + num_valid + num_test} examples asked "
            f"for, but only {available} are available; expected at most {available}"
        )
