"""Long texts (qkv.applications.long_text) against outside references: the windows of Hugging Face's
BertTokenizerFast(return_overflowing_tokens=True) on the all-MiniLM-L6-v2 tokenizer, and
transformers' BertModel / BertForSequenceClassification run window by window, with the
aggregation done by hand here."""

import pydoc_data.topics

import pytest
import torch
import torch.nn.functional as F
import transformers

from qkv.applications.embed import SentenceEncoder, default_model_path
from qkv.applications.long_text import (
    Windows,
    aggregate_windows,
    chunk_batch,
    chunk_ids,
    chunk_texts,
    classify_long,
    embed_long,
    embed_long_texts,
    truncate_ids,
)
from qkv.models.bert import BertConfig, BertModel
from qkv.models.bert_heads import BertForSequenceClassification

# real English: CPython's documentation of `assert`, from its first sentence (75 tokens)
_ASSERT = " ".join(pydoc_data.topics.topics["assert"].split())
LONG = _ASSERT[_ASSERT.index("Assert statements") :][:300]
TEXTS = [LONG, "Hi", "A man is playing a guitar while the sun sets over the quiet harbour town."]
MAX_LENGTH, STRIDE = 24, 6  # 22 content tokens a window, a new window every 16: LONG -> 5
CLS, SEP, PAD = 101, 102, 0


@pytest.fixture(scope="module")
def hf_tokenizer():
    return transformers.BertTokenizerFast.from_pretrained(str(default_model_path()))


@pytest.fixture(scope="module")
def encoder():
    return SentenceEncoder.from_pretrained()  # qkv BertModel + tokenizer, truncation at 256


@pytest.fixture(scope="module")
def hf_model():
    return transformers.BertModel.from_pretrained(str(default_model_path())).eval()


def hf_windows(hf_tokenizer, text, max_length, stride):
    encoded = hf_tokenizer(
        text,
        truncation=True,
        max_length=max_length,
        stride=stride,
        return_overflowing_tokens=True,
    )
    return encoded["input_ids"]


@pytest.mark.parametrize("max_length, stride", [(3, 0), (5, 2), (8, 0), (8, 3), (16, 5), (32, 29)])
def test_windows_equal_hugging_face_overflow_windows(hf_tokenizer, max_length, stride):
    content = max_length - 2
    exact = hf_tokenizer.decode(hf_tokenizer(LONG, add_special_tokens=False)["input_ids"][:content])
    for text in [*TEXTS, "", exact]:
        ids = hf_tokenizer(text, add_special_tokens=False)["input_ids"]
        got = chunk_ids(ids, max_length=max_length, stride=stride, cls_id=CLS, sep_id=SEP)
        assert got == hf_windows(hf_tokenizer, text, max_length, stride), (text, max_length)
    fits = list(range(200, 200 + content))
    assert chunk_ids(fits, max_length=max_length, stride=stride, cls_id=CLS, sep_id=SEP) == [
        [CLS, *fits, SEP]
    ]


