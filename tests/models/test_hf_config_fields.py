"""Every field qkv reads from a Hugging Face config.json, read as transformers 5 reads it: each
case builds one dict, gives it to transformers' own config class and to qkv's reader, and
compares what both resolve (defaults, aliases and which spelling wins, nulls), the warnings
transformers logs, and the refusals of what qkv does not compute, which name the field."""

from __future__ import annotations

import logging

import pytest
import transformers

from qkv.models.checkpoints import CheckpointError, bert, vit
from qkv.models.checkpoints.gpt2 import gpt_config_from_gpt2
from qkv.models.checkpoints.llama import gpt_config_from_llama
from qkv.models.checkpoints.t5 import t5_config_from_hf

LOGGERS = "qkv.models.checkpoints"
SMALL_LLAMA = {"vocab_size": 64, "hidden_size": 32, "num_attention_heads": 4}


def _gpt_sizes(ours) -> tuple:
    return (ours.vocab_size, ours.embed_dim, ours.num_heads, ours.num_layers, ours.max_positions)


@pytest.mark.parametrize(
    "config",
    [
        {"model_type": "gpt2"},  # every size absent: GPT2Config's defaults
        {"model_type": "gpt2", "hidden_size": 64, "num_attention_heads": 2, "n_layer": 3},
        {"model_type": "gpt2", "n_embd": 32, "hidden_size": 64, "n_head": 4,
         "num_attention_heads": 2, "n_positions": 10, "max_position_embeddings": 20},
        {"model_type": "gpt2", "n_embd": 32, "n_head": 4, "n_inner": None},
        {"model_type": "gpt2", "n_embd": 32, "n_head": 4, "n_inner": 40},
    ],
)  # fmt: skip
def test_gpt2_sizes_defaults_and_aliases(config, caplog):
    theirs = transformers.GPT2Config(**config)
    with caplog.at_level(logging.WARNING, logger=LOGGERS):
        ours = gpt_config_from_gpt2(config)
    want = (theirs.vocab_size, theirs.n_embd, theirs.n_head, theirs.n_layer, theirs.n_positions)
    assert _gpt_sizes(ours) == want
    assert ours.ffn_dim == (theirs.n_inner or 4 * theirs.n_embd)
    assert ours.norm_eps == theirs.layer_norm_epsilon and ours.tie_embeddings
    assert ("is used, as transformers reads them" in caplog.text) == ("n_positions" in config)


def test_gpt2_activation_names_and_refusals():
    config = {"model_type": "gpt2", "n_embd": 32, "n_head": 4}
    for name in ("gelu_new", "gelu_pytorch_tanh", "gelu_fast", "gelu_python_tanh"):
        assert gpt_config_from_gpt2(config | {"activation_function": name}).ffn == "gelu_tanh"
    with pytest.raises(CheckpointError, match=r"activation_function is 'relu'; qkv computes"):
        gpt_config_from_gpt2(config | {"activation_function": "relu"})
    with pytest.raises(CheckpointError, match=r"hidden_size is None \(NoneType\)"):
        gpt_config_from_gpt2(config | {"hidden_size": None})  # the alias wins, even null
    with pytest.raises(CheckpointError, match=r"missing \['vocab_size', 'n_embd'"):
        gpt_config_from_gpt2({"model_type": "bert", "hidden_size": 32})  # not said to be GPT-2


