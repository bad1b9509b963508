"""Bad checkpoints fail with one CheckpointError that says what is wrong, and nothing is loaded
half-way: the target model's parameters are exactly what they were.

The checkpoints are written by transformers (a BertModel from a small config, seed 0) and then
damaged: a tensor removed, a tensor of the wrong shape, an unknown architecture, a file cut
short, a config.json that describes another model.
"""

import json

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from qkv.models.bert import BertConfig, BertModel
from qkv.models.checkpoints import CheckpointError, from_pretrained
from qkv.models.checkpoints.bert import key_map
from qkv.models.checkpoints.core import load_into
from qkv.models.checkpoints.weight_files import read_weights

HF_SIZES = dict(
    vocab_size=128,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=64,
    max_position_embeddings=64,
)


@pytest.fixture
def checkpoint(tmp_path):
    torch.manual_seed(0)
    transformers.BertModel(transformers.BertConfig(**HF_SIZES)).save_pretrained(tmp_path)
    return tmp_path


@pytest.fixture
def target():
    """A qkv model of the checkpoint's sizes, with weights unlike the checkpoint's."""
    torch.manual_seed(1)
    return BertModel(BertConfig.from_name("tiny"))


def snapshot(model):
    return {k: t.clone() for k, t in model.state_dict().items()}


def assert_unchanged(model, before):
    after = model.state_dict()
    assert after.keys() == before.keys()
    for key, tensor in before.items():
        assert torch.equal(after[key], tensor), key


def rewrite(path, change):
    file = path / "model.safetensors"
    tensors = load_file(file)
    change(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


def load(model, path):
    load_into(model, read_weights(path), key_map(model))


def test_a_good_checkpoint_loads(checkpoint, target):
    """The control: the same path without damage loads, and changes the weights."""
    before = snapshot(target)
    load(target, checkpoint)
    assert not torch.equal(target.pooler.weight, before["pooler.weight"])


def test_missing_tensor(checkpoint, target):
    rewrite(checkpoint, lambda t: t.pop("encoder.layer.1.attention.output.LayerNorm.weight"))
    before = snapshot(target)
    with pytest.raises(CheckpointError) as error:
        load(target, checkpoint)
    message = str(error.value)
    assert "missing (1)" in message
    assert "layers.1.norm1.weight" in message
    assert "encoder.layer.1.attention.output.LayerNorm.weight" in message
    assert_unchanged(target, before)


def test_wrong_shape(checkpoint, target):
    def truncate_ffn(tensors):
        tensors["encoder.layer.0.intermediate.dense.weight"] = torch.zeros(48, 32)

    rewrite(checkpoint, truncate_ffn)
    before = snapshot(target)
    with pytest.raises(CheckpointError, match=r"mis-shaped \(1\)") as error:
        load(target, checkpoint)
    assert "layers.0.ffn.up_proj.weight: checkpoint (48, 32), model (64, 32)" in str(error.value)
    assert_unchanged(target, before)


def test_unexpected_tensor(checkpoint, target):
    rewrite(checkpoint, lambda t: t.update({"encoder.layer.7.output.dense.weight": torch.ones(1)}))
    before = snapshot(target)
    with pytest.raises(CheckpointError, match=r"unexpected \(1\):\s+encoder\.layer\.7\.output"):
        load(target, checkpoint)
    assert_unchanged(target, before)


def test_truncated_safetensors_file(checkpoint, target):
    file = checkpoint / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2])
    before = snapshot(target)
    with pytest.raises(CheckpointError, match=r"model\.safetensors is not a readable safetensors"):
        load(target, checkpoint)
    with pytest.raises(CheckpointError, match=r"not a readable safetensors"):
        BertModel.from_pretrained(checkpoint)
    assert_unchanged(target, before)


def edit_config(path, **fields):
    config_file = path / "config.json"
    config = json.loads(config_file.read_text())
    config.update(fields)
    config_file.write_text(json.dumps(config))


def test_unknown_architecture(checkpoint):
    edit_config(checkpoint, architectures=["BertForQuestionAnswering"])
    with pytest.raises(
        CheckpointError, match=r"declares architectures \['BertForQuestionAnswering'\]"
    ):
        from_pretrained(checkpoint)


def test_another_model_family_is_refused_by_bert(checkpoint):
    edit_config(checkpoint, architectures=["GPT2LMHeadModel"], model_type="gpt2")
    with pytest.raises(
        CheckpointError, match=r"config.json: model_type is 'gpt2'; qkv's BERT expects 'bert'"
    ):
        BertModel.from_pretrained(checkpoint)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"hidden_act": "relu"}, r"hidden_act is 'relu'; qkv computes \['gelu', 'gelu_python'\]"),
        ({"is_decoder": True}, r"is_decoder is True; qkv's BERT expects False"),
        ({"hidden_size": 30}, r"config.json: hidden_size: 30 is not divisible by "),
    ],
)
def test_config_json_that_qkv_cannot_compute(checkpoint, fields, message):
    edit_config(checkpoint, **fields)
    with pytest.raises(CheckpointError, match=message):
        BertModel.from_pretrained(checkpoint)


def test_missing_files(tmp_path):
    with pytest.raises(CheckpointError, match=r"has no config.json"):
        BertModel.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"is not valid JSON"):
        BertModel.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(
        CheckpointError, match=r"has no model\.safetensors, .* or pytorch_model\.bin"
    ):
        BertModel.from_pretrained(tmp_path)


def test_classifier_from_a_checkpoint_without_its_head(checkpoint):
    """Fine-tuning starts from an encoder checkpoint; qkv refuses to invent the head silently."""
    from qkv.models.bert_heads import BertForSequenceClassification

    with pytest.raises(CheckpointError, match=r"missing \(2\):\s+classifier.bias\s+classifier"):
        BertForSequenceClassification.from_pretrained(checkpoint)
