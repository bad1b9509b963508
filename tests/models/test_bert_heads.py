"""BertForPreTraining and BertForSequenceClassification against transformers' models of the same
names: built from a small config with a fixed seed, saved with save_pretrained, loaded by qkv
(and the other way round: qkv saves, transformers loads)."""

import json

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from qkv.models.bert import BertConfig, BertModel
from qkv.models.bert_heads import BertForPreTraining, BertForSequenceClassification

HF_CONFIG = dict(
    vocab_size=99,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=37,
    max_position_embeddings=40,
    type_vocab_size=2,
)


def randomise(model: torch.nn.Module) -> torch.nn.Module:
    """Every parameter drawn from N(0, 0.3^2). BERT's own init sets biases to 0 and LayerNorms
    to (1, 0), under which a swapped bias or norm in a key map would go unnoticed."""
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(0.0, 0.3)
    return model.eval()


def hf_model(cls, **extra):
    torch.manual_seed(0)
    return randomise(cls(transformers.BertConfig(**HF_CONFIG, **extra)))


@pytest.fixture(scope="module")
def batch():
    """A padded batch of sentence pairs: lengths 12, 7, 4; segment 1 from position 5 on."""
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 99, (3, 12), generator=generator)
    mask = (torch.arange(12)[None, :] < torch.tensor([12, 7, 4])[:, None]).long()  # (B, L)
    ids = ids.masked_fill(mask == 0, 0)
    segments = (torch.arange(12)[None, :] >= 5).long() * mask  # (B, L)
    return ids, mask, segments


def test_pretraining_logits_and_loss_match_transformers(tmp_path, batch):
    theirs = hf_model(transformers.BertForPreTraining)
    theirs.save_pretrained(tmp_path)
    ours = BertForPreTraining.from_pretrained(tmp_path)
    ids, mask, segments = batch
    generator = torch.Generator().manual_seed(2)
    labels = torch.randint(0, 99, ids.shape, generator=generator)
    labels = labels.masked_fill(torch.rand(ids.shape, generator=generator) > 0.3, -100)
    next_sentence = torch.tensor([0, 1, 1])
    with torch.no_grad():
        got = ours(ids, mask, segments, labels=labels, next_sentence_label=next_sentence)
        want = theirs(
            input_ids=ids,
            attention_mask=mask,
            token_type_ids=segments,
            labels=labels,
            next_sentence_label=next_sentence,
        )
    torch.testing.assert_close(got.logits, want.prediction_logits, rtol=0, atol=1e-5)
    torch.testing.assert_close(got.nsp_logits, want.seq_relationship_logits, rtol=0, atol=1e-5)
    torch.testing.assert_close(got.loss, want.loss, rtol=1e-6, atol=1e-6)
    # scoring only the selected positions gives the same numbers there, and the same loss
    selected = labels != -100
    with torch.no_grad():
        only = ours(ids, mask, segments, labels=labels, next_sentence_label=next_sentence,
                    masked_positions=selected)  # fmt: skip
    torch.testing.assert_close(only.logits, want.prediction_logits[selected], rtol=0, atol=1e-5)
    torch.testing.assert_close(only.loss, want.loss, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="masked_positions"):
        ours(ids, mask, segments, masked_positions=selected.long())


def test_mlm_decoder_is_tied_to_the_token_embeddings(tmp_path, batch):
    """Same parameter count as transformers (which counts a tied matrix once), and a change to
    the input embeddings changes the MLM logits exactly as it does in transformers."""
    theirs = hf_model(transformers.BertForPreTraining)
    theirs.save_pretrained(tmp_path)
    ours = BertForPreTraining.from_pretrained(tmp_path)
    assert sum(p.numel() for p in ours.parameters()) == theirs.num_parameters()
    with torch.no_grad():
        ours.bert.embeddings.token_embedding.weight[5:9] += 1.0
        theirs.bert.embeddings.word_embeddings.weight[5:9] += 1.0
        ids, mask, segments = batch
        got = ours(ids, mask, segments).logits
        want = theirs(input_ids=ids, attention_mask=mask, token_type_ids=segments)
    torch.testing.assert_close(got, want.prediction_logits, rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    ("num_labels", "labels"),
    [
        (3, torch.tensor([0, 2, 1])),  # single-label: cross-entropy
        (1, torch.tensor([0.5, -1.0, 2.0])),  # regression: mean squared error
        (2, torch.tensor([[1.0, 0.0], [1.0, 1.0], [0.0, 0.0]])),  # multi-label: BCE
    ],
)
def test_classification_matches_transformers(tmp_path, batch, num_labels, labels):
    theirs = hf_model(transformers.BertForSequenceClassification, num_labels=num_labels)
    theirs.save_pretrained(tmp_path)
    ours = BertForSequenceClassification.from_pretrained(tmp_path)
    assert ours.num_labels == num_labels
    ids, mask, segments = batch
    with torch.no_grad():
        got = ours(ids, mask, segments, labels=labels)
        want = theirs(input_ids=ids, attention_mask=mask, token_type_ids=segments, labels=labels)
    torch.testing.assert_close(got.logits, want.logits, rtol=0, atol=1e-5)
    torch.testing.assert_close(got.loss, want.loss, rtol=1e-6, atol=1e-6)


