"""Tokenizers against transformers: the MiniLM WordPiece gives the ids of transformers' BERT
tokenizer (loaded from the same folder, and built from vocab.txt alone); a WordPiece trained here
gives the ids transformers' BertTokenizer gives from its vocabulary; a byte-level BPE trained
here gives the ids of transformers' GPT2Tokenizer built from its vocab.json and merges.txt."""

import json

import pytest
import transformers
from tokenizers import Tokenizer

from qkv.data import (
    BERT_SPECIAL_TOKENS,
    END_OF_TEXT,
    BertSpecialIds,
    bert_special_ids,
    load_tokenizer,
    minilm_wordpiece,
    save_tokenizer,
    train_bpe,
    train_wordpiece,
)

SENTENCES = [
    'The "while" statement is used for repeated execution as long as an expression is true.',
    "Naïve CAFÉ façade — déjà vu; 東京 x=3.14 #comment",
    "  leading   and trailing  spaces\tand\ttabs\n",
    "a_very_long_identifier_name(with, args) -> None",
]
PAIRS = [(SENTENCES[0], SENTENCES[1]), (SENTENCES[2], SENTENCES[3])]


@pytest.fixture(scope="module")
def wordpiece(texts):
    return train_wordpiece(texts, vocab_size=4000)


@pytest.fixture(scope="module")
def bpe(texts):
    return train_bpe(texts, vocab_size=4000)


def test_minilm_wordpiece_matches_transformers(minilm, minilm_folder):
    from_folder = transformers.BertTokenizer.from_pretrained(str(minilm_folder))
    from_vocab = transformers.BertTokenizer(vocab=str(minilm_folder / "vocab.txt"))
    for reference in (from_folder, from_vocab):
        for sentence in SENTENCES:
            assert minilm.encode(sentence).ids == reference(sentence)["input_ids"]
        for a, b in PAIRS:
            ours, theirs = minilm.encode(a, b), reference(a, b)
            assert ours.ids == theirs["input_ids"]
            assert ours.type_ids == theirs["token_type_ids"]
    assert bert_special_ids(minilm) == BertSpecialIds(pad=0, unk=100, cls=101, sep=102, mask=103)


def test_minilm_wordpiece_neither_pads_nor_truncates(minilm, texts):
    assert len(minilm.encode(texts[0]).ids) > 128  # the file alone would cut at 128
    assert minilm.encode("a b").ids == [101, 1037, 1038, 102]  # and would pad to 128


def test_trained_wordpiece_matches_transformers_bert_tokenizer(wordpiece):
    assert [wordpiece.id_to_token(i) for i in range(5)] == list(BERT_SPECIAL_TOKENS)
    added = [token.content for token in wordpiece.get_added_tokens_decoder().values()]
    assert sorted(added) == sorted(BERT_SPECIAL_TOKENS)  # "##x" are vocabulary, not added
    assert wordpiece.encode("a##b", add_special_tokens=False).tokens == ["a", "#", "#", "b"]
    assert wordpiece.get_vocab_size() > 3000
    reference = transformers.BertTokenizer(vocab=wordpiece.get_vocab())
    for sentence in SENTENCES:
        assert wordpiece.encode(sentence).ids == reference(sentence)["input_ids"]
    for a, b in PAIRS:
        ours, theirs = wordpiece.encode(a, b), reference(a, b)
        assert (ours.ids, ours.type_ids) == (theirs["input_ids"], theirs["token_type_ids"])


def test_trained_wordpiece_round_trip(wordpiece, texts):
    """decode(encode(text)) is the BERT-normalised text (lower case, no accents), up to the
    spaces that WordPiece puts around punctuation; no [UNK] on the text it was trained on."""
    unk = wordpiece.token_to_id("[UNK]")
    for text in texts[:10]:
        ids = wordpiece.encode(text, add_special_tokens=False).ids
        assert unk not in ids
        normalised = wordpiece.normalizer.normalize_str(text)
        assert "".join(wordpiece.decode(ids).split()) == "".join(normalised.split())
    assert wordpiece.decode(wordpiece.encode("Déjà Vu").ids) == "deja vu"


def test_trained_bpe_round_trips_exactly(bpe, texts):
    assert bpe.token_to_id(END_OF_TEXT) == 0
    for text in [*texts[:10], *SENTENCES, "emoji 🙂 and \x00 bytes never seen in training"]:
        ids = bpe.encode(text).ids
        assert bpe.decode(ids) == text
    assert len(bpe.encode(texts[0]).ids) < len(texts[0].encode()) / 2.5  # it compresses


def test_trained_bpe_matches_transformers_gpt2_tokenizer(bpe, tmp_path):
    vocab_file, merges_file = bpe.model.save(str(tmp_path))
    reference = transformers.GPT2Tokenizer(vocab=vocab_file, merges=merges_file)
    for sentence in SENTENCES:
        assert bpe.encode(sentence).ids == reference(sentence)["input_ids"]
        assert reference.decode(bpe.encode(sentence).ids) == sentence


def test_training_is_deterministic(texts, wordpiece, bpe):
    again = train_wordpiece(texts, vocab_size=4000)
    assert again.get_vocab() == wordpiece.get_vocab()
    assert json.loads(train_bpe(texts, vocab_size=4000).to_str()) == json.loads(bpe.to_str())


def test_save_and_load(bpe, wordpiece, tmp_path):
    for tokenizer in (bpe, wordpiece):
        path = save_tokenizer(tokenizer, tmp_path / "sub" / "tokenizer.json")
        loaded = load_tokenizer(path)
        assert loaded.encode(SENTENCES[1]).ids == tokenizer.encode(SENTENCES[1]).ids
        assert load_tokenizer(tmp_path / "sub").to_str() == loaded.to_str()  # a folder
    copy = minilm_wordpiece(path=tmp_path / "sub")  # any folder with a tokenizer.json
    assert copy.encode("x").ids == wordpiece.encode("x").ids


def test_errors(tmp_path, bpe):
    with pytest.raises(FileNotFoundError, match="nowhere"):
        load_tokenizer(tmp_path / "nowhere.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not a valid tokenizer.json"):
        load_tokenizer(bad)
    with pytest.raises(ValueError, match="vocab_size"):
        train_bpe(["some text"], vocab_size=100)
    with pytest.raises(TypeError, match="texts"):
        train_wordpiece("a string, not a list")
    with pytest.raises(ValueError, match="texts"):
        train_wordpiece([])
    with pytest.raises(ValueError, match=r"\[PAD\]"):
        bert_special_ids(bpe)
    with pytest.raises(TypeError, match="tokenizer"):
        save_tokenizer("not a tokenizer", tmp_path / "x.json")
    assert isinstance(load_tokenizer(save_tokenizer(bpe, tmp_path / "x.json")), Tokenizer)