@pytest.mark.parametrize("max_length, stride", [(8, 3), (20, 6)])
def test_batched_windows_equal_hugging_face(hf_tokenizer, encoder, max_length, stride):
    texts = [TEXTS[1], LONG, "", TEXTS[2]]
    want = hf_tokenizer(
        texts,
        truncation=True,
        max_length=max_length,
        stride=stride,
        return_overflowing_tokens=True,
        padding=True,
        return_tensors="pt",
    )
    ids = [hf_tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    got = chunk_batch(ids, max_length=max_length, stride=stride, cls_id=CLS, sep_id=SEP, pad_id=PAD)
    assert torch.equal(got.input_ids, want["input_ids"])
    assert torch.equal(got.attention_mask, want["attention_mask"])
    assert got.text_index.tolist() == want["overflow_to_sample_mapping"].tolist()
    assert got.num_texts == len(texts)
    # the tokenizers.Tokenizer path: its own truncation (256) is ignored and left in place
    from_strings = chunk_texts(encoder.tokenizer, texts, max_length=max_length, stride=stride)
    assert torch.equal(from_strings.input_ids, want["input_ids"])
    assert from_strings.text_index.tolist() == got.text_index.tolist()
    assert encoder.tokenizer.truncation["max_length"] == 256 and encoder.tokenizer.padding is None


@pytest.mark.parametrize("max_length", [3, 10, 512])
def test_truncate_ids_equals_hugging_face_truncation(hf_tokenizer, max_length):
    for text in [*TEXTS, ""]:
        ids = hf_tokenizer(text, add_special_tokens=False)["input_ids"]
        want = hf_tokenizer(text, truncation=True, max_length=max_length)["input_ids"]
        assert truncate_ids(ids, max_length=max_length, cls_id=CLS, sep_id=SEP) == want


@pytest.fixture(scope="module")
def plain_short(encoder):
    return encoder.encode(TEXTS[1:])


@pytest.mark.parametrize("aggregation", ["mean", "max", "first"])
def test_short_texts_get_their_plain_embedding(encoder, plain_short, aggregation):
    """A text that fits in one window: every aggregation gives what qkv.applications.embed gives
    (which test_embed.py checks against sentence-transformers)."""
    short = TEXTS[1:]
    kwargs = dict(max_length=256, stride=64, aggregation=aggregation, batch_size=2)
    got = embed_long_texts(encoder.model, encoder.tokenizer, short, **kwargs)
    torch.testing.assert_close(got, plain_short, rtol=0, atol=1e-5)


@pytest.fixture(scope="module")
def reference_pools(hf_tokenizer, hf_model):
    """transformers' BertModel on each HF overflow window alone (no padding): per text, the
    mean-pooled vectors (windows, E) and the windows' token counts."""
    pools = []
    with torch.no_grad():
        for text in TEXTS:
            windows = hf_windows(hf_tokenizer, text, MAX_LENGTH, STRIDE)
            vectors = [hf_model(torch.tensor([w])).last_hidden_state[0].mean(0) for w in windows]
            pools.append((torch.stack(vectors), torch.tensor([float(len(w)) for w in windows])))
    assert len(pools[0][0]) == 5  # the long text really spans several windows
    return pools


def by_hand(pools, aggregation):
    rows = []
    for vectors, counts in pools:
        if aggregation == "mean":
            rows.append((vectors * counts[:, None]).sum(0) / counts.sum())
        elif aggregation == "max":
            rows.append(vectors.max(0).values)
        else:
            rows.append(vectors[0])
    return torch.stack(rows)


@pytest.mark.parametrize("aggregation", ["mean", "max", "first"])
def test_long_text_embeddings_match_transformers_by_hand(encoder, reference_pools, aggregation):
    normalize = aggregation == "mean"  # the default; checked once, the rest raw
    kwargs = dict(max_length=MAX_LENGTH, stride=STRIDE, aggregation=aggregation, batch_size=3)
    got = embed_long_texts(encoder.model, encoder.tokenizer, TEXTS, normalize=normalize, **kwargs)
    want = by_hand(reference_pools, aggregation)
    if normalize:
        want = F.normalize(want, dim=1)
    torch.testing.assert_close(got, want, rtol=0, atol=2e-5)


def test_truncation_loses_what_the_windows_keep(encoder):
    """Two texts that differ only after the first window: truncation ("first") cannot tell
    them apart, the sliding window can."""
    endings = [" In the end everyone was happy.", " Quantum chemistry of rare-earth magnets."]
    texts = [LONG + ending for ending in endings]
    kwargs = dict(max_length=MAX_LENGTH, stride=STRIDE, batch_size=8)
    first = embed_long_texts(encoder.model, encoder.tokenizer, texts, aggregation="first", **kwargs)
    mean = embed_long_texts(encoder.model, encoder.tokenizer, texts, aggregation="mean", **kwargs)
    torch.testing.assert_close(first[0], first[1], rtol=0, atol=1e-6)
    assert (mean[0] - mean[1]).norm() > 1e-2


HF_CONFIG = dict(
    vocab_size=99,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=37,
    max_position_embeddings=40,
    num_labels=3,
)


@pytest.fixture(scope="module")
def classifiers(tmp_path_factory):
    torch.manual_seed(0)
    theirs = transformers.BertForSequenceClassification(transformers.BertConfig(**HF_CONFIG))
    with torch.no_grad():
        for parameter in theirs.parameters():
            parameter.normal_(0.0, 0.3)
    folder = tmp_path_factory.mktemp("classifier")
    theirs.eval().save_pretrained(folder)
    ours = BertForSequenceClassification.from_pretrained(folder).eval()
    return ours, theirs


@pytest.mark.parametrize("aggregation", ["mean", "max", "first"])
def test_classification_matches_transformers_by_hand(classifiers, aggregation):
    ours, theirs = classifiers
    generator = torch.Generator().manual_seed(3)
    texts = [torch.randint(4, 99, (n,), generator=generator).tolist() for n in (50, 7, 23, 0)]
    windows = chunk_batch(texts, max_length=12, stride=3, cls_id=2, sep_id=3, pad_id=0)
    got = classify_long(ours, windows, aggregation=aggregation, batch_size=2)
    rows = []
    with torch.no_grad():
        for ids in texts:
            chunks = chunk_ids(ids, max_length=12, stride=3, cls_id=2, sep_id=3)
            logits = torch.cat([theirs(torch.tensor([c])).logits for c in chunks])  # (w, 3)
            counts = torch.tensor([float(len(c)) for c in chunks])
            rows.append((logits, counts))
    want = by_hand(rows, aggregation)
    assert got.shape == (4, 3)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_aggregate_windows_by_hand():
    windows = Windows(
        input_ids=torch.ones(3, 4, dtype=torch.long),
        attention_mask=torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 0]]),
        text_index=torch.tensor([0, 0, 1]),
        num_texts=2,
    )
    values = torch.tensor([[1.0, -2.0], [4.0, 5.0], [7.0, 8.0]])
    mean = aggregate_windows(values, windows, aggregation="mean")
    torch.testing.assert_close(mean, torch.tensor([[2.0, 1 / 3], [7.0, 8.0]]))
    top = aggregate_windows(values, windows, aggregation="max")
    assert top.tolist() == [[4.0, 5.0], [7.0, 8.0]]
    assert aggregate_windows(values, windows, aggregation="first").tolist() == [
        [1.0, -2.0],
        [7.0, 8.0],
    ]