@pytest.mark.parametrize(
    ("cls", "config"),
    [
        (transformers.LlamaConfig, {"model_type": "llama"}),
        (transformers.LlamaConfig, {"model_type": "llama", **SMALL_LLAMA, "head_dim": None,
                                    "num_key_value_heads": None, "attention_dropout": None}),
        (transformers.MistralConfig, {"model_type": "mistral"}),
        (transformers.MistralConfig, {"model_type": "mistral", **SMALL_LLAMA,
                                      "num_attention_heads": 8, "sliding_window": None,
                                      "max_position_embeddings": 64}),
    ],
)  # fmt: skip
def test_llama_and_mistral_defaults(cls, config):
    theirs, ours = cls(**config), gpt_config_from_llama(config)
    want = (theirs.vocab_size, theirs.hidden_size, theirs.num_attention_heads)
    assert _gpt_sizes(ours) == (*want, theirs.num_hidden_layers, theirs.max_position_embeddings)
    assert ours.num_kv_heads == theirs.num_key_value_heads
    assert ours.head_dim == theirs.head_dim and ours.ffn_dim == theirs.intermediate_size
    assert ours.sliding_window == getattr(theirs, "sliding_window", None)
    assert ours.norm_eps == theirs.rms_norm_eps and ours.tie_embeddings is False
    assert ours.attention_dropout == (theirs.attention_dropout or 0.0)


def test_what_transformers_llama_and_mistral_ignore(caplog):
    with caplog.at_level(logging.WARNING, logger=LOGGERS):
        llama = gpt_config_from_llama({"model_type": "llama", **SMALL_LLAMA, "sliding_window": 8})
        mistral = gpt_config_from_llama(
            {"model_type": "mistral", **SMALL_LLAMA, "num_key_value_heads": 2,
             "attention_bias": True, "mlp_bias": True}
        )  # fmt: skip
    assert llama.sliding_window is None and "sliding_window=8 ignored" in caplog.text
    assert mistral.bias is False and "attention_bias / mlp_bias ignored" in caplog.text
    swish = gpt_config_from_llama({"model_type": "llama", **SMALL_LLAMA, "hidden_act": "swish"})
    assert swish.ffn == "swiglu"


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"hidden_act": "gelu"}, r"hidden_act is 'gelu'; qkv computes \['silu', 'swish'\]"),
        ({"head_dim": 16}, r"head_dim=16 \(qkv's GPT computes hidden_size // num_attention"),
        ({"mlp_bias": True}, r"mlp_bias=True with attention_bias=False"),
        ({"attention_bias": None}, r"attention_bias is None \(NoneType\); expected a bool"),
    ],
)
def test_llama_refusals_name_the_field(fields, message):
    with pytest.raises(CheckpointError, match=message):
        gpt_config_from_llama({"model_type": "llama", **SMALL_LLAMA, **fields})


@pytest.mark.parametrize(
    "config",
    [
        {},
        {"d_model": 32, "hidden_size": 64, "d_kv": 8, "head_dim": 4, "num_heads": 2,
         "num_attention_heads": 4, "num_layers": 1, "num_hidden_layers": 2},
        {"num_layers": 3, "num_decoder_layers": None, "tie_word_embeddings": None},
        {"tie_word_embeddings": False},
        {"tie_word_embeddings": False, "scale_decoder_outputs": True},
        {"feed_forward_proj": "gated-gelu"},
        {"feed_forward_proj": "gated-gelu_new"},
        {"feed_forward_proj": "gated-gelu_pytorch_tanh", "eos_token_id": [1]},
    ],
)  # fmt: skip
def test_t5_defaults_aliases_and_feed_forward(config):
    theirs, ours = transformers.T5Config(**config), t5_config_from_hf(config)
    assert (ours.vocab_size, ours.d_model, ours.d_kv, ours.d_ff) == (
        theirs.vocab_size, theirs.d_model, theirs.d_kv, theirs.d_ff
    )  # fmt: skip
    assert (ours.num_heads, ours.num_layers, ours.num_decoder_layers) == (
        theirs.num_heads, theirs.num_layers, theirs.num_decoder_layers
    )  # fmt: skip
    assert ours.relative_attention_max_distance == theirs.relative_attention_max_distance
    assert ours.tie_word_embeddings == theirs.scale_decoder_outputs  # qkv: tied and scaled
    gated = ours.feed_forward_proj == "gated-gelu"
    assert gated == theirs.is_gated_act
    assert theirs.dense_act_fn in (("gelu_new", "gelu_pytorch_tanh") if gated else ("relu",))


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("gelu", r"feed_forward_proj is 'gelu'; qkv computes 'relu'"),
        ("gated-silu", r"feed_forward_proj is 'gated-silu'; qkv computes"),
        ("a-b", r"feed_forward_proj is 'a-b'; expected '\{ACT_FN\}' or 'gated-\{ACT_FN\}'"),
    ],
)
def test_t5_feed_forward_refusals(value, message):
    if value == "a-b":  # transformers refuses it too
        with pytest.raises(Exception, match="is not a valid activation function"):
            transformers.T5Config(feed_forward_proj=value)
    with pytest.raises(CheckpointError, match=message):
        t5_config_from_hf({"feed_forward_proj": value})


