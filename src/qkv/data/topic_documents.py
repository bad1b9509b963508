"""Long-document classification from CPython's documentation: which part of the reference is a
document mostly about? Built from `pydoc_data.topics`, no download.

The 79 pydoc topics fall into five groups, the labels (`TOPIC_GROUPS`): statements, expressions
(with literals and identifiers), the data model, the built-in types, and the execution model
(with the debugger). Every topic's sentences (`documentation_sentences`; a sentence that occurs
in an earlier topic is dropped, since pydoc repeats e.g. `if` inside `compound`) are packed into
segments of about `segment_words` words, and each group's segments are split into a train and
a test pool (`train_validation_split`, by a seeded hash of the text), so that no test document
holds text a training document holds.

A document takes segments of its label's group until they make `label_share` of a target
length drawn uniformly from [min_words, max_words], then segments of the other groups (drawn
at random) until those make the rest, and is shuffled: the label is the group that gives the
most words, spread over the whole document, not said at its start. Reading only the start of a
document (truncation) sees a sample of it, as in long-document classification (Pappagari et al.
2019; Yang et al. 2016). pydoc's text runs at about 1.9 WordPiece tokens per word, so with the
defaults about three documents in four are longer than 512 BERT tokens (the median is about
850 tokens, the longest about 2,400).

    documents = pydoc_topic_documents(num_train=480, num_test=240, seed=0)
    documents.train[0].text, documents.train[0].label, documents.labels
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from qkv.data.corpus import documentation_sentences, train_validation_split
from qkv.validation import check_int

__all__ = [
    "TOPIC_GROUPS",
    "TopicDocument",
    "TopicDocuments",
    "pydoc_topic_documents",
    "topic_segments",
]

# label name -> the pydoc topics of that group (every topic of pydoc_data.topics, once)
TOPIC_GROUPS: dict[str, tuple[str, ...]] = {
    "statements": (
        "assert", "assignment", "augassign", "async", "break", "class", "compound", "continue",
        "del", "else", "for", "function", "global", "if", "import", "nonlocal", "pass", "raise",
        "return", "try", "while", "with", "yield",
    ),
    "expressions": (
        "atom-identifiers", "atom-literals", "attribute-references", "await", "binary", "bitwise",
        "booleans", "calls", "comparisons", "conversions", "dict", "exprlists", "floating",
        "id-classes", "identifiers", "imaginary", "in", "integers", "lambda", "lists", "numbers",
        "operator-summary", "power", "shifting", "slicings", "strings", "subscriptions", "unary",
    ),
    "data model": (
        "attribute-access", "callable-types", "context-managers", "customization",
        "numeric-types", "objects", "sequence-types", "specialattrs", "specialnames", "types",
    ),
    "built-in types": (
        "bltin-code-objects", "bltin-ellipsis-object", "bltin-null-object", "bltin-type-objects",
        "formatstrings", "string-methods", "truth", "typesfunctions", "typesmapping",
        "typesmethods", "typesmodules", "typesseq", "typesseq-mutable",
    ),
    "execution model": ("debugger", "dynamic-features", "exceptions", "execmodel", "naming"),
}  # fmt: skip


@dataclass(frozen=True)
class TopicDocument:
    """One document: its text (segments joined by blank lines), its label (an index into
    `TopicDocuments.labels`), and per segment, in order, its group and its number of words."""

    text: str
    label: int
    segment_groups: tuple[int, ...]
    segment_words: tuple[int, ...]

    @property
    def num_words(self) -> int:
        return sum(self.segment_words)

    def group_words(self, group: int) -> int:
        """How many of the document's words come from `group`."""
        pairs = zip(self.segment_groups, self.segment_words, strict=True)
        return sum(words for owner, words in pairs if owner == group)


@dataclass(frozen=True)
class TopicDocuments:
    """Train and test documents, built from disjoint segments; labels: the group names."""

    train: list[TopicDocument]
    test: list[TopicDocument]
    labels: tuple[str, ...]


def topic_segments(*, segment_words: int = 50) -> dict[str, list[str]]:
    """Each group's text as segments of consecutive sentences of one topic, in topic order.

    A segment gathers sentences until it has at least `segment_words` words; a sentence longer
    than 2 * segment_words (a table, a grammar) is cut into pieces of that many words; a topic's
    last few sentences join its previous segment. White space is collapsed to single spaces.
    """
    from pydoc_data.topics import topics

    check_int("segment_words", segment_words, minimum=1)
    seen: set[str] = set()
    segments: dict[str, list[str]] = {}
    for group, names in TOPIC_GROUPS.items():
        segments[group] = []
        for name in names:
            sentences = [s for s in documentation_sentences(topics[name]) if s not in seen]
            seen.update(sentences)
            segments[group] += _pack(sentences, segment_words)
    return segments


