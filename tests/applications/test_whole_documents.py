"""Whole documents in one sparse pass (qkv.applications.whole_documents and the `pattern=` of
embed_long, classify_long and HierarchicalEncoder) against outside references: Hugging Face's
BertTokenizerFast for the windows, and transformers' BertModel / BertForSequenceClassification
given the pattern as a (B, L, L) attention mask built by hand (window, [CLS] row and column)."""

import pydoc_data.topics

import pytest
import torch
import torch.nn.functional as F
import transformers

from qkv.applications import (
    HierarchicalEncoder,
    chunk_batch,
    classify_long,
    embed_long,
    longformer_pattern,
    whole_documents,
)
from qkv.data.tokenizers import minilm_wordpiece
from qkv.models.bert import BertModel
from qkv.models.bert_heads import BertForSequenceClassification
from qkv.models.checkpoints.bundled import default_model_path
from qkv.sparse import Window

_TOPICS = pydoc_data.topics.topics
LONG = " ".join(_TOPICS["assert"].split())[:1500]  # about 330 tokens
TEXTS = [LONG, "Hi", "A man is playing a guitar while the sun sets over the quiet harbour town."]
W = 6  # keys on each side


@pytest.fixture(scope="module")
def tokenizer():
    return minilm_wordpiece()


@pytest.fixture(scope="module")
def minilm():
    return BertModel.from_pretrained(default_model_path()).eval()


@pytest.fixture(scope="module")
def hf_minilm():
    path = str(default_model_path())
    return transformers.BertModel.from_pretrained(path, attn_implementation="eager").eval()


def longformer_mask(attention_mask: torch.Tensor, window: int) -> torch.Tensor:
    """By hand, as transformers takes a prepared mask: (B, 1, L, L), added to the scores, 0
    where query i may see key j (|i - j| <= window, or i or j is [CLS] at position 0, and j a
    real token) and the most negative float elsewhere."""
    L = attention_mask.shape[1]
    i, j = torch.arange(L)[:, None], torch.arange(L)[None, :]
    allowed = ((i - j).abs() <= window) | (i == 0) | (j == 0)  # (L, L)
    visible = allowed[None, None] & attention_mask.bool()[:, None, None, :]  # (B, 1, L, L)
    return torch.zeros(visible.shape).masked_fill(~visible, torch.finfo(torch.float32).min)


def test_whole_documents_are_the_tokenizers_truncation_and_refuse_silent_loss(tokenizer):
    hf = transformers.BertTokenizerFast.from_pretrained(str(default_model_path()))
    docs = whole_documents(tokenizer, TEXTS, max_length=512)  # all fit: nothing is cut
    assert docs.num_texts == 3 and docs.text_index.tolist() == [0, 1, 2]
    for row, text in enumerate(TEXTS):
        want = hf(text)["input_ids"]
        assert docs.input_ids[row, : len(want)].tolist() == want
        assert int(docs.attention_mask[row].sum()) == len(want)
    assert docs.input_ids.shape[1] == len(hf(LONG)["input_ids"])  # padded to the longest only
    with pytest.raises(ValueError, match=r"1 of 3 texts \(the first at index 0\) are longer than "
                       r"max_length=64 tokens.*overflow='truncate'"):  # fmt: skip
        whole_documents(tokenizer, TEXTS, max_length=64)
    cut = whole_documents(tokenizer, TEXTS, max_length=64, overflow="truncate")
    assert cut.input_ids[0].tolist() == hf(LONG, truncation=True, max_length=64)["input_ids"]
    assert cut.input_ids.shape == (3, 64)


def test_one_sparse_pass_equals_transformers_with_the_pattern_as_a_mask(
    minilm, hf_minilm, tokenizer
):
    docs = whole_documents(tokenizer, TEXTS, max_length=512)
    with torch.no_grad():
        got = embed_long(minilm, docs, aggregation="first", pattern=longformer_pattern(W))
        dense = embed_long(minilm, docs, aggregation="first")
        mask = docs.attention_mask
        hidden = hf_minilm(docs.input_ids, attention_mask=longformer_mask(mask, W))[0]
    pooled = (hidden * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)  # mean over real
    want = F.normalize(pooled, dim=1)
    torch.testing.assert_close(got, want, rtol=0, atol=2e-6)
    assert (got[0] - dense[0]).abs().max() > 1e-3  # the long text: the window matters
    torch.testing.assert_close(got[1], dense[1], rtol=0, atol=2e-6)  # "Hi": all within W


def test_sparse_classification_equals_transformers_with_the_pattern_as_a_mask(tmp_path):
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=37, max_position_embeddings=40, num_labels=3,
    )  # fmt: skip
    theirs = transformers.BertForSequenceClassification(config).eval()
    with torch.no_grad():
        for parameter in theirs.parameters():
            parameter.normal_(0.0, 0.3)
    theirs.save_pretrained(tmp_path)
    ours = BertForSequenceClassification.from_pretrained(tmp_path).eval()
    generator = torch.Generator().manual_seed(3)
    texts = [torch.randint(4, 99, (n,), generator=generator).tolist() for n in (38, 7, 23)]
    docs = chunk_batch(texts, max_length=40, stride=0, cls_id=2, sep_id=3, pad_id=0)
    assert docs.input_ids.shape[0] == 3  # one window each: whole documents
    with torch.no_grad():
        got = classify_long(ours, docs, aggregation="first", pattern=longformer_pattern(3))
        mask = longformer_mask(docs.attention_mask, 3)
        want = theirs(docs.input_ids, attention_mask=mask).logits
        dense = classify_long(ours, docs, aggregation="first")
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert (got[0] - dense[0]).abs().max() > 1e-3


def test_hierarchical_chunks_with_a_pattern_equal_transformers(minilm, hf_minilm, tokenizer):
    docs = whole_documents(tokenizer, TEXTS, max_length=512)
    encoder = HierarchicalEncoder(minilm, chunk_pattern=longformer_pattern(W))
    with torch.no_grad():
        got = encoder.embed_chunks(docs)  # (3, E), mean-pooled
        mask = docs.attention_mask
        hidden = hf_minilm(docs.input_ids, attention_mask=longformer_mask(mask, W))[0]
    want = (hidden * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_errors_name_the_argument(minilm, tokenizer):
    with pytest.raises(ValueError, match=r"overflow: expected one of \('error', 'truncate'\)"):
        whole_documents(tokenizer, TEXTS, max_length=512, overflow="cut")
    with pytest.raises(ValueError, match="window"):
        longformer_pattern(-1)
    with pytest.raises(TypeError, match="chunk_pattern: expected a qkv.sparse pattern"):
        HierarchicalEncoder(minilm, chunk_pattern=torch.ones(4, 4, dtype=torch.bool))
    docs = whole_documents(tokenizer, TEXTS[1:], max_length=64)
    with pytest.raises(TypeError, match="pattern: expected a qkv.attention.sparse pattern"):
        embed_long(minilm, docs, pattern="window")
    assert embed_long(minilm, docs, pattern=Window(2, 2)).shape == (2, 384)
