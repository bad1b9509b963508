"""qkv's own checkpoints: config.json + model.safetensors for any registered qkv model.

A qkv model keeps its sizes in `.config`, a frozen dataclass, so a checkpoint is that config
written as JSON (with the model's class name) and the state dict written as safetensors: no
pickle anywhere, so loading a file can never run code. `load` rebuilds the model class from a
registry (`register_model_class`), builds it from the config and loads the tensors after checking
every key and shape, all or nothing.

Tied weights (one tensor under several names, e.g. a shared embedding and the output
projection) are written once: safetensors refuses tensors that share memory, and cloning them
would double the file and lose the tie. config.json records the other names in "tied_weights";
the rebuilt model ties them again by construction, and `load` checks that it does.

Both files are written atomically (a temporary file in the same folder, then `os.replace`), the
weights first and config.json last, with the weights' SHA-256 in it ("weights_sha256") and a
SHA-256 of config.json's own fields ("checkpoint_sha256", which covers weights_sha256 too): an
interrupted save leaves the previous checkpoint as it was, and a corrupted or mismatched pair, a
config edited by hand, or a hash deleted are caught on load, before the model is built. The
hashes guard against accidents (a bad disk, a stray edit, files of two saves mixed), not against
someone who rewrites them: they are no signature. `load(path, verify=False)` skips them, for a
folder edited on purpose.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import json
import logging
import os
import re
from pathlib import Path

import torch
from torch import nn

from qkv.models.safetensors_io import (
    CheckpointError,
    save_safetensors,
    unique_tensors,
    write_atomically,
)
from qkv.models.sizes import can_size, check_model_fits

__all__ = [
    "CONFIG_NAME",
    "WEIGHTS_NAME",
    "CheckpointError",
    "checkpoint_sha256",
    "load",
    "register_model_class",
    "save",
    "unique_tensors",
    "write_atomically",
]

logger = logging.getLogger(__name__)

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
FORMAT, FORMAT_VERSION = "qkv", 1
_SHA256 = re.compile(r"[0-9a-f]{64}")

# class name -> (model class, config class)
_REGISTRY: dict[str, tuple[type[nn.Module], type]] = {}
# Modules that register qkv's own model classes when imported; `load` imports them on demand so
# that a checkpoint loads without the caller importing its model module first.
_MODULES_THAT_REGISTER = (
    "qkv.models.encoder_decoder",
    "qkv.models.bert_heads",
    "qkv.models.gpt",
    "qkv.models.t5",
)


def register_model_class(model_class: type[nn.Module], config_class: type) -> None:
    """Make `load` able to rebuild `model_class(config_class(**fields))` from a checkpoint.

    config_class must be a frozen dataclass. A class is registered under its `__name__`;
    registering the same pair again does nothing, another class under a taken name is an error.
    """
    if not (isinstance(model_class, type) and issubclass(model_class, nn.Module)):
        raise TypeError(f"model_class: expected an nn.Module subclass, got {model_class!r}")
    if not _is_frozen_dataclass_type(config_class):
        raise TypeError(f"config_class: expected a frozen dataclass type, got {config_class!r}")
    name = model_class.__name__
    known = _REGISTRY.get(name)
    if known is not None and known != (model_class, config_class):
        raise ValueError(
            f"model_class: the name {name!r} is already registered for "
            f"{known[0].__module__}.{name}; expected a class with another name"
        )
    _REGISTRY[name] = (model_class, config_class)


def save(model: nn.Module, path: str | os.PathLike) -> Path:
    """Write `model` to the folder `path` (created if needed): config.json and model.safetensors.

    Raises TypeError if the model has no frozen-dataclass `.config` or a config field JSON cannot
    hold, ValueError if its class is not registered (it could not be loaded back).
    """
    config = _config_of(model)
    name = type(model).__name__
    if _lookup(name) != (type(model), type(config)):
        raise ValueError(
            f"model: {type(model).__qualname__} with {type(config).__qualname__} is not "
            f"registered, so it could not be loaded back; expected a class registered with "
            f"qkv.models.serialization.register_model_class"
        )
    document = {"format": FORMAT, "format_version": FORMAT_VERSION, "model_class": name}
    document["config_class"] = type(config).__name__
    document["config"] = _config_to_json(config)
    tensors, tied = unique_tensors(model.state_dict())
    directory = Path(path)
    directory.mkdir(parents=True, exist_ok=True)
    weights_path = directory / WEIGHTS_NAME
    write_atomically(weights_path, lambda temporary: _save_tensors(tensors, temporary))
    document["tied_weights"] = tied
    document["weights_sha256"] = _sha256(weights_path)
    document["checkpoint_sha256"] = checkpoint_sha256(document)
    text = json.dumps(document, indent=2, sort_keys=True, allow_nan=False) + "\n"
    write_atomically(directory / CONFIG_NAME, lambda temporary: temporary.write_text(text))
    logger.info("saved %s (%d tensors) to %s", name, len(tensors), directory)
    return directory


def load(
    path: str | os.PathLike, *, map_location: str | torch.device = "cpu", verify: bool = True
) -> nn.Module:
    """Rebuild the model saved in the folder `path`, in eval mode, on `map_location`.

    Raises CheckpointError (a ValueError) for a missing, unreadable, corrupted or inconsistent
    checkpoint: config.json must match its checkpoint_sha256 and the weights their
    weights_sha256 (unless verify=False); a model too large for this machine's memory is
    refused before it is built; missing, unexpected or mis-shaped tensors are listed together,
    and no weight is copied unless all of them fit. Weights keep the (single floating) dtype
    they were saved in.
    """
    directory = Path(path)
    config_path = directory / CONFIG_NAME
    document = _read_document(config_path)
    if verify:
        _verify_document(config_path, document)
    model_class, config_class = _registered(document)
    config = _config_from_json(config_class, document.get("config"))
    if can_size(config):  # before anything is allocated (a user's own class: built as it is)
        try:
            check_model_fits(config)
        except ValueError as error:
            raise CheckpointError(f"{config_path}: {error}") from error
    weights_path = directory / WEIGHTS_NAME
    tensors = _read_tensors(weights_path)
    if verify and _sha256(weights_path) != document["weights_sha256"]:
        raise CheckpointError(
            f"path: {weights_path} does not match the SHA-256 recorded in {CONFIG_NAME}; the "
            f"file is corrupted or belongs to another save"
        )
    model = model_class(config)
    _load_state(model, tensors, document.get("tied_weights", {}), weights_path)
    return model.to(map_location).eval()


def checkpoint_sha256(document: dict) -> str:
    """SHA-256 of config.json's fields but checkpoint_sha256 itself, as compact key-sorted
    JSON: any change to the config (or to the weights' hash in it) changes it."""
    fields = {key: value for key, value in document.items() if key != "checkpoint_sha256"}
    text = json.dumps(fields, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hashlib.sha256(text.encode()).hexdigest()


def _verify_document(config_path: Path, document: dict) -> None:
    """Both hashes present and well formed, and config.json's own one matching."""
    for key in ("checkpoint_sha256", "weights_sha256"):
        value = document.get(key)
        if value is None:
            raise CheckpointError(
                f"path: {config_path} has no {key}; whether the checkpoint is intact cannot be "
                f"told. Expected a folder written by qkv.models.save; to load it anyway, "
                f"qkv.models.load(path, verify=False)"
            )
        if not (isinstance(value, str) and _SHA256.fullmatch(value)):
            raise CheckpointError(
                f"path: {config_path}: {key} is {value!r:.80}; expected 64 hexadecimal digits"
            )
    if checkpoint_sha256(document) != document["checkpoint_sha256"]:
        raise CheckpointError(
            f"path: {config_path} does not match its checkpoint_sha256: the file was edited or "
            f"damaged after it was saved. Use an intact copy; to load it as it is, "
            f"qkv.models.load(path, verify=False)"
        )


def _lookup(name: str) -> tuple[type[nn.Module], type] | None:
    if name not in _REGISTRY:
        for module in _MODULES_THAT_REGISTER:
            importlib.import_module(module)
    return _REGISTRY.get(name)


def _registered(document: dict) -> tuple[type[nn.Module], type]:
    name = document.get("model_class")
    entry = _lookup(name) if isinstance(name, str) else None
    if entry is None:
        raise CheckpointError(
            f"{CONFIG_NAME}: model_class {name!r} is not a registered qkv model; expected one "
            f"of {sorted(_REGISTRY)}"
        )
    if document.get("config_class") != entry[1].__name__:
        raise CheckpointError(
            f"{CONFIG_NAME}: config_class {document.get('config_class')!r} does not go with "
            f"{name}; expected {entry[1].__name__!r}"
        )
    return entry


def _config_of(model: nn.Module) -> object:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected an nn.Module, got {type(model).__name__}")
    config = getattr(model, "config", None)
    if not _is_frozen_dataclass_type(type(config)):
        raise TypeError(
            f"model: expected a `.config` that is a frozen dataclass, got "
            f"{type(config).__name__} on {type(model).__name__}"
        )
    return config


def _is_frozen_dataclass_type(value: object) -> bool:
    return (
        isinstance(value, type)
        and dataclasses.is_dataclass(value)
        and value.__dataclass_params__.frozen
    )


def _config_to_json(config: object) -> dict:
    """The dataclass fields as JSON values (tuples become lists, a nested frozen dataclass such
    as a RoPE scaling rule its dict of fields); refuses anything else."""
    fields = {}
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            value = dataclasses.asdict(value)
        if not _is_json_value(value):
            raise TypeError(
                f"config.{field.name}: expected a JSON value (None, bool, int, finite float, str, "
                f"or a tuple/list/dict of them), got {type(value).__name__} {value!r}"
            )
        fields[field.name] = value
    return fields


def _is_json_value(value: object) -> bool:
    if value is None or isinstance(value, (bool, int, str)):
        return True
    if isinstance(value, float):
        return value == value and abs(value) != float("inf")
    if isinstance(value, (tuple, list)):
        return all(_is_json_value(item) for item in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _is_json_value(v) for k, v in value.items())
    return False


def _config_from_json(config_class: type, fields: object) -> object:
    """config_class(**fields); JSON lists come back as tuples (frozen configs hold tuples)."""
    if not isinstance(fields, dict):
        raise CheckpointError(f"{CONFIG_NAME}: expected a 'config' object, got {fields!r}")
    known = {field.name for field in dataclasses.fields(config_class)}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise CheckpointError(
            f"{CONFIG_NAME}: fields {unknown} are not fields of {config_class.__name__}; "
            f"expected some of {sorted(known)}"
        )
    try:
        return config_class(**{name: _tuples(value) for name, value in fields.items()})
    except (TypeError, ValueError) as error:
        raise CheckpointError(f"{CONFIG_NAME}: invalid {config_class.__name__}: {error}") from error


def _tuples(value: object) -> object:
    if isinstance(value, list):
        return tuple(_tuples(item) for item in value)
    if isinstance(value, dict):
        return {key: _tuples(item) for key, item in value.items()}
    return value


def _load_state(
    model: nn.Module, tensors: dict[str, torch.Tensor], tied: object, source: Path
) -> None:
    """Check names, ties and shapes against the freshly built model, then copy, all or nothing."""
    expected, model_tied = unique_tensors(model.state_dict())
    if tied != model_tied:
        raise CheckpointError(
            f"{CONFIG_NAME}: tied_weights {tied} differ from the ties of the model its config "
            f"builds, {model_tied}"
        )
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    misshaped = [
        f"{key}: file {tuple(tensors[key].shape)}, model {tuple(expected[key].shape)}"
        for key in sorted(set(expected) & set(tensors))
        if tensors[key].shape != expected[key].shape
    ]
    if missing or unexpected or misshaped:
        raise CheckpointError(
            f"path: {source} does not fit {type(model).__name__}:"
            + _listing("missing", missing)
            + _listing("unexpected", unexpected)
            + _listing("mis-shaped", misshaped)
        )
    _match_dtype(model, tensors)
    state = model.state_dict()
    with torch.no_grad():
        for key, tensor in tensors.items():
            state[key].copy_(tensor)


def _match_dtype(model: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Cast the model to the floating dtype of the checkpoint (saved bf16 loads as bf16)."""
    dtypes = {tensor.dtype for tensor in tensors.values() if tensor.is_floating_point()}
    if len(dtypes) == 1:
        model.to(dtypes.pop())


def _listing(label: str, keys: list[str]) -> str:
    if not keys:
        return ""
    shown = "\n    ".join(keys[:20])
    more = f"\n    ... and {len(keys) - 20} more" if len(keys) > 20 else ""
    return f"\n  {label} ({len(keys)}):\n    {shown}{more}"


def _save_tensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    save_safetensors(tensors, path, {"format": "pt"})


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    if not path.is_file():
        raise CheckpointError(f"path: {path} does not exist; expected the checkpoint's weights")
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as error:
        raise CheckpointError(
            f"path: {path} is not a readable safetensors file (truncated or corrupted?): {error}"
        ) from error


def _read_document(path: Path) -> dict:
    if not path.is_file():
        raise CheckpointError(
            f"path: {path.parent} has no {CONFIG_NAME}; expected a qkv checkpoint"
        )
    try:
        document = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise CheckpointError(f"path: {path} is not valid JSON: {error}") from error
    if not isinstance(document, dict) or document.get("format") != FORMAT:
        raise CheckpointError(
            f'path: {path} is not a qkv checkpoint (expected "format": "qkv"); a Hugging '
            f"Face folder loads with qkv.models.checkpoints.from_pretrained"
        )
    if document.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"path: {path} has format_version {document.get('format_version')!r}; this qkv "
            f"reads version {FORMAT_VERSION}"
        )
    return document


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for chunk in iter(lambda: file.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()
