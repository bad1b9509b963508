"""A Hugging Face ViT config.json -> `ViTConfig`: the sizes of transformers'
ViTForImageClassification (Dosovitskiy et al. 2021), which `qkv cost` counts. Only the config:
qkv's ViT does not load transformers' ViT weights.

transformers' ViT is qkv's with pooling="cls", learned positions and biases on the query, key
and value projections; its hidden_act may be the exact GELU, the tanh GELU or ReLU. A config
that asks for anything else is refused.
"""

from __future__ import annotations

from qkv.models.checkpoints import fields
from qkv.models.checkpoints.core import CheckpointError
from qkv.models.vit_config import ViTConfig

__all__ = ["config_from_hf"]


def config_from_hf(hf: dict) -> ViTConfig:
    """A transformers ViT config.json (as a dict) -> ViTConfig, read as transformers 5's
    ViTConfig reads it; CheckpointError if qkv's ViT cannot compute what it describes. Absent
    keys take transformers' defaults (ViT-Base/16)."""
    if not fields.boolean(hf, "qkv_bias", True):
        raise CheckpointError(
            "config.json: qkv_bias is false; qkv's ViT has query, key and value biases"
        )
    activation = fields.activation(hf, "hidden_act", "gelu", ("gelu", "gelu_tanh", "relu"))
    classes, _ = fields.labels(hf)
    try:
        return ViTConfig(
            image_size=_side(hf, "image_size", 224),
            patch_size=_side(hf, "patch_size", 16),
            channels=fields.integer(hf, "num_channels", 3),
            embed_dim=fields.integer(hf, "hidden_size", 768),
            num_layers=fields.integer(hf, "num_hidden_layers", 12),
            num_heads=fields.integer(hf, "num_attention_heads", 12),
            ffn_dim=fields.integer(hf, "intermediate_size", 3072),
            num_classes=classes,
            activation=activation,
            norm_eps=fields.number(hf, "layer_norm_eps", 1e-12),
            dropout=fields.number(hf, "hidden_dropout_prob", 0.0),
            attention_dropout=fields.number(hf, "attention_probs_dropout_prob", 0.0),
        )
    except (TypeError, ValueError) as error:
        raise CheckpointError(f"config.json: {error}") from error


def _side(hf: dict, key: str, default: int) -> int:
    """image_size / patch_size: an int, or (as ViTConfig also takes) [height, width], which
    qkv's square images and patches take when the two are equal."""
    value = hf.get(key, default)
    if isinstance(value, list) and len(value) == 2 and value[0] == value[1]:
        value = value[0]
    elif isinstance(value, list):
        raise CheckpointError(
            f"config.json: {key} is {value!r:.80}; qkv's ViT takes an int or [side, side] (square)"
        )
    return fields.integer({key: value}, key)
