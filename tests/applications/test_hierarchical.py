"""The hierarchical long-document encoder (qkv.applications.hierarchical) and its pydoc task
(qkv.data.topic_documents), against outside references: transformers' BertModel on the real
all-MiniLM-L6-v2 window by window, and PyTorch's nn.TransformerEncoderLayer over the chunks,
with the grouping, padding and pooling done by hand here."""

import pydoc_data.topics

import pytest
import torch
import torch.nn.functional as F
import transformers
from torch import nn

from qkv.applications import (
    HierarchicalClassifier,
    HierarchicalEncoder,
    Windows,
    chunk_batch,
    chunk_texts,
    group_chunks,
)
from qkv.data.tokenizers import minilm_wordpiece
from qkv.data.topic_documents import TOPIC_GROUPS, pydoc_topic_documents, topic_segments
from qkv.layers import EncoderBlock
from qkv.models.bert import BertConfig, BertModel
from qkv.models.checkpoints.bundled import default_model_path

# real English: CPython's documentation of `assert`, from its first sentence
_ASSERT = " ".join(pydoc_data.topics.topics["assert"].split())
LONG = _ASSERT[_ASSERT.index("Assert statements") :][:300]
TEXTS = ["Hi", LONG, "A man is playing a guitar while the sun sets over the quiet harbour town."]
MAX_LENGTH, STRIDE = 24, 6  # 22 content tokens a window: LONG -> 5 windows, the others 1


@pytest.fixture(scope="module")
def tokenizer():
    return minilm_wordpiece()


@pytest.fixture(scope="module")
def minilm():
    return BertModel.from_pretrained(default_model_path()).eval()


@pytest.fixture(scope="module")
def hf_minilm():
    return transformers.BertModel.from_pretrained(str(default_model_path())).eval()


@pytest.fixture(scope="module")
def windows(tokenizer):
    return chunk_texts(tokenizer, TEXTS, max_length=MAX_LENGTH, stride=STRIDE)


@pytest.mark.parametrize("pooling", ["cls", "mean"])
def test_chunk_vectors_equal_transformers_window_by_window(minilm, hf_minilm, windows, pooling):
    """Batched and padded here; one window at a time, unpadded, in transformers."""
    assert windows.text_index.tolist() == [0, 1, 1, 1, 1, 1, 2]
    encoder = HierarchicalEncoder(minilm, chunk_pooling=pooling)
    with torch.inference_mode():
        got = encoder.embed_chunks(windows, batch_size=3)  # batches padded to their longest
        want = []
        for ids, mask in zip(windows.input_ids, windows.attention_mask, strict=True):
            hidden = hf_minilm(ids[mask.bool()][None]).last_hidden_state[0]  # (l, E)
            want.append(hidden[0] if pooling == "cls" else hidden.mean(dim=0))
    assert got.shape == (7, 384)
    torch.testing.assert_close(got, torch.stack(want), rtol=0, atol=1e-5)


@pytest.mark.parametrize("document_pooling", ["mean", "attention"])
def test_a_document_vector_does_not_depend_on_its_batch(minilm, tokenizer, document_pooling):
    """Pad invariance: the short texts get padding chunks next to the long one; each text's
    vector equals the one it gets alone, whatever its place in the batch."""
    torch.manual_seed(0)
    encoder = HierarchicalEncoder(minilm, document_pooling=document_pooling).eval()
    kwargs = dict(max_length=MAX_LENGTH, stride=STRIDE)
    with torch.inference_mode():
        together = encoder(chunk_texts(tokenizer, TEXTS, **kwargs))
        reordered = encoder(chunk_texts(tokenizer, TEXTS[::-1], **kwargs))
        alone = torch.cat([encoder(chunk_texts(tokenizer, [text], **kwargs)) for text in TEXTS])
    torch.testing.assert_close(together, alone, rtol=0, atol=1e-5)
    torch.testing.assert_close(reordered.flip(0), alone, rtol=0, atol=1e-5)
    assert (alone[0] - alone[2]).norm() > 1e-2  # the texts do get different vectors


