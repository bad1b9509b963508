"""qkv.models.from_pretrained picks the class from config.json; save_pretrained picks the
architecture that fits; qkv's own save/load round-trips every model family."""

import json

import pytest
import torch
import transformers

import qkv.models as models
from tests.models.test_gpt_hf import _reference


@pytest.mark.parametrize(
    ("name", "architecture"),
    [("gpt2", "GPT2LMHeadModel"), ("llama-gqa", "LlamaForCausalLM"),
     ("mistral-window-4", "MistralForCausalLM")],
)  # fmt: skip
def test_generic_load_and_save_pick_the_right_architecture(tmp_path, name, architecture):
    _reference(name).save_pretrained(tmp_path / "hf")
    model = models.from_pretrained(tmp_path / "hf")
    assert type(model) is models.GPT
    models.save_pretrained(model, tmp_path / "qkv")
    written = json.loads((tmp_path / "qkv" / "config.json").read_text())
    assert written["architectures"] == [architecture]


def test_bert_checkpoint_becomes_the_class_it_names(tmp_path):
    config = transformers.BertConfig(
        vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=32, max_position_embeddings=16,
    )  # fmt: skip
    transformers.BertForPreTraining(config).save_pretrained(tmp_path)
    assert type(models.from_pretrained(tmp_path)) is models.BertForPreTraining
    assert type(models.BertModel.from_pretrained(tmp_path)) is models.BertModel  # heads dropped


@pytest.mark.parametrize(
    "model",
    [
        lambda: models.GPT(models.GPTConfig.from_name("tiny-llama")),
        lambda: models.BertForPreTraining(models.BertConfig.from_name("tiny")),
        lambda: models.Transformer(models.TransformerConfig.from_name("transformer-tiny")),
    ],
)
def test_qkv_checkpoints_round_trip_every_family(tmp_path, model):
    original = model().eval()
    models.save(original, tmp_path)
    loaded = models.load(tmp_path)
    assert type(loaded) is type(original) and loaded.config == original.config
    for key, tensor in original.state_dict().items():
        assert torch.equal(tensor, loaded.state_dict()[key]), key


def test_unknown_architecture_is_refused_by_name(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["T5Model"]}))
    with pytest.raises(models.CheckpointError, match=r"declares architectures \['T5Model'\]"):
        models.from_pretrained(tmp_path)
