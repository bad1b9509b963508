"""Reading and writing checkpoints: safetensors + JSON, never pickle.

A Hugging Face directory holds config.json and its weights (`weight_files`, beside this file,
says which files those are and reads them). Each model family has a `KeyMap` (in this package,
beside this file) that renames checkpoint keys to qkv's parameter names and back; this module
does the rest: read, rename, check every key and shape, and only then load, so a bad
checkpoint leaves the model untouched and raises one error that lists everything wrong.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from qkv.models.safetensors_io import CheckpointError, save_safetensors

__all__ = [
    "CheckpointError",
    "KeyMap",
    "NotAFolderError",
    "check_local_folder",
    "load_into",
    "read_config",
    "read_tokenizer",
    "save_safetensors",
    "write",
]

Tensors = dict[str, torch.Tensor]


class NotAFolderError(CheckpointError, FileNotFoundError):
    """A checkpoint path with nothing there, such as a Hugging Face Hub name ("gpt2"): qkv
    reads local folders only. Both a CheckpointError (a ValueError) and a FileNotFoundError."""


# A Hub repository id: "name" or "owner/name", letters, digits, '-', '_', '.'
_HUB_NAME = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")


@dataclass(frozen=True)
class KeyMap:
    """Renames between a checkpoint's keys and a qkv model's state_dict keys.

    `to_qkv(checkpoint_tensors) -> qkv_tensors` may also split, fuse or transpose tensors
    (GPT-2's fused c_attn, Conv1D weights); `to_checkpoint` is its inverse. `ignore` lists
    checkpoint keys that carry no weights (buffers such as position_ids).
    """

    to_qkv: Callable[[Tensors], Tensors]
    to_checkpoint: Callable[[Tensors], Tensors]
    ignore: tuple[str, ...] = field(default=())


def check_local_folder(
    path: str | Path, *, argument: str = "path", auto_class: str = "AutoModelForCausalLM"
) -> Path:
    """`path` as a Path when something is there; NotAFolderError otherwise, which for a name
    shaped like a Hub id says that nothing is downloaded and how to make the folder (with
    transformers' `auto_class`, on a machine with network)."""
    directory = Path(path)
    if directory.exists():
        return directory
    name = str(path)
    if not _HUB_NAME.fullmatch(name):
        raise NotAFolderError(
            f"{argument}: {name} does not exist; expected a local checkpoint folder "
            f"(config.json and model.safetensors)"
        )
    local = name.rsplit("/", 1)[-1] + "-local"
    raise NotAFolderError(
        f'{argument}: there is no folder "{name}" here. qkv reads checkpoints from local folders '
        f"only and downloads nothing, so a Hugging Face Hub name is not enough. To make the "
        f"folder, on a machine with network and transformers: "
        f'`{auto_class}.from_pretrained("{name}").save_pretrained("{local}")` (and, for its '
        f'tokenizer.json, `AutoTokenizer.from_pretrained("{name}").save_pretrained("{local}")`); '
        f'then pass "{local}" (copied here if it was made elsewhere)'
    )


def read_config(path: str | Path) -> dict:
    """config.json of a checkpoint directory, with a clear error when it is missing or bad."""
    config_path = Path(path) / "config.json"
    if not config_path.is_file():
        raise CheckpointError(f"path: {path} has no config.json; expected a checkpoint directory")
    try:
        config = json.loads(config_path.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise CheckpointError(f"path: {config_path} is not valid JSON: {error}") from error
    if not isinstance(config, dict):
        raise CheckpointError(
            f"path: {config_path}: expected a JSON object (the model's settings), got "
            f"{type(config).__name__}"
        )
    return config


def read_tokenizer(path: str | Path, *, name: str = "tokenizer.json"):
    """The `tokenizers.Tokenizer` of a checkpoint folder's tokenizer.json; CheckpointError for
    a file that is missing or is not one (the Rust side raises a bare Exception)."""
    from tokenizers import Tokenizer

    file = Path(path) / name
    if not file.is_file():
        raise CheckpointError(
            f"path: {path} has no {name}; expected the folder of a checkpoint with its "
            f"tokenizer (a `tokenizers` JSON file)"
        )
    try:
        return Tokenizer.from_file(str(file))
    except Exception as error:
        raise CheckpointError(
            f"path: {file} is not a valid tokenizer.json ({str(error)[:200]})"
        ) from error


def load_into(model: nn.Module, checkpoint: Tensors, key_map: KeyMap) -> None:
    """Rename, check everything, then copy: all or nothing."""
    ignored = {k for k in checkpoint if any(k.endswith(suffix) for suffix in key_map.ignore)}
    renamed = key_map.to_qkv({k: t for k, t in checkpoint.items() if k not in ignored})
    expected = model.state_dict()
    missing = sorted(set(expected) - set(renamed))
    unexpected = sorted(set(renamed) - set(expected))
    misshaped = sorted(
        f"{k}: checkpoint {tuple(renamed[k].shape)}, model {tuple(expected[k].shape)}"
        for k in set(expected) & set(renamed)
        if renamed[k].shape != expected[k].shape
    )
    if missing or unexpected or misshaped:
        raise CheckpointError(
            "checkpoint does not fit the model:"
            + _listing("missing", [_with_checkpoint_name(k, expected, key_map) for k in missing])
            + _listing("unexpected", unexpected)
            + _listing("mis-shaped", misshaped)
        )
    with torch.no_grad():
        for key, target in expected.items():
            target.copy_(renamed[key])


def write(path: str | Path, config: dict, model: nn.Module, key_map: KeyMap) -> Path:
    """config.json + model.safetensors in the checkpoint's own names (transformers loads it)."""
    directory = Path(path)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = key_map.to_checkpoint(
        {k: t.detach().cpu().contiguous() for k, t in model.state_dict().items()}
    )
    save_safetensors(_unshared(tensors), directory / "model.safetensors", {"format": "pt"})
    (directory / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return directory


def _unshared(tensors: Tensors) -> Tensors:
    """safetensors refuses tensors that share memory (tied weights): give each its own."""
    seen: set[int] = set()
    out = {}
    for key, tensor in tensors.items():
        pointer = tensor.untyped_storage().data_ptr()
        out[key] = tensor.clone() if pointer in seen else tensor
        seen.add(pointer)
    return out


def _with_checkpoint_name(key: str, expected: Tensors, key_map: KeyMap) -> str:
    """`key (checkpoint: name)`: a missing tensor under the name the checkpoint should have."""
    try:
        names = sorted(key_map.to_checkpoint({key: expected[key]}))
    except Exception:  # a fused map (GPT-2's c_attn) needs its siblings: show the qkv name only
        return key
    shown = ", ".join(names[:2]) + (", ..." if len(names) > 2 else "")
    return f"{key} (checkpoint: {shown})" if names and names != [key] else key


def _listing(label: str, keys: list[str]) -> str:
    if not keys:
        return ""
    shown = "\n    ".join(keys[:20]) + (
        f"\n    ... and {len(keys) - 20} more" if len(keys) > 20 else ""
    )
    return f"\n  {label} ({len(keys)}):\n    {shown}"
