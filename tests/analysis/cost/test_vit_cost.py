"""`qkv cost` for the Vision Transformer: parameters against the published ViT-B/16 (86M,
Dosovitskiy et al. 2021, Table 1), against Hugging Face's ViTForImageClassification built from
the same sizes and against qkv's own ViT; forward FLOPs against `FlopCounterMode` on both
models; a config.json transformers wrote; the command's column."""

from __future__ import annotations

import argparse
import json

import pytest
import torch
import transformers
from torch.utils.flop_counter import FlopCounterMode

from qkv.analysis.cost.estimate import cost_report
from qkv.commands import cost as cost_command
from qkv.layers import MultiHeadAttention
from qkv.models import ViT, ViTConfig, save
from qkv.models.sizes import parameter_count

VARIANTS = {
    "cls": ViTConfig.from_name("vit-tiny"),
    "mean": ViTConfig.from_name("vit-tiny", pooling="mean"),
    "latent": ViTConfig.from_name("vit-tiny", pooling="latent", num_latents=3, latent_blocks=1),
    "sinusoidal": ViTConfig.from_name("vit-digits", position="sinusoidal2d", num_layers=1),
}


def _hugging_face_config(config: ViTConfig) -> transformers.ViTConfig:
    """The same sizes; eager attention (matrix products FlopCounterMode sees)."""
    return transformers.ViTConfig(
        hidden_size=config.embed_dim, num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads, intermediate_size=config.ffn_dim,
        image_size=config.image_size, patch_size=config.patch_size,
        num_channels=config.channels, num_labels=config.num_classes, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, attn_implementation="eager",
    )  # fmt: skip


def _counted(run) -> int:
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        run()
    return counter.get_total_flops()


def test_vit_base_16_has_the_papers_86m_parameters():
    """Table 1: ViT-Base, 86M: 85,798,656 without a head, 86,567,656 with the 1000-class
    ImageNet head (768 x 1000 + 1000 more)."""
    report = cost_report("vit-base-16")
    assert report.parameters == 86_567_656
    without_head = report.parameters - (768 * 1000 + 1000)
    assert round(without_head / 1e6) == 86 and report.parameters == pytest.approx(86e6, rel=0.01)
    assert (report.context, report.num_classes, report.embed_dim) == (197, 1000, 768)


def test_vit_base_16_parameters_equal_hugging_faces_and_qkvs_models():
    """Both built on the meta device: shapes only."""
    config = ViTConfig.from_name("vit-base-16")
    with torch.device("meta"):
        reference = transformers.ViTForImageClassification(_hugging_face_config(config))
        model = ViT(config)
    expected = reference.num_parameters()
    assert cost_report(config).parameters == expected == parameter_count(config)
    assert sum(p.numel() for p in model.parameters()) == expected


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_parameters_equal_the_instantiated_model(name):
    config = VARIANTS[name]
    built = sum(p.numel() for p in ViT(config).parameters())
    assert cost_report(config).parameters == built == parameter_count(config)


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_forward_flops_equal_flop_counter_mode(name):
    """Two images through qkv's ViT on the eager `reference` backend (parameters frozen:
    FlopCounterMode's module tracker refuses the latents' expand, a view made without grad of
    a tensor that requires it)."""
    torch.manual_seed(0)
    config = VARIANTS[name]
    model = ViT(config).eval().requires_grad_(False)
    for module in model.modules():
        if isinstance(module, MultiHeadAttention):
            module.backend = "reference"
    images = torch.rand(2, config.channels, config.image_size, config.image_size)
    report = cost_report(config, batch=2)
    assert report.forward_flops == _counted(lambda: model(images))
    assert report.context == config.num_tokens


def test_forward_flops_equal_hugging_faces_model():
    """transformers' eager ViT: its convolutional patch embedding counted by FlopCounterMode."""
    config = ViTConfig.from_name("vit-digits", num_layers=2)
    reference = transformers.ViTForImageClassification(_hugging_face_config(config)).eval()
    images = torch.rand(3, 1, 8, 8)
    assert cost_report(config, batch=3).forward_flops == _counted(lambda: reference(images))


def test_a_qkv_vit_checkpoint_is_read_without_its_weights(tmp_path):
    model = ViT(VARIANTS["latent"])
    save(model, tmp_path)
    (tmp_path / "model.safetensors").unlink()  # only config.json is needed
    assert cost_report(tmp_path).parameters == sum(p.numel() for p in model.parameters())


def test_a_config_json_transformers_wrote_gives_its_models_parameters_and_flops(tmp_path):
    """No weights read: the reference is ViTForImageClassification built from that config."""
    hf_config = transformers.ViTConfig(
        hidden_size=48, num_hidden_layers=2, num_attention_heads=3, intermediate_size=96,
        image_size=16, patch_size=4, num_channels=3, num_labels=7, attn_implementation="eager",
    )  # fmt: skip
    hf_config.save_pretrained(tmp_path)
    reference = transformers.ViTForImageClassification(hf_config).eval()
    report = cost_report(tmp_path, batch=2)
    assert report.parameters == reference.num_parameters()
    images = torch.rand(2, 3, 16, 16)
    assert report.forward_flops == _counted(lambda: reference(images))


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [("qkv_bias", False, "qkv_bias is false"), ("hidden_act", "silu", "hidden_act"),
     ("patch_size", 5, "patch_size: 5 does not divide"), ("hidden_size", "48", "hidden_size")],
)  # fmt: skip
def test_a_vit_config_json_qkv_cannot_compute_is_refused_by_name(field, value, message, tmp_path):
    document = {"model_type": "vit", "hidden_size": 48, "num_attention_heads": 3,
                "image_size": 16, "patch_size": 4, field: value}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(document))
    with pytest.raises(ValueError, match=message):
        cost_report(tmp_path)


def test_command_prints_the_vit_column(capsys):
    parser = argparse.ArgumentParser(prog="qkv")
    cost_command.add_parser(parser.add_subparsers())
    args = parser.parse_args(["cost", "vit-base-16"])
    assert args.run(args) == 0
    out = capsys.readouterr().out
    assert "86,567,656 (86.57M)" in out
    lines = {line.split()[0]: line.split() for line in out.splitlines() if line.strip()}
    assert lines["classes"][-1] == "1000" and lines["context"][-3:] == ["197", "x", "1"]