def pydoc_topic_documents(
    *,
    num_train: int = 480,
    num_test: int = 240,
    min_words: int = 150,
    max_words: int = 750,
    label_share: float = 0.6,
    test_fraction: float = 0.3,
    segment_words: int = 50,
    seed: int = 0,
) -> TopicDocuments:
    """Labelled long documents from the pydoc topics (see the module's docstring).

    Labels are balanced (num_train and num_test each cycle through the groups, then are
    shuffled). label_share in (0.5, 1]: the least share of a document's words that its label's
    group gives (1: documents of one group only). The same arguments give the same documents
    in every process.
    """
    check_int("num_train", num_train, minimum=1)
    check_int("num_test", num_test, minimum=1)
    check_int("min_words", min_words, minimum=1)
    check_int("max_words", max_words, minimum=min_words)
    check_int("seed", seed)
    if isinstance(label_share, bool) or not isinstance(label_share, (int, float)):
        raise TypeError(f"label_share: expected a float in (0.5, 1], got {label_share!r}")
    if not 0.5 < label_share <= 1.0:
        raise ValueError(f"label_share: expected a float in (0.5, 1], got {label_share}")
    train_pools, test_pools = [], []
    for segments in topic_segments(segment_words=segment_words).values():
        train, test = train_validation_split(segments, validation_fraction=test_fraction, seed=seed)
        train_pools.append(train)
        test_pools.append(test)
    lengths = (min_words, max_words, label_share)
    return TopicDocuments(
        train=_documents(train_pools, num_train, lengths, random.Random(f"train-{seed}")),
        test=_documents(test_pools, num_test, lengths, random.Random(f"test-{seed}")),
        labels=tuple(TOPIC_GROUPS),
    )


def _pack(sentences: list[str], segment_words: int) -> list[str]:
    """Consecutive sentences -> segments of at least segment_words words (see topic_segments)."""
    longest = 2 * segment_words
    pieces = []
    for sentence in sentences:
        words = sentence.split()
        pieces += [words[start : start + longest] for start in range(0, len(words), longest)]
    segments: list[list[str]] = []
    current: list[str] = []
    for piece in pieces:
        current += piece
        if len(current) >= segment_words:
            segments.append(current)
            current = []
    if current and segments:
        segments[-1] += current
    elif current:
        segments.append(current)
    return [" ".join(words) for words in segments]


def _documents(
    pools: list[list[str]], count: int, lengths: tuple, rng: random.Random
) -> list[TopicDocument]:
    """`count` documents from per-group segment pools, labels balanced."""
    min_words, max_words, label_share = lengths
    labels = [index % len(pools) for index in range(count)]
    rng.shuffle(labels)
    documents = []
    for label in labels:
        target = rng.randint(min_words, max_words)
        parts = _draw(pools, [label], label_share * target, rng)
        label_words = sum(len(text.split()) for _, text in parts)
        others = [group for group in range(len(pools)) if group != label]
        # the other groups together stay below label_words * (1 - share) / share < label_words
        budget = label_words * (1.0 - label_share) / label_share
        parts += _draw(pools, others, budget, rng, exact=True)
        rng.shuffle(parts)
        documents.append(
            TopicDocument(
                text="\n\n".join(text for _, text in parts),
                label=label,
                segment_groups=tuple(group for group, _ in parts),
                segment_words=tuple(len(text.split()) for _, text in parts),
            )
        )
    return documents


def _draw(
    pools: list[list[str]], groups: list[int], words: float, rng: random.Random, exact=False
) -> list[tuple[int, str]]:
    """Distinct random segments of `groups` until they hold `words` words: at least that many
    (stopping when the groups run out), or with `exact` at most that many (stopping after 20
    draws in a row that would overshoot)."""
    chosen: list[tuple[int, str]] = []
    used: set[tuple[int, int]] = set()
    total, misses = 0, 0
    available = sum(len(pools[group]) for group in groups)
    while len(used) < available and misses < 20 and (exact or total < words):
        group = rng.choice(groups)
        index = rng.randrange(len(pools[group])) if pools[group] else None
        if index is None or (group, index) in used:
            continue
        size = len(pools[group][index].split())
        if exact and total + size > words:
            misses += 1
            continue
        used.add((group, index))
        chosen.append((group, pools[group][index]))
        total += size
    return chosen
