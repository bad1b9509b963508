"""The parameter count `qkv.models.sizes` computes from a config, before any allocation,
equals the count of the model PyTorch actually builds (tied matrices once), for every family
and the options that change shapes; and a model past the memory given is refused by name."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from qkv.models import GPT, BertModel, Transformer, ViT, ViTConfig
from qkv.models.bert import BertConfig
from qkv.models.bert_heads import BertForSequenceClassification
from qkv.models.encoder_decoder_config import TransformerConfig
from qkv.models.gpt_config import GPTConfig
from qkv.models.sizes import SizePart, check_model_fits, parameter_count

GPT_BASE = GPTConfig(vocab_size=97, embed_dim=32, num_layers=2, num_heads=4, ffn_dim=48)
GPTS = [
    GPT_BASE,
    dataclasses.replace(GPT_BASE, num_kv_heads=2, tie_embeddings=True),
    dataclasses.replace(GPT_BASE, position="learned", norm="layernorm", ffn="gelu_tanh",
                        bias=True, max_positions=64),
    dataclasses.replace(GPT_BASE, norm="layernorm", bias=False, num_kv_heads=1),
]  # fmt: skip
BERT_BASE = BertConfig(
    vocab_size=97, embed_dim=32, num_layers=3, num_heads=4, ffn_dim=48, max_positions=64
)
TRANSFORMER_BASE = TransformerConfig.from_name("transformer-tiny")
CASES = [
    *((config, GPT) for config in GPTS),
    (BERT_BASE, BertModel),
    (dataclasses.replace(BERT_BASE, share_layers=True), BertModel),
    *(
        (dataclasses.replace(TRANSFORMER_BASE, share_embeddings=share, tie_output=tie), Transformer)
        for share, tie in ((False, False), (False, True), (True, True))
    ),
    *(
        (ViTConfig.from_name("vit-tiny", **options), ViT)
        for options in (
            {},
            {"pooling": "mean", "position": "sinusoidal2d"},
            {"pooling": "latent", "num_latents": 3, "latent_blocks": 2},
        )
    ),  # fmt: skip
]


def _built_count(model: torch.nn.Module) -> int:
    return sum(parameter.numel() for parameter in model.parameters())  # ties counted once


@pytest.mark.parametrize(("config", "model_class"), CASES)
def test_the_count_from_the_config_is_the_built_models(config, model_class):
    torch.manual_seed(0)
    assert parameter_count(config) == _built_count(model_class(config))


def test_a_model_past_the_memory_is_refused_naming_what_makes_it_large():
    with pytest.raises(ValueError, match=r"num_layers=2 blocks .*more than the 0\.0 GiB"):
        check_model_fits(GPT_BASE, memory=1000)
    check_model_fits(GPT_BASE, memory=10**9)  # fits: no error
    huge = dataclasses.replace(GPT_BASE, vocab_size=10**12)
    with pytest.raises(ValueError, match=r"^vocab_size=1000000000000 token embedding"):
        GPT(huge)


def test_a_classifier_counts_its_labels_before_allocating_them():
    classifier = SizePart("num_labels=10 classifier", 10 * 33)
    check_model_fits(BERT_BASE, extra=(classifier,), memory=10**9)
    with pytest.raises(ValueError, match=r"^num_labels=1000000000000 classifier"):
        BertForSequenceClassification(BERT_BASE, num_labels=10**12)


@pytest.mark.parametrize("conditioning", ["adaln_zero", "add"])
@pytest.mark.parametrize(("embed_dim", "ffn_dim", "text_layers"), [(64, 256, 0), (16, 32, 2)])
def test_the_diffusion_bound_holds_the_built_model_and_at_most_doubles_it(
    conditioning, embed_dim, ffn_dim, text_layers
):
    """The diffusion model is bounded, not counted (its blocks differ by conditioning): at
    least the built model's parameters, at most twice them."""
    from qkv.models import DiffusionTransformer
    from qkv.models.diffusion_config import DiffusionConfig

    config = DiffusionConfig.from_name(
        "diffusion-digits", conditioning=conditioning, embed_dim=embed_dim, ffn_dim=ffn_dim,
        text_layers=text_layers,
    )  # fmt: skip
    built = sum(p.numel() for p in DiffusionTransformer(config).parameters())
    assert built <= parameter_count(config) <= 2 * built


@pytest.mark.parametrize(
    ("field", "value", "named"),
    [
        ("num_timesteps", 10**9, "num_timesteps=1000000000 schedule and time table"),
        ("text_layers", 10**9, "text_layers=1000000000 prompt blocks"),
        ("embed_dim", 2**20, "num_layers=1 blocks (embed_dim=1048576"),
    ],
)
def test_a_diffusion_model_past_the_memory_is_refused_before_allocating(field, value, named):
    from qkv.models import DiffusionTransformer
    from qkv.models.diffusion_config import DiffusionConfig

    config = DiffusionConfig.from_name("diffusion-tiny", **{field: value})
    with pytest.raises(ValueError, match=rf"^{re.escape(named)}.*: the model would need ~"):
        DiffusionTransformer(config)
