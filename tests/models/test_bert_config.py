"""BertConfig presets against transformers' own numbers, and the errors of bad configs and inputs:
each names the argument, the value seen and the value expected."""

import dataclasses

import pytest
import torch
import transformers

from qkv.models.bert import BertConfig, BertModel, mean_pool
from qkv.models.bert_heads import BertForPreTraining, BertForSequenceClassification
from qkv.models.checkpoints.bert import config_from_hf


@pytest.mark.parametrize(
    ("name", "hf_sizes", "parameters"),
    [
        # transformers' BertConfig() defaults are bert-base-uncased; 109,482,240 parameters
        # is BERT-base with its pooler, as transformers counts it
        ("bert-base-uncased", {}, 109_482_240),
        (
            "bert-large-uncased",
            dict(
                hidden_size=1024,
                num_hidden_layers=24,
                num_attention_heads=16,
                intermediate_size=4096,
            ),
            335_141_888,
        ),
    ],
)
def test_presets_match_transformers(name, hf_sizes, parameters):
    hf_config = transformers.BertConfig(**hf_sizes)
    assert BertConfig.from_name(name) == config_from_hf(hf_config.to_dict())
    with torch.device("meta"):  # shapes only: no memory, no time
        ours = BertModel(BertConfig.from_name(name))
        theirs = transformers.BertModel(hf_config)
    assert sum(p.numel() for p in ours.parameters()) == theirs.num_parameters() == parameters


def test_tiny_preset_and_overrides():
    tiny = BertConfig.from_name("tiny", num_layers=3)
    assert (tiny.embed_dim, tiny.num_layers, tiny.head_dim) == (32, 3, 8)
    with pytest.raises(dataclasses.FrozenInstanceError):
        tiny.num_layers = 4


@pytest.mark.parametrize(
    ("fields", "error", "message"),
    [
        (
            {"embed_dim": 30, "num_heads": 4},
            ValueError,
            r"embed_dim: 30 is not divisible by num_heads=4",
        ),
        ({"num_layers": 0}, ValueError, r"num_layers: expected a positive int, got 0"),
        ({"vocab_size": 12.5}, TypeError, r"vocab_size: expected a positive int, got float"),
        ({"dropout": 1.5}, ValueError, r"dropout: expected a probability in \[0, 1\), got 1.5"),
        ({"attention_dropout": -0.1}, ValueError, r"attention_dropout: expected a probability"),
        ({"norm_eps": 0.0}, ValueError, r"norm_eps: expected a positive float, got 0.0"),
        (
            {"pad_token_id": 30522},
            ValueError,
            r"pad_token_id: expected None or an id in \[0, 30522\), got 30522",
        ),
        ({"share_layers": 1}, TypeError, r"share_layers: expected a bool, got int 1"),
    ],
)
def test_bad_config_fields(fields, error, message):
    with pytest.raises(error, match=message):
        BertConfig(**fields)


def test_bad_preset_name_and_override():
    with pytest.raises(
        ValueError, match=r"name: unknown preset 'bert-huge'; expected one of \[.*'bert-base"
    ):
        BertConfig.from_name("bert-huge")
    with pytest.raises(TypeError, match=r"overrides: unknown fields \['hidden_size'\]"):
        BertConfig.from_name("tiny", hidden_size=64)


def test_models_refuse_what_is_not_a_bert_config():
    with pytest.raises(TypeError, match=r"config: expected a BertConfig, got dict"):
        BertModel({"embed_dim": 32})
    config = BertConfig.from_name("tiny")
    with pytest.raises(ValueError, match=r"num_labels: expected a positive int, got 0"):
        BertForSequenceClassification(config, 0)
    with pytest.raises(ValueError, match=r"label_names: expected 2 names"):
        BertForSequenceClassification(config, 2, label_names=["only one"])


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    return BertForPreTraining(BertConfig.from_name("tiny")).eval()


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (
            lambda m: m(torch.rand(2, 5)),
            TypeError,
            r"input_ids: expected an integer tensor, got dtype torch.float32",
        ),
        (
            lambda m: m([[1, 2]]),
            TypeError,
            r"input_ids: expected a torch.Tensor of token ids, got list",
        ),
        (
            lambda m: m(torch.ones(5, dtype=torch.long)),
            ValueError,
            r"input_ids: expected shape \(B, L\), got \(5,\)",
        ),
        (
            lambda m: m(torch.full((1, 3), 128)),
            ValueError,
            r"input_ids: expected values in \[0, 128\), got values in \[128, 128\]",
        ),
        (
            lambda m: m(torch.ones(1, 65, dtype=torch.long)),
            ValueError,
            r"input_ids: length 65 exceeds max_positions=64",
        ),
        (
            lambda m: m(torch.ones(2, 5, dtype=torch.long), torch.ones(2, 4)),
            ValueError,
            r"attention_mask: expected shape \(2, 5\) .*got a tensor of shape \(2, 4\)",
        ),
        (
            lambda m: m(torch.ones(2, 5, dtype=torch.long), None, torch.full((2, 5), 2)),
            ValueError,
            r"token_type_ids: expected values in \[0, 2\), got values in \[2, 2\]",
        ),
        (
            lambda m: m(
                torch.ones(2, 5, dtype=torch.long), labels=torch.ones(2, 4, dtype=torch.long)
            ),
            ValueError,
            r"labels: expected shape \(2, 5\), got \(2, 4\)",
        ),
        (
            lambda m: m(torch.ones(2, 5, dtype=torch.long), next_sentence_label=torch.ones(2)),
            TypeError,
            r"next_sentence_label: expected an integer tensor, got dtype torch.float32",
        ),
    ],
)
def test_bad_inputs_name_the_argument(tiny, call, error, message):
    with pytest.raises(error, match=message):
        call(tiny)


def test_bad_classification_labels():
    torch.manual_seed(0)
    model = BertForSequenceClassification(BertConfig.from_name("tiny"), 3).eval()
    ids = torch.ones(2, 5, dtype=torch.long)
    with pytest.raises(
        ValueError,
        match=r"labels: float labels are multi-label targets, expected shape \(2, 3\), got \(2,\)",
    ):
        model(ids, labels=torch.ones(2))
    with pytest.raises(ValueError, match=r"labels: expected shape \(2,\), got \(2, 1\)"):
        model(ids, labels=torch.ones(2, 1, dtype=torch.long))


def test_mean_pool_bad_shapes():
    with pytest.raises(
        ValueError,
        match=r"last_hidden_state: expected a tensor of shape \(B, L, E\), got a tensor of shape",
    ):
        mean_pool(torch.ones(2, 3))
    with pytest.raises(
        ValueError,
        match=r"attention_mask: expected shape \(2, 3\) \(B, L\), got a tensor of shape \(2, 4\)",
    ):
        mean_pool(torch.ones(2, 3, 4), torch.ones(2, 4))


def test_dropouts_sit_where_transformers_bert_puts_them():
    # transformers' BertLayer: attention probs at attention_probs_dropout_prob, sub-layer
    # outputs at hidden_dropout_prob, nothing between the FFN's two linears.
    config = BertConfig.from_name("tiny", dropout=0.1, attention_dropout=0.3)
    block = BertModel(config).layer(0)
    assert block.self_attn.dropout == 0.3
    assert block.dropout.p == 0.1
    # the FFN's inner dropout has p = 0: built as nn.Identity, so no nn.Dropout runs there
    assert not any(isinstance(m, torch.nn.Dropout) for m in block.ffn.modules())
    assert isinstance(block.ffn.dropout, torch.nn.Identity)
