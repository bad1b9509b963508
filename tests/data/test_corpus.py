"""The corpora: pydoc's topics as documents of sentences (checked against the text CPython ships,
character for character), a user's text file, and the seeded train/validation split."""

import os
import random
import re
import subprocess
import sys
from pathlib import Path
from pydoc_data.topics import topics

import pytest

from qkv.data import (
    documentation_sentences,
    pydoc_documents,
    pydoc_texts,
    split_sentences,
    text_file_documents,
    text_file_texts,
    train_validation_split,
)

UNDERLINE = re.compile(r"^\s*([*=\-~^])\1{2,}\s*$", re.MULTILINE)  # reST heading underlines


def no_space(text):
    return "".join(text.split())


def test_pydoc_documents_are_the_sorted_topics(documents):
    names = sorted(topics)
    assert len(documents) == len(names) == 79
    assert documents == pydoc_documents()  # deterministic
    assert documents[0][0] == 'The "assert" statement'  # sorted: "assert" comes first
    assert pydoc_texts() == [topics[name] for name in names]
    assert sum(len(document) for document in documents) > 3000


def test_pydoc_sentences_cover_the_whole_text(documents):
    """Every character but white space and heading underlines is kept, in order."""
    raw = "".join(topics.values())
    kept = sum(len(no_space(sentence)) for document in documents for sentence in document)
    assert 0.98 * len(no_space(raw)) <= kept <= len(no_space(raw))
    for name, document in zip(sorted(topics), documents, strict=True):
        assert no_space("".join(document)) == no_space(UNDERLINE.sub("", topics[name]))


def test_pydoc_sentences_are_sentences(documents):
    """Prose is split at sentence ends: no sentence holds '. The ' inside, white space is
    collapsed, and most sentences end as sentences do (the others are headings and code)."""
    sentences = [sentence for document in documents for sentence in document]
    assert not [s for s in sentences if re.search(r"[a-z]\. The [a-z]", s)]
    assert all(s == " ".join(s.split()) for s in sentences)
    ends = [s for s in sentences if re.search(r"[.:?!][\"')\]”’]?$", s)]
    assert len(ends) > 0.7 * len(sentences)


def test_split_sentences_on_hand_made_text():
    text = 'Pi is 3.14 here.  See e.g. the docs!\nIs it "quoted."  Yes (really). 2 more? no'
    assert split_sentences(text) == [
        "Pi is 3.14 here.",
        "See e.g. the docs!",
        'Is it "quoted."',
        "Yes (really).",
        "2 more? no",
    ]
    assert split_sentences("   ") == []
    with pytest.raises(TypeError, match="text"):
        split_sentences(None)


def test_documentation_sentences_end_at_paragraphs():
    text = (
        "Title\n*****\n\nFirst one. Second\none.\n\n   x = 1\n   y = 2\n\n  Last. Indented\n  too"
    )
    assert documentation_sentences(text) == [
        "Title",
        "First one.",
        "Second one.",
        "x = 1 y = 2",
        "Last.",
        "Indented too",
    ]


def test_text_file_documents(tmp_path):
    file = tmp_path / "corpus.txt"
    file.write_text("One. Two.\nThree\n\n\n  \nFour!\n", encoding="utf-8")
    assert text_file_documents(file) == [["One.", "Two.", "Three"], ["Four!"]]
    assert text_file_texts(file) == ["One. Two.\nThree", "Four!"]


def test_text_file_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.txt"):
        text_file_documents(tmp_path / "missing.txt")
    with pytest.raises(IsADirectoryError, match="is a folder; expected a file"):
        text_file_documents(tmp_path)
    empty = tmp_path / "empty.txt"
    empty.write_text("\n \n\n")
    with pytest.raises(ValueError, match="has no text"):
        text_file_documents(empty)
    binary = tmp_path / "latin1.txt"
    binary.write_bytes("café".encode("latin-1"))
    with pytest.raises(ValueError, match="not UTF-8"):
        text_file_texts(binary)


def test_train_validation_split_is_seeded_and_stable(documents):
    train, validation = train_validation_split(documents, validation_fraction=0.1, seed=0)
    assert len(validation) == round(0.1 * len(documents)) == 8
    assert len(train) + len(validation) == len(documents)
    assert sorted(map(tuple, train + validation)) == sorted(map(tuple, documents))
    assert [d for d in documents if d in validation] == validation  # input order kept
    assert train_validation_split(documents, validation_fraction=0.1, seed=0) == (train, validation)
    shuffled = documents[:]
    random.Random(3).shuffle(shuffled)
    _, validation_shuffled = train_validation_split(shuffled, validation_fraction=0.1, seed=0)
    assert sorted(map(tuple, validation_shuffled)) == sorted(map(tuple, validation))
    _, other_seed = train_validation_split(documents, validation_fraction=0.1, seed=1)
    assert other_seed != validation


def test_train_validation_split_edges():
    assert train_validation_split(["a", "b"], validation_fraction=0.01) in [
        (["a"], ["b"]),
        (["b"], ["a"]),
    ]
    assert train_validation_split(["a", "b"], validation_fraction=0.0) == (["a", "b"], [])
    assert train_validation_split(["a"], validation_fraction=0.5) == (["a"], [])
    with pytest.raises(ValueError, match="validation_fraction"):
        train_validation_split(["a"], validation_fraction=1.0)
    with pytest.raises(TypeError, match="seed"):
        train_validation_split(["a"], seed="0")


def test_a_file_that_cannot_be_read_is_not_called_missing(tmp_path):
    """A file in a folder this user may not enter exists: the error says it cannot be read
    (it said "does not exist"). Run as an unprivileged user where the tests run as root."""
    folder = tmp_path / "private"
    folder.mkdir()
    (folder / "notes.txt").write_text("One. Two.")
    folder.chmod(0o700)
    script = (
        "import os, sys\n"
        "from qkv.data.corpus import text_file_texts\n"  # imported while the files are open
        "if os.getuid() == 0:\n"
        "    os.setgid(65534); os.setuid(65534)\n"
        "else:\n"
        "    os.chmod(sys.argv[2], 0o000)\n"
        "try:\n"
        "    text_file_texts(sys.argv[1])\n"
        "except OSError as error:\n"
        "    print(type(error).__name__, error)\n"
    )
    source = str(Path(__file__).resolve().parents[2] / "src")
    environment = {**os.environ, "PYTHONPATH": source}
    done = subprocess.run([sys.executable, "-c", script, str(folder / "notes.txt"), str(folder)],
                          capture_output=True, text=True, env=environment, cwd="/")  # fmt: skip
    folder.chmod(0o700)
    assert done.stdout.strip().endswith("cannot be read (Permission denied)"), done.stderr[-2000:]
    assert done.stdout.startswith("PermissionError path: ")
