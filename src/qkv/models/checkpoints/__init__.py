"""Hugging Face checkpoint directories <-> qkv models (safetensors + JSON, never pickle).

- `core`: reading config.json and tokenizer.json, checking and copying tensors (`KeyMap`,
  `load_into`), writing a folder; `fields`: typed reads of config.json values;
  `weight_files`: which files hold the weights (an index, or model.safetensors alone).
- `registry`: the architectures qkv reads and writes; `bert`, `gpt2`, `llama`, `t5` register theirs
  with their key maps.
- `pretrained`: `from_pretrained(path)` and `save_pretrained(model, path)`.
- `vit`: a ViT config.json read into a `ViTConfig` (for `qkv cost`; no ViT weights are read).

This package sits above the model classes: it imports them, they never import it.
"""

from qkv.models.checkpoints.core import (
    CheckpointError,
    KeyMap,
    NotAFolderError,
    check_local_folder,
)
from qkv.models.checkpoints.pretrained import from_pretrained, save_pretrained
from qkv.models.checkpoints.registry import ARCHITECTURES, Architecture, register

__all__ = [
    "ARCHITECTURES",
    "Architecture",
    "CheckpointError",
    "KeyMap",
    "NotAFolderError",
    "check_local_folder",
    "from_pretrained",
    "register",
    "save_pretrained",
]
