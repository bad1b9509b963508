"""Text to pre-train on: the documentation CPython ships, or a user's file, as documents.

A document is a list of sentences: BERT's next-sentence prediction pairs a sentence with the one
that follows it in the same document, or with one from another document (Devlin et al. 2019,
section 3.1: is B the sentence that follows A in the original text, or a random one?). GPT
reads the same text as one stream of tokens, for which the raw texts (`pydoc_texts`,
`text_file_texts`) keep every character.

The built-in corpus is `pydoc_data.topics.topics`, about 465 KB of English in 79 topics (the text
`help("while")` shows); one topic is one document, in sorted topic order. Nothing is downloaded.

    documents = pydoc_documents()                    # 79 lists of sentences
    train, validation = train_validation_split(documents, validation_fraction=0.1, seed=0)
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from pathlib import Path
from typing import TypeVar

from qkv.validation import check_readable_file

__all__ = [
    "documentation_sentences",
    "pydoc_documents",
    "pydoc_texts",
    "split_sentences",
    "text_file_documents",
    "text_file_texts",
    "train_validation_split",
]

Item = TypeVar("Item")

# A sentence ends at . ! or ? (optionally followed by a closing quote or bracket), then white
# space, then what starts a sentence: a capital or a digit, perhaps after an opening quote or
# bracket. "e.g. the" and "3.14" do not split; "Mr. Smith" does (a simple splitter's price).
_SENTENCE_END = re.compile(r"(?:(?<=[.!?])|(?<=[.!?][\"')\]”’]))\s+(?=[\"'(\[“‘]?[A-Z0-9])")
# reStructuredText heading underlines, e.g. "*******" or "=======": layout, not text.
_UNDERLINE = re.compile(r"^\s*([*=\-~^\"'#+])\1{2,}\s*$")
_BLANK_LINE = re.compile(r"\n[ \t\r\f\v]*\n")


def split_sentences(text: str) -> list[str]:
    """Split one line or paragraph of prose into sentences; white space is collapsed to one space.

    The rule (`_SENTENCE_END`): a sentence ends at ".", "!" or "?", optionally followed by a
    closing quote or bracket, when white space and then a capital letter or digit (perhaps after
    an opening quote or bracket) come next. Text with no such boundary is one sentence.
    """
    if not isinstance(text, str):
        raise TypeError(f"text: expected a str, got {type(text).__name__}")
    flat = " ".join(text.split())
    return [sentence for sentence in _SENTENCE_END.split(flat) if sentence]


def documentation_sentences(text: str) -> list[str]:
    """The sentences of plain-text documentation such as pydoc's topics, in order.

    Paragraphs are separated by blank lines, and a paragraph boundary always ends a sentence
    (so a heading or a code example is a sentence of its own). Heading underlines ("*****") are
    dropped. Each paragraph's lines are joined and split by `split_sentences`.
    """
    sentences: list[str] = []
    for paragraph in _BLANK_LINE.split(text):
        lines = [line for line in paragraph.splitlines() if not _UNDERLINE.match(line)]
        sentences.extend(split_sentences(" ".join(lines)))
    return sentences


def pydoc_texts() -> list[str]:
    """The raw text of every `pydoc_data.topics` topic, in sorted topic-name order."""
    from pydoc_data.topics import topics

    return [topics[name] for name in sorted(topics)]


def pydoc_documents() -> list[list[str]]:
    """One document (a list of sentences) per pydoc topic, in sorted topic-name order."""
    documents = [documentation_sentences(text) for text in pydoc_texts()]
    return [document for document in documents if document]


def text_file_texts(path: str | Path) -> list[str]:
    """The documents of a UTF-8 text file: blank lines separate documents; each is returned as
    written (its own line breaks kept), without the blank lines around it."""
    file = check_readable_file("path", path)
    try:
        text = file.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(f"path: {str(path)!r} is not UTF-8 text ({error.reason})") from error
    texts = [chunk.strip("\n") for chunk in _BLANK_LINE.split(text) if chunk.strip()]
    if not texts:
        raise ValueError(f"path: {str(path)!r} has no text; expected documents of sentences")
    return texts


def text_file_documents(path: str | Path) -> list[list[str]]:
    """The documents of a UTF-8 text file as lists of sentences.

    Format: blank lines separate documents; every line holds one or more whole sentences (a
    line break always ends a sentence, and `split_sentences` splits the line further).
    """
    return [
        [sentence for line in text.splitlines() for sentence in split_sentences(line)]
        for text in text_file_texts(path)
    ]


def train_validation_split(
    items: Sequence[Item], *, validation_fraction: float = 0.1, seed: int = 0
) -> tuple[list[Item], list[Item]]:
    """Split documents into (train, validation), deterministically, by a seeded hash of each
    document's text: the round(fraction * N) documents with the smallest hash are held out (at
    least one, and never all, when N >= 2 and fraction > 0). Both keep the input order.

    A document's side depends only on its text, the seed and the number of documents, not on
    where it sits in the list or on the Python process (no `hash()` randomisation).
    items: strings or lists of sentences.
    """
    if isinstance(validation_fraction, bool) or not isinstance(validation_fraction, (int, float)):
        raise TypeError(
            f"validation_fraction: expected a float in [0, 1), got {validation_fraction!r}"
        )
    if not 0.0 <= validation_fraction < 1.0:
        raise ValueError(f"validation_fraction: expected [0, 1), got {validation_fraction}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed: expected an int, got {type(seed).__name__}")
    count = len(items)
    held_out = round(validation_fraction * count)
    if validation_fraction > 0 and count >= 2:
        held_out = min(max(held_out, 1), count - 1)
    order = sorted(range(count), key=lambda index: (_seeded_hash(items[index], seed), index))
    validation_indices = set(order[:held_out])
    train = [item for index, item in enumerate(items) if index not in validation_indices]
    validation = [item for index, item in enumerate(items) if index in validation_indices]
    return train, validation


def _seeded_hash(item: object, seed: int) -> bytes:
    text = item if isinstance(item, str) else "\n".join(item)  # a list of sentences
    return hashlib.blake2b(text.encode("utf-8"), digest_size=8, key=str(seed).encode()).digest()
