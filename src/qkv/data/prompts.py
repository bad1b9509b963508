"""Text prompts for the 8x8 digits: several phrasings of each digit, and their tokenizer.

A text-conditioned image model needs captions; the digits have only labels, so each label gets
English phrasings ("a handwritten seven", "the digit seven", "number 7", "a seven", ...), with
the word or the numeral, so that the prompts are real text and the model has to learn which of
their tokens matter. `prompt_corpus` lists every phrasing of every digit; `train_prompt_tokenizer`
trains qkv's WordPiece (`qkv.data.train_wordpiece`, Devlin et al. 2019's vocabulary scheme) on
it, so each digit word becomes one token; `encode_prompts` pads a batch of prompts for a
model's cross-attention. The empty prompt "" is the null condition of classifier-free guidance
(Ho & Salimans 2022): it encodes to [CLS] [SEP] alone.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from tokenizers import Tokenizer

from qkv.data.tokenizers import bert_special_ids, train_wordpiece
from qkv.validation import check_int

__all__ = [
    "DIGIT_WORDS",
    "NULL_PROMPT",
    "TEMPLATES",
    "digit_prompts",
    "encode_prompts",
    "evaluation_prompt",
    "prompt_corpus",
    "train_prompt_tokenizer",
]

DIGIT_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
# {word}: the digit's name; {numeral}: 0 .. 9; {article}: "a", or "an" before "eight"
TEMPLATES = (
    "a handwritten {word}",
    "the digit {word}",
    "number {numeral}",
    "{article} {word}",
    "the number {word}",
    "a drawing of the digit {numeral}",
    "{article} {word} written by hand",
    "digit {numeral}",
)
NULL_PROMPT = ""
_VOCAB_SIZE = 256  # more than the corpus needs: every word of it becomes a token


def digit_prompts(digit: int) -> tuple[str, ...]:
    """Every phrasing of `digit` (0 .. 9), one per template, in the order of TEMPLATES."""
    check_int("digit", digit, minimum=0)
    if digit >= len(DIGIT_WORDS):
        raise ValueError(f"digit: expected 0 .. 9, got {digit}")
    word = DIGIT_WORDS[digit]
    article = "an" if word == "eight" else "a"  # the only one with a vowel sound ("a one")
    return tuple(
        template.format(word=word, numeral=digit, article=article) for template in TEMPLATES
    )


def evaluation_prompt(digit: int) -> str:
    """The phrasing samples are asked for: "a handwritten seven"."""
    return digit_prompts(digit)[0]


def prompt_corpus() -> list[str]:
    """Every phrasing of every digit, digit by digit: the tokenizer's training text."""
    return [prompt for digit in range(len(DIGIT_WORDS)) for prompt in digit_prompts(digit)]


def train_prompt_tokenizer() -> Tokenizer:
    """An uncased WordPiece tokenizer trained on `prompt_corpus` (min_frequency 1, so every
    word of the corpus is a token of its own); [PAD] is id 0, prompts encode as
    [CLS] ... [SEP]. Deterministic: the same vocabulary every time."""
    return train_wordpiece(prompt_corpus(), vocab_size=_VOCAB_SIZE, min_frequency=1)


def encode_prompts(
    tokenizer: Tokenizer, texts: Sequence[str], *, max_length: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids (B, S) int64, mask (B, S) bool): each text as [CLS] tokens [SEP], padded with
    [PAD] to the longest, mask True on real tokens. max_length: the most tokens a prompt may
    have (ValueError naming the prompt otherwise)."""
    if isinstance(texts, str) or not isinstance(texts, Sequence) or not texts:
        raise TypeError(f"texts: expected a non-empty sequence of strings, got {texts!r}")
    if not all(isinstance(text, str) for text in texts):
        raise TypeError("texts: expected strings only")
    encodings = [encoding.ids for encoding in tokenizer.encode_batch(list(texts))]
    longest = max(len(ids) for ids in encodings)
    if max_length is not None:
        check_int("max_length", max_length, minimum=1)
        too_long = next((i for i, ids in enumerate(encodings) if len(ids) > max_length), None)
        if too_long is not None:
            raise ValueError(
                f"texts: {texts[too_long]!r} is {len(encodings[too_long])} tokens long; "
                f"expected at most {max_length} (the model's max_prompt_length)"
            )
    pad = bert_special_ids(tokenizer).pad
    ids = torch.full((len(encodings), longest), pad, dtype=torch.long)
    mask = torch.zeros((len(encodings), longest), dtype=torch.bool)
    for row, tokens in enumerate(encodings):
        ids[row, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        mask[row, : len(tokens)] = True
    return ids, mask