def test_transformer_over_chunks_equals_pytorch_by_hand():
    """group_chunks, chunk positions, the padding mask and the mean over real chunks, against
    nn.TransformerEncoderLayer (with the same weights) and a padded batch built here."""
    torch.manual_seed(1)
    bert = BertModel(BertConfig.from_name("tiny"))
    encoder = HierarchicalEncoder(bert, num_layers=2, num_heads=4, ffn_dim=48, dropout=0.0)
    layers = [
        nn.TransformerEncoderLayer(32, 4, 48, dropout=0.0, activation="gelu", batch_first=True)
        for _ in range(2)
    ]
    for block, layer in zip(encoder.blocks, layers, strict=True):
        block.load_state_dict(EncoderBlock.from_torch(layer).state_dict())
    with torch.no_grad():
        encoder.chunk_position.weight.normal_()  # large enough to matter
    counts = [2, 5, 1]
    windows = Windows(
        torch.ones(8, 4, dtype=torch.long),
        torch.ones(8, 4, dtype=torch.long),
        torch.tensor([i for i, n in enumerate(counts) for _ in range(n)]),
        3,
    )
    chunks = torch.randn(8, 32)
    padded = torch.zeros(3, 5, 32)
    padding = torch.ones(3, 5, dtype=torch.bool)  # PyTorch's polarity: True = padding
    starts = [0, 2, 7]
    for text, (start, n) in enumerate(zip(starts, counts, strict=True)):
        padded[text, :n] = chunks[start : start + n]
        padding[text, :n] = False
    with torch.no_grad():
        x = padded + encoder.chunk_position.weight[:5]
        x = F.layer_norm(x, (32,), encoder.norm.weight, encoder.norm.bias, eps=1e-12)
        for layer in layers:
            x = layer.eval()(x, src_key_padding_mask=padding)
        want = torch.stack([x[text, :n].mean(dim=0) for text, n in enumerate(counts)])
        got = encoder.eval().encode_chunks(chunks, windows)
        grouped, mask = group_chunks(chunks, windows)
    assert torch.equal(grouped, padded) and torch.equal(mask, ~padding)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_training_lowers_the_loss_and_leaves_the_frozen_encoder_alone(minilm, tokenizer):
    """A few AdamW steps on six short texts of two pydoc groups (the real MiniLM, frozen)."""
    segments = topic_segments()
    texts = segments["statements"][:3] + segments["data model"][:3]
    labels = torch.tensor([0, 0, 0, 1, 1, 1])
    windows = chunk_texts(tokenizer, texts, max_length=32, stride=0)
    torch.manual_seed(0)
    classifier = HierarchicalClassifier(HierarchicalEncoder(minilm, num_layers=1), 2)
    before = {k: v.clone() for k, v in minilm.state_dict().items()}
    chunks = classifier.encoder.embed_chunks(windows)  # frozen: computed once, no graph
    assert not chunks.requires_grad
    trained = [p for p in classifier.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=1e-3)
    classifier.train()
    assert not minilm.training  # a frozen chunk encoder stays in eval mode
    losses = []
    for _ in range(8):
        loss = F.cross_entropy(classifier.classify_chunks(chunks, windows), labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], losses
    assert all(torch.equal(v, minilm.state_dict()[k]) for k, v in before.items())
    assert all(p.grad is None for p in minilm.parameters())
    classifier.eval()
    with torch.no_grad():
        end_to_end = classifier(windows)
    torch.testing.assert_close(end_to_end, classifier.classify_chunks(chunks, windows))


def test_an_unfrozen_chunk_encoder_is_trained_too():
    bert = BertModel(BertConfig.from_name("tiny"))
    encoder = HierarchicalEncoder(bert, num_layers=1, num_heads=4, freeze_chunk_encoder=False)
    windows = chunk_batch(
        [list(range(5, 40)), list(range(40, 45))],
        max_length=10,
        stride=2,
        cls_id=1,
        sep_id=2,
        pad_id=0,
    )
    encoder.train()
    assert bert.training
    encoder(windows).square().sum().backward()
    grad = bert.embeddings.token_embedding.weight.grad
    assert grad is not None and grad.abs().sum() > 0


