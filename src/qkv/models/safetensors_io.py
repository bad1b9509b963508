"""What every checkpoint format of qkv shares: its error type, the safetensors writer, tied
tensors written once, and atomic writes.

Both qkv's own checkpoints (`qkv.models.serialization`) and the Hugging Face folders
(`qkv.models.checkpoints`, a layer above the model classes) use them, so they live below both.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable
from pathlib import Path

import torch

__all__ = ["CheckpointError", "save_safetensors", "unique_tensors", "write_atomically"]


class CheckpointError(ValueError):
    """A checkpoint that does not fit the model: lists missing, unexpected, mis-shaped keys."""


def save_safetensors(tensors: dict[str, torch.Tensor], path: Path, metadata: dict) -> None:
    """safetensors' save_file, with the file readable as the umask allows (save_file leaves
    0600, so a model written by one user could not be read by another)."""
    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata=metadata)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


def unique_tensors(state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict]:
    """Each distinct tensor once, under its first name, and {other name: first name}.

    Names are tied when they are the same view of the same memory. Tensors that only overlap
    (views into one buffer) are copied apart, since safetensors refuses shared memory.
    """
    first_name: dict[tuple, str] = {}
    storages: set[int] = set()
    tensors, tied = {}, {}
    for name, tensor in state.items():
        identity = (tensor.data_ptr(), tensor.dtype, tuple(tensor.shape), tensor.stride())
        if identity in first_name and tensor.numel():
            tied[name] = first_name[identity]
            continue
        first_name[identity] = name
        storage = tensor.untyped_storage().data_ptr()
        copy = storage in storages or not tensor.is_contiguous()
        storages.add(storage)
        tensors[name] = tensor.clone(memory_format=torch.contiguous_format) if copy else tensor
        tensors[name] = tensors[name].detach().cpu()
    return tensors, tied


def write_atomically(path: Path, write: Callable[[Path], object], suffix: str = "") -> None:
    """write(temporary path) in path's folder, flush it to disk, then rename it over `path`;
    the temporary is gone whatever happens. `suffix` ends the temporary's name, for writers
    that insist on one (AOTInductor's packages end in .pt2)."""
    # A fresh name rather than tempfile.mkstemp, whose 0600 mode would stay on the checkpoint.
    temporary = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp{suffix}")
    try:
        write(temporary)
        with open(temporary, "rb+") as file:
            os.fsync(file.fileno())
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)