def test_gradients_flow_through_every_aggregation():
    model = BertModel(BertConfig.from_name("tiny")).train()
    ids = [list(range(5, 40)), list(range(40, 45))]
    windows = chunk_batch(ids, max_length=10, stride=2, cls_id=1, sep_id=2, pad_id=0)
    for aggregation in ("mean", "max", "first"):
        model.zero_grad()
        embed_long(model, windows, aggregation=aggregation).sum().backward()
        grad = model.embeddings.token_embedding.weight.grad
        assert torch.isfinite(grad).all() and grad.abs().sum() > 0


def test_errors_name_the_argument(encoder, classifiers):
    ids = list(range(1000, 1020))
    with pytest.raises(ValueError, match="stride: expected 0 <= stride < max_length - 2 = 6"):
        chunk_ids(ids, max_length=8, stride=6, cls_id=CLS, sep_id=SEP)
    with pytest.raises(ValueError, match="stride"):
        chunk_ids(ids, max_length=8, stride=-1, cls_id=CLS, sep_id=SEP)
    with pytest.raises(ValueError, match="max_length: expected at least 3"):
        chunk_ids(ids, max_length=2, stride=0, cls_id=CLS, sep_id=SEP)
    with pytest.raises(TypeError, match="max_length"):
        truncate_ids(ids, max_length=8.0, cls_id=CLS, sep_id=SEP)
    with pytest.raises(ValueError, match=r"max_length: expected 3\.\.512"):
        embed_long_texts(encoder.model, encoder.tokenizer, ["x"], max_length=513, stride=0)
    with pytest.raises(ValueError, match="aggregation: expected one of"):
        embed_long_texts(encoder.model, encoder.tokenizer, ["x"], stride=0, aggregation="sum")
    ours, _ = classifiers
    too_long = chunk_batch(
        [list(range(4, 60))], max_length=41, stride=0, cls_id=2, sep_id=3, pad_id=0
    )
    with pytest.raises(ValueError, match="windows: length 41 exceeds the model's max_posit"):
        classify_long(ours, too_long)
    with pytest.raises(ValueError, match="aggregation: expected one of"):
        classify_long(ours, too_long, aggregation="median")
    with pytest.raises(TypeError, match="model: expected a qkv BertModel"):
        embed_long(ours, too_long)
    with pytest.raises(ValueError, match="text_index: expected every text 0..1"):
        Windows(too_long.input_ids, too_long.attention_mask, torch.tensor([0, 0]), 2)