def _qkv_model(cls, **kwargs):
    torch.manual_seed(0)
    return randomise(cls(BertConfig.from_name("tiny"), **kwargs))


@pytest.mark.parametrize(
    ("qkv_class", "hf_class", "kwargs"),
    [
        (BertModel, transformers.BertModel, {}),
        (BertForPreTraining, transformers.BertForPreTraining, {}),
        (
            BertForSequenceClassification,
            transformers.BertForSequenceClassification,
            {"num_labels": 3, "label_names": ["negative", "neutral", "positive"]},
        ),
    ],
)
def test_qkv_checkpoints_load_in_transformers(tmp_path, batch, qkv_class, hf_class, kwargs):
    ours = _qkv_model(qkv_class, **kwargs)
    ours.save_pretrained(tmp_path)
    theirs, info = hf_class.from_pretrained(tmp_path, output_loading_info=True)
    assert info == {
        "missing_keys": set(),
        "unexpected_keys": set(),
        "mismatched_keys": set(),
        "error_msgs": [],
    }
    ids, mask, segments = batch
    with torch.no_grad():
        got = ours(ids, mask, segments)
        want = theirs.eval()(input_ids=ids, attention_mask=mask, token_type_ids=segments)
    if qkv_class is BertModel:
        pairs = [(got.last_hidden_state, want.last_hidden_state)]
        pairs.append((got.pooler_output, want.pooler_output))
    elif qkv_class is BertForPreTraining:
        pairs = [(got.logits, want.prediction_logits)]
        pairs.append((got.nsp_logits, want.seq_relationship_logits))
    else:
        pairs = [(got.logits, want.logits)]
        assert theirs.config.id2label == {0: "negative", 1: "neutral", 2: "positive"}
    for mine, reference in pairs:
        torch.testing.assert_close(mine, reference, rtol=0, atol=1e-5)
    reloaded = qkv_class.from_pretrained(tmp_path)
    assert getattr(reloaded, "label_names", None) == getattr(ours, "label_names", None)


def test_bert_model_loads_the_encoder_of_a_checkpoint_with_heads(tmp_path, batch):
    """As transformers' BertModel.from_pretrained does: the `bert.` prefix is stripped and the
    heads are left out."""
    hf_model(transformers.BertForPreTraining).save_pretrained(tmp_path)
    ours = BertModel.from_pretrained(tmp_path)
    theirs = transformers.BertModel.from_pretrained(tmp_path).eval()
    ids, mask, segments = batch
    with torch.no_grad():
        got = ours(ids, mask, segments).last_hidden_state
        want = theirs(input_ids=ids, attention_mask=mask, token_type_ids=segments)
    torch.testing.assert_close(got, want.last_hidden_state, rtol=0, atol=1e-5)


def test_legacy_checkpoint_names_load_as_transformers_loads_them(tmp_path, batch):
    """Old checkpoints: LayerNorm.gamma/beta, and the tied copies cls.predictions.decoder.*."""
    theirs = hf_model(transformers.BertForPreTraining)
    theirs.save_pretrained(tmp_path)
    file = tmp_path / "model.safetensors"
    tensors = load_file(file)
    legacy = {
        k.replace("LayerNorm.weight", "LayerNorm.gamma").replace(
            "LayerNorm.bias", "LayerNorm.beta"
        ): t
        for k, t in tensors.items()
    }
    legacy["cls.predictions.decoder.weight"] = tensors["bert.embeddings.word_embeddings.weight"]
    legacy["cls.predictions.decoder.bias"] = tensors["cls.predictions.bias"]
    legacy["bert.embeddings.position_ids"] = torch.arange(40)[None, :]
    save_file({k: t.clone() for k, t in legacy.items()}, file, metadata={"format": "pt"})
    reference = transformers.BertForPreTraining.from_pretrained(tmp_path).eval()
    ours = BertForPreTraining.from_pretrained(tmp_path)
    ids, mask, segments = batch
    with torch.no_grad():
        got = ours(ids, mask, segments).logits
        want = reference(input_ids=ids, attention_mask=mask, token_type_ids=segments)
    torch.testing.assert_close(got, want.prediction_logits, rtol=0, atol=1e-5)


def test_config_json_round_trips_through_transformers(tmp_path):
    """qkv's config.json is read by transformers' BertConfig with the same sizes."""
    config = BertConfig.from_name("tiny", norm_eps=1e-7, dropout=0.2, attention_dropout=0.05)
    BertModel(config).save_pretrained(tmp_path)
    theirs = transformers.BertConfig.from_pretrained(tmp_path)
    assert (theirs.vocab_size, theirs.hidden_size, theirs.num_hidden_layers) == (128, 32, 2)
    assert (theirs.num_attention_heads, theirs.intermediate_size) == (4, 64)
    assert (theirs.max_position_embeddings, theirs.type_vocab_size) == (64, 2)
    assert theirs.layer_norm_eps == 1e-7 and theirs.hidden_dropout_prob == 0.2
    assert theirs.attention_probs_dropout_prob == 0.05 and theirs.hidden_act == "gelu"
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == ["BertModel"]