def test_documents_are_long_labelled_by_their_majority_and_deterministic(tokenizer):
    documents = pydoc_topic_documents()  # the defaults the module's docstring describes
    assert len(documents.train) == 480 and len(documents.test) == 240
    assert documents.labels == tuple(TOPIC_GROUPS)
    pools = {g: set(s) for g, s in zip(range(5), topic_segments().values(), strict=True)}
    for document in documents.test[:60]:
        parts = document.text.split("\n\n")
        assert all(p in pools[g] for p, g in zip(parts, document.segment_groups, strict=True))
        assert [len(p.split()) for p in parts] == list(document.segment_words)
        shares = [document.group_words(group) / document.num_words for group in range(5)]
        assert shares[document.label] >= 0.6 and shares.index(max(shares)) == document.label
    for split in (documents.train, documents.test):
        assert [sum(d.label == g for d in split) for g in range(5)] == [len(split) // 5] * 5
        # the label is spread over the document: often not the group of its first segment
        assert sum(d.segment_groups[0] != d.label for d in split) > 0.25 * len(split)
    encodings = tokenizer.encode_batch([d.text for d in documents.test])
    lengths = sorted(len(e.ids) for e in encodings)
    assert sum(n > 512 for n in lengths) > 0.6 * len(lengths)  # "most documents"
    assert lengths[len(lengths) // 2] > 512 and lengths[-1] > 1500
    train_parts = {p for d in documents.train for p in d.text.split("\n\n")}
    assert not train_parts & {p for d in documents.test for p in d.text.split("\n\n")}
    again = pydoc_topic_documents(num_train=20, num_test=10, seed=3)
    assert again == pydoc_topic_documents(num_train=20, num_test=10, seed=3)
    assert again.train != pydoc_topic_documents(num_train=20, num_test=10, seed=4).train


def test_errors_name_the_argument(minilm, windows):
    with pytest.raises(TypeError, match="chunk_encoder: expected a qkv BertModel"):
        HierarchicalEncoder(nn.Linear(2, 2))
    with pytest.raises(ValueError, match=r"chunk_pooling: expected one of \('cls', 'mean'\)"):
        HierarchicalEncoder(minilm, chunk_pooling="max")
    with pytest.raises(ValueError, match="document_pooling: expected one of"):
        HierarchicalEncoder(minilm, document_pooling="first")
    with pytest.raises(TypeError, match="freeze_chunk_encoder: expected a bool"):
        HierarchicalEncoder(minilm, freeze_chunk_encoder=1)
    with pytest.raises(ValueError, match="max_chunks"):
        HierarchicalEncoder(minilm, max_chunks=0)
    encoder = HierarchicalEncoder(minilm, num_layers=1, max_chunks=4)
    with pytest.raises(ValueError, match="windows: a text has 5 windows; expected at most"):
        encoder.encode_chunks(torch.zeros(7, 384), windows)
    with pytest.raises(ValueError, match=r"chunks: expected a \(7, 384\) tensor"):
        encoder.encode_chunks(torch.zeros(7, 100), windows)
    with pytest.raises(TypeError, match="windows: expected a Windows batch"):
        encoder.embed_chunks(windows.input_ids)
    with pytest.raises(ValueError, match="batch_size"):
        encoder.embed_chunks(windows, batch_size=0)
    with pytest.raises(ValueError, match="num_labels"):
        HierarchicalClassifier(encoder, 0)
    with pytest.raises(TypeError, match="encoder: expected a HierarchicalEncoder"):
        HierarchicalClassifier(minilm, 2)
    with pytest.raises(ValueError, match=r"label_share: expected a float in \(0.5, 1\], got 0.5"):
        pydoc_topic_documents(label_share=0.5)
    with pytest.raises(ValueError, match="max_words: expected an int >= 150, got 100"):
        pydoc_topic_documents(max_words=100)
    with pytest.raises(TypeError, match="num_train"):
        pydoc_topic_documents(num_train=2.0)
