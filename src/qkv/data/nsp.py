"""Sentence pairs for BERT's next-sentence prediction: [CLS] A [SEP] B [SEP].

Given two sentences A and B, written as one input [CLS] A [SEP] B [SEP], the model predicts
whether B follows A in the original text or is a random sentence. Devlin et al. 2019, section
3.1 "Task #2" and appendix A.2: 50% of the time B follows A (IsNext), 50% it is taken from
elsewhere in the corpus (NotNext); A and B are "sentences" in the sense of spans of text, packed
up to the sequence length. Token type (segment) ids are 0 on [CLS] A [SEP] and 1 on
B [SEP]. The label follows `BertForPreTraining`: 0 = B follows A, 1 = B is random.

The spans are built as in BERT's create_pretraining_data.py (`create_instances_from_document`):
consecutive sentences of a document are gathered until they reach a target length (the maximum,
or with probability short_seq_prob a random shorter one, chosen per document), the chunk is cut
at a random sentence boundary into A and B, and for a random next B is replaced by sentences
from another document, starting at a random sentence, while the rest of the chunk is put back
for the next example. The longer of A and B is then cut by one token from a random end until
the pair fits. One change, so that NotNext is exactly 50%: the reference pairs a chunk of a
single sentence always with a random B (which makes NotNext more frequent than IsNext); here a
lone sentence takes the next sentence into its chunk, and a lone last sentence is dropped.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from tokenizers import Tokenizer

from qkv.data.tokenizers import BertSpecialIds, bert_special_ids

__all__ = ["IS_NEXT", "NOT_NEXT", "NspExample", "make_nsp_examples"]

IS_NEXT, NOT_NEXT = 0, 1  # next_sentence_label, as in BertForPreTraining (and transformers')


@dataclass(frozen=True)
class NspExample:
    """One pair: the ids [CLS] A [SEP] B [SEP], their segment ids and the NSP label; where A and
    B came from: sentences [start, stop) of a document, by index into the input documents."""

    input_ids: tuple[int, ...]
    token_type_ids: tuple[int, ...]
    next_sentence_label: int  # IS_NEXT (0) or NOT_NEXT (1)
    document_index: int
    a_sentences: tuple[int, int]
    b_document_index: int
    b_sentences: tuple[int, int]


@dataclass(frozen=True)
class _Options:
    special: BertSpecialIds
    max_tokens: int  # max_length - 3: room for [CLS] and two [SEP]
    short_seq_prob: float
    random_next_prob: float


@dataclass
class _Corpus:
    """Tokenised documents without their empty sentences; `positions` maps back to the input."""

    ids: list[list[list[int]]]  # document -> sentence -> token ids
    positions: list[list[int]]  # document -> sentence -> index in the input document
    nonempty: list[int]  # documents with at least one sentence


def make_nsp_examples(
    documents: Sequence[Sequence[str]],
    tokenizer: Tokenizer,
    *,
    max_length: int = 128,
    seed: int = 0,
    short_seq_prob: float = 0.1,
    random_next_prob: float = 0.5,
) -> list[NspExample]:
    """NSP pairs from `documents` (lists of sentences), in document order, each at most
    max_length tokens with [CLS] and the two [SEP]. Deterministic given the seed; a new seed
    per epoch gives new pairs, as the reference's dupe_factor did. Needs two documents with
    text (a NotNext B comes from ANOTHER document). Shuffling is left to the sampler.
    """
    if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 5:
        raise ValueError(
            f"max_length: expected an int >= 5 ([CLS] A [SEP] B [SEP]), got {max_length!r}"
        )
    for name, value in (("short_seq_prob", short_seq_prob), ("random_next_prob", random_next_prob)):
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"{name}: expected a probability in [0, 1], got {value}")
    special = bert_special_ids(tokenizer)
    corpus = _tokenize(documents, tokenizer)
    if len(corpus.nonempty) < 2:
        raise ValueError(
            f"documents: expected at least 2 documents with text (a random next sentence comes "
            f"from another document), got {len(corpus.nonempty)}"
        )
    rng = random.Random(seed)
    options = _Options(special, max_length - 3, short_seq_prob, random_next_prob)
    examples: list[NspExample] = []
    for document_index in corpus.nonempty:
        examples.extend(_document_examples(corpus, document_index, rng, options))
    return examples


def _tokenize(documents: Sequence[Sequence[str]], tokenizer: Tokenizer) -> _Corpus:
    if isinstance(documents, str) or not isinstance(documents, Sequence):
        raise TypeError(f"documents: expected a list of lists of sentences, got {documents!r:.60}")
    if any(isinstance(document, str) for document in documents):
        raise TypeError("documents: expected lists of sentences, got a str as a document")
    tokenizer = Tokenizer.from_str(tokenizer.to_str())  # a copy: padding and truncation off
    tokenizer.no_padding()
    tokenizer.no_truncation()
    flat = [sentence for document in documents for sentence in document]
    encoded = iter(tokenizer.encode_batch(flat, add_special_tokens=False))
    corpus = _Corpus([], [], [])
    for document_index, document in enumerate(documents):
        pairs = [(i, next(encoded).ids) for i in range(len(document))]
        pairs = [(i, ids) for i, ids in pairs if ids]
        corpus.ids.append([ids for _, ids in pairs])
        corpus.positions.append([i for i, _ in pairs])
        if pairs:
            corpus.nonempty.append(document_index)
    return corpus


def _document_examples(
    corpus: _Corpus,
    document_index: int,
    rng: random.Random,
    options: _Options,
) -> list[NspExample]:
    """create_instances_from_document: chunks of sentences up to a target length, cut into A
    and B (or A and a random B, the rest of the chunk put back)."""
    document = corpus.ids[document_index]
    target = options.max_tokens
    if rng.random() < options.short_seq_prob:
        target = rng.randint(2, options.max_tokens)
    examples: list[NspExample] = []
    start, length, i = 0, 0, 0
    while i < len(document):
        length += len(document[i])
        if i == len(document) - 1 or length >= target:
            stop = i + 1
            if stop - start == 1:
                if stop == len(document):
                    break  # a lone last sentence: nothing follows it in its document
                stop += 1  # a lone sentence takes the next one, so that IsNext is possible
            a_end = rng.randint(start + 1, stop - 1)
            a_span = (start, a_end)
            a_length = sum(len(ids) for ids in document[start:a_end])
            if rng.random() < options.random_next_prob:
                b_document, b_span = _random_span(corpus, document_index, target - a_length, rng)
                i = a_end - 1  # the sentences from a_end on are put back
            else:
                b_document, b_span = document_index, (a_end, stop)
                i = stop - 1
            packed = _pack(corpus, (document_index, a_span), (b_document, b_span))
            examples.append(_truncated(packed, corpus, rng, options))
            start, length = i + 1, 0
        i += 1
    return examples


def _random_span(
    corpus: _Corpus, document_index: int, target_length: int, rng: random.Random
) -> tuple[int, tuple[int, int]]:
    """A document other than document_index, and sentences of it from a random start until
    target_length tokens are reached (at least one sentence)."""
    others = [index for index in corpus.nonempty if index != document_index]
    other = others[rng.randrange(len(others))]
    sentences = corpus.ids[other]
    begin = rng.randrange(len(sentences))
    end, length = begin, 0
    while end < len(sentences) and (end == begin or length < target_length):
        length += len(sentences[end])
        end += 1
    return other, (begin, end)


def _pack(
    corpus: _Corpus,
    a: tuple[int, tuple[int, int]],
    b: tuple[int, tuple[int, int]],
) -> tuple[list[int], list[int], int, tuple, tuple]:
    """Token lists of A and B (not yet truncated), the label, and the spans a and b again."""
    (a_document, (a_start, a_stop)), (b_document, (b_start, b_stop)) = a, b
    tokens_a = [t for ids in corpus.ids[a_document][a_start:a_stop] for t in ids]
    tokens_b = [t for ids in corpus.ids[b_document][b_start:b_stop] for t in ids]
    label = IS_NEXT if b_document == a_document else NOT_NEXT
    return tokens_a, tokens_b, label, a, b


def _truncated(packed: tuple, corpus: _Corpus, rng: random.Random, options: _Options) -> NspExample:
    """truncate_seq_pair: drop one token from the front or back (at random) of the longer of A
    and B (B on a tie) until both fit in max_tokens; then [CLS] A [SEP] B [SEP]."""
    tokens_a, tokens_b, label, (a_document, a_span), (b_document, b_span) = packed
    while len(tokens_a) + len(tokens_b) > options.max_tokens:
        longer = tokens_a if len(tokens_a) > len(tokens_b) else tokens_b
        if rng.random() < 0.5:
            del longer[0]
        else:
            longer.pop()
    cls, sep = options.special.cls, options.special.sep
    input_ids = [cls, *tokens_a, sep, *tokens_b, sep]
    token_type_ids = [0] * (len(tokens_a) + 2) + [1] * (len(tokens_b) + 1)
    return NspExample(
        input_ids=tuple(input_ids),
        token_type_ids=tuple(token_type_ids),
        next_sentence_label=label,
        document_index=a_document,
        a_sentences=_input_span(corpus, a_document, a_span),
        b_document_index=b_document,
        b_sentences=_input_span(corpus, b_document, b_span),
    )


def _input_span(corpus: _Corpus, document: int, span: tuple[int, int]) -> tuple[int, int]:
    """A span of non-empty sentences -> the same span in the input document's indices."""
    positions = corpus.positions[document]
    return positions[span[0]], positions[span[1] - 1] + 1
