"""Which files of a Hugging Face folder hold the model's weights, and reading exactly those.

transformers writes either one `model.safetensors`, or shards (`model-00001-of-00003...`)
listed by `model.safetensors.index.json`, whose "weight_map" names the shard of every tensor.
Merging every `model*.safetensors` of a folder instead would let a stray file (a forgotten
`model_old_backup.safetensors`) replace the weights silently, so:

- with an index, the tensors it maps are read from the shards it names, each of them a file
  name inside the folder that exists and holds that tensor;
- without one, `model.safetensors` is read, alone: a folder with other `model*.safetensors`
  files and no index is ambiguous and refused, listing them;
- with neither, `pytorch_model.bin` (torch.load with weights_only=True: no code runs).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from qkv.models.checkpoints.core import CheckpointError, Tensors

__all__ = ["INDEX_NAME", "SINGLE_NAME", "read_weights", "remove_shards", "weight_files"]

SINGLE_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
BINARY_NAME = "pytorch_model.bin"


def read_weights(folder: str | Path) -> Tensors:
    """Every tensor of the model in `folder`, from the files `weight_files` names."""
    folder = Path(folder)
    index = folder / INDEX_NAME
    if index.is_file():
        return _read_sharded(folder, _weight_map(index))
    files = weight_files(folder)
    if files[0].suffix == ".bin":
        return _read_binary(files[0])
    return _read_safetensors(files[0])


def weight_files(folder: str | Path) -> list[Path]:
    """The files that hold the weights of the model in `folder` (see the module doc)."""
    folder = Path(folder)
    index = folder / INDEX_NAME
    if index.is_file():
        return [folder / name for name in sorted(set(_weight_map(index).values()))]
    found = sorted(path.name for path in folder.glob("model*.safetensors"))
    if found == [SINGLE_NAME]:
        return [folder / SINGLE_NAME]
    if len(found) > 1:
        raise CheckpointError(
            f"path: {folder} holds {', '.join(found)} and no {INDEX_NAME}, so which of them "
            f"are the model's weights cannot be told; expected {SINGLE_NAME} alone, or shards "
            f"listed by {INDEX_NAME} (move the other files away)"
        )
    if found:
        raise CheckpointError(
            f"path: {folder} holds {found[0]}; expected {SINGLE_NAME} (rename it), or shards "
            f"listed by {INDEX_NAME}"
        )
    if (folder / BINARY_NAME).is_file():
        return [folder / BINARY_NAME]
    raise CheckpointError(
        f"path: {folder} has no {SINGLE_NAME}, {INDEX_NAME} or {BINARY_NAME}; expected weights"
    )


def remove_shards(folder: str | Path) -> list[Path]:
    """Delete an index and the shards it names from `folder`, before a single
    model.safetensors is written there (as transformers cleans a folder it saves into): left
    in place, the stale index would be read instead of the new file. Returns what was deleted.
    """
    index = Path(folder) / INDEX_NAME
    if not index.is_file():
        return []
    removed = [index.parent / name for name in sorted(set(_weight_map(index).values()))]
    for path in [*removed, index]:
        path.unlink(missing_ok=True)
    return [*removed, index]


def _weight_map(index: Path) -> dict[str, str]:
    """The index's {tensor name: shard file name}, each a .safetensors file in the folder."""
    try:
        document = json.loads(index.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise CheckpointError(f"path: {index} is not valid JSON: {error}") from error
    weight_map = document.get("weight_map") if isinstance(document, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(
            f'path: {index}: expected a "weight_map" object from tensor names to shard files, '
            f"got {str(document)[:80]}"
        )
    for name, file in weight_map.items():
        if not (
            isinstance(file, str) and file.endswith(".safetensors") and Path(file).name == file
        ):
            raise CheckpointError(
                f"path: {index}: weight_map[{name!r}] names {file!r:.80}; expected a "
                f".safetensors file name in the folder"
            )
        if not (index.parent / file).is_file():
            raise CheckpointError(f"path: {index} names {file}, which does not exist")
    return weight_map


def _read_sharded(folder: Path, weight_map: dict[str, str]) -> Tensors:
    from safetensors import SafetensorError, safe_open

    by_file: dict[str, list[str]] = {}
    for name, file in weight_map.items():
        by_file.setdefault(file, []).append(name)
    tensors: Tensors = {}
    for file, names in sorted(by_file.items()):
        path = folder / file
        try:
            with safe_open(str(path), framework="pt") as shard:
                held = set(shard.keys())
                absent = [name for name in names if name not in held]
                if absent:
                    raise CheckpointError(
                        f"path: {folder / INDEX_NAME} maps {absent[0]} to {file}, which does not "
                        f"hold it ({len(absent)} such tensors)"
                    )
                tensors.update({name: shard.get_tensor(name) for name in names})
        except (SafetensorError, OSError) as error:
            raise CheckpointError(
                f"path: {path} is not a readable safetensors file: {error}"
            ) from error
    return tensors


def _read_safetensors(path: Path) -> Tensors:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(path))
    except (SafetensorError, OSError) as error:
        raise CheckpointError(
            f"path: {path} is not a readable safetensors file: {error}"
        ) from error


def _read_binary(path: Path) -> Tensors:
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # torch raises several types for a corrupt file
        raise CheckpointError(f"path: {path} could not be read: {error}") from error