def test_bert_accepts_what_transformers_5_reads(caplog):
    config = {"hidden_size": 32, "num_attention_heads": 4, "intermediate_size": 64,
              "position_embedding_type": "relative_key", "tie_word_embeddings": False}  # fmt: skip
    theirs = transformers.BertConfig(**config)
    with caplog.at_level(logging.WARNING, logger=LOGGERS):
        ours = bert.config_from_hf(config)  # no model_type, no decoder to tie
    assert (ours.embed_dim, ours.num_heads, ours.ffn_dim, ours.type_vocab_size) == (
        theirs.hidden_size, theirs.num_attention_heads, theirs.intermediate_size,
        theirs.type_vocab_size,
    )  # fmt: skip
    assert ours.norm_eps == theirs.layer_norm_eps and ours.pad_token_id == theirs.pad_token_id
    assert "position_embedding_type='relative_key' ignored" in caplog.text
    with pytest.raises(CheckpointError, match="tie_word_embeddings is False; qkv's BertForPre"):
        bert.config_from_hf(config, tied_decoder=True)
    with pytest.raises(CheckpointError, match=r"type_vocab_size is None \(NoneType\)"):
        bert.config_from_hf(config | {"type_vocab_size": None})


@pytest.mark.parametrize(
    "labels",
    [
        {},
        {"num_labels": 5},
        {"id2label": {"0": "a", "1": "b", "2": "c"}},
        {"id2label": {"0": "a", "1": "b", "2": "c"}, "num_labels": 3},
        {"id2label": {"0": "a", "1": "b", "2": "c"}, "num_labels": 2},
    ],
)
def test_labels_follow_transformers(labels, caplog):
    theirs = transformers.BertConfig(**labels)
    names = [theirs.id2label[i] for i in range(theirs.num_labels)]
    with caplog.at_level(logging.WARNING, logger=LOGGERS):
        count, ours = bert.fields.labels(labels)
    assert count == theirs.num_labels and (ours or [f"LABEL_{i}" for i in range(count)]) == names
    assert ("does not match" in caplog.text) == (labels.get("num_labels") == 2)
    vit_config = {"hidden_size": 32, "num_attention_heads": 4, **labels}
    assert vit.config_from_hf(vit_config).num_classes == theirs.num_labels


@pytest.mark.parametrize(
    ("fields", "want"),
    [
        ({"image_size": [32, 32], "patch_size": [8, 8]}, {"image_size": 32, "patch_size": 8}),
        ({"hidden_act": "gelu_new"}, {"activation": "gelu_tanh"}),
        ({"hidden_act": "relu"}, {"activation": "relu"}),
        ({}, {"image_size": 224, "patch_size": 16, "activation": "gelu", "norm_eps": 1e-12}),
    ],
)
def test_vit_fields(fields, want):
    config = {"hidden_size": 32, "num_attention_heads": 4, "intermediate_size": 64, **fields}
    theirs, ours = transformers.ViTConfig(**config), vit.config_from_hf(config)
    assert {key: getattr(ours, key) for key in want} == want
    side = theirs.image_size
    assert ours.image_size == (side[0] if isinstance(side, list) else side)
    with pytest.raises(CheckpointError, match=r"image_size is \[32, 16\]; qkv's ViT takes"):
        vit.config_from_hf(config | {"image_size": [32, 16]})
