"""Training checkpoints: everything needed to go on as if the run had never stopped.

One safetensors file holds the model's tensors, the optimizer's state tensors (AdamW's moments
and step counts) and the RNG state; its JSON metadata holds the rest (step, optimizer
hyper-parameters, scheduler state, what the caller adds). No pickle: loading cannot run code.

One file, written to a temporary name, flushed to disk and renamed over the previous checkpoint
(`os.replace` is atomic on POSIX): a run killed at any moment, SIGKILL included, leaves either the
old checkpoint or the new one, never half of one. Dropout draws from the global CPU generator,
and the data order is a pure function of (seed, step), so with the RNG state restored a resumed
run takes bit for bit the steps the uninterrupted one would have taken.

The metadata also holds a SHA-256 of the metadata text and of every tensor (name, dtype, shape,
bytes), as a saved model's config.json holds its weights' (`qkv.models.save`): bytes changed on
disk, or a file edited by hand, are refused on load, and so is a file with no hash. Then every
tensor is checked against the object it goes into (`qkv.training.checkpoint_checks`) before
anything is loaded, so a bad file raises one CheckpointError naming it and changes nothing.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from qkv.models.safetensors_io import (
    CheckpointError,
    save_safetensors,
    unique_tensors,
    write_atomically,
)
from qkv.training import checkpoint_checks as checks

__all__ = [
    "CHECKPOINT_NAME",
    "CheckpointWriteError",
    "TrainingState",
    "checkpoint_digest",
    "load_checkpoint",
    "save_checkpoint",
]

CHECKPOINT_NAME = "checkpoint.safetensors"
FORMAT, FORMAT_VERSION = "qkv-training", 2
HASH_KEY = "qkv_sha256"  # beside "qkv" (the JSON document) in the safetensors metadata


@dataclass(frozen=True)
class TrainingState:
    """What `load_checkpoint` read back: the step reached and the caller's extra metadata."""

    step: int
    extra: dict


class CheckpointWriteError(OSError):
    """A checkpoint could not be written (disk full, file too large, no permission); the
    previous checkpoint at that path, if any, is unchanged (the write goes to a temporary)."""


def save_checkpoint(
    path: str | os.PathLike,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    step: int,
    extra: dict | None = None,
    model_state: dict | None = None,
    optimizer_state: dict | None = None,
) -> Path:
    """Write model, optimizer, scheduler, RNG state and `step` (optimizer steps done) to
    `path` atomically. `extra` must be JSON-serialisable (e.g. metrics, the run's options).
    model_state / optimizer_state: the full state dicts of a sharded model and its optimizer
    (`qkv.training.sharded.gather_state`), written instead of their own, so that the file is
    the one an unsharded run writes.

    Raises CheckpointWriteError (an OSError) when the file cannot be written."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors, tied = unique_tensors(model.state_dict() if model_state is None else model_state)
    tensors = {f"model/{name}": tensor for name, tensor in tensors.items()}
    optimizer_state = optimizer.state_dict() if optimizer_state is None else optimizer_state
    optimizer_document = _split_optimizer_state(optimizer_state, tensors)
    tensors["rng/torch"] = torch.get_rng_state()
    document = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "step": step,
        "tied_weights": tied,
        "optimizer": optimizer_document,
        "scheduler": scheduler.state_dict(),
        "extra": extra or {},
    }
    text = json.dumps(document)
    metadata = {"qkv": text, HASH_KEY: checkpoint_digest(tensors, text)}
    _write(path, tensors, metadata)
    return path


def load_checkpoint(
    path: str | os.PathLike,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
) -> TrainingState:
    """Restore what `save_checkpoint` wrote into freshly built objects, and the RNG state.

    The hash, then every value (finite: a NaN state is no state to go on from), key, shape and
    dtype (model, optimizer state, RNG state) and the scheduler's state are checked first:
    anything wrong raises one `CheckpointError` naming the file and leaves every object
    untouched."""
    path = Path(path)
    tensors, document = _read(path)
    checks.finite(path, tensors)
    model_state = checks.model_state(path, model, tensors, document["tied_weights"])
    optimizer_state = checks.optimizer_state(path, optimizer, document["optimizer"], tensors)
    checks.check_scheduler(path, scheduler, document["scheduler"])
    rng = checks.rng_state(path, tensors)
    try:  # the optimizer refuses groups of other sizes before it changes anything
        optimizer.load_state_dict(optimizer_state)
    except (ValueError, KeyError, TypeError, RuntimeError) as error:
        raise CheckpointError(
            f"path: {path}: the optimizer state does not load: {error}"
        ) from error
    model.load_state_dict(model_state)
    scheduler.load_state_dict(document["scheduler"])
    torch.set_rng_state(rng)
    return TrainingState(step=document["step"], extra=document["extra"])


def checkpoint_digest(tensors: dict[str, torch.Tensor], document_text: str) -> str:
    """SHA-256 of the metadata text, then of each tensor in name order: its name, dtype and
    shape (which fix its length in bytes), then its bytes."""
    text = document_text.encode()
    digest = hashlib.sha256(f"{len(text)}:".encode() + text)
    for name in sorted(tensors):
        tensor = tensors[name].detach().cpu().contiguous()
        digest.update(json.dumps([name, str(tensor.dtype), list(tensor.shape)]).encode())
        digest.update(memoryview(tensor.reshape(-1).view(torch.uint8).numpy()))
    return digest.hexdigest()


def _write(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    from safetensors import SafetensorError

    try:
        write_atomically(path, lambda temporary: save_safetensors(tensors, temporary, metadata))
    except (OSError, SafetensorError) as error:
        # safetensors puts the OS error in its message: "(os error 28)", "Os { code: 28, ..."
        found = re.search(r"\b(?:os error|code:) (\d+)", str(error))
        number = getattr(error, "errno", None) or (int(found.group(1)) if found else None)
        reason = os.strerror(number) if number else str(error)
        message = (
            f"{path}: the checkpoint could not be written ({reason}); the previous checkpoint, "
            f"if any, is unchanged. Make room (or fix the folder's permissions), then resume"
        )
        raise CheckpointWriteError(*((number, message) if number else (message,))) from error


def _split_optimizer_state(state_dict: dict, tensors: dict[str, torch.Tensor]) -> dict:
    """Move the per-parameter tensors into `tensors`; return the JSON-able remainder."""
    state: dict[str, dict] = {}
    for index, values in state_dict["state"].items():
        state[str(index)] = {}
        for key, value in values.items():
            if isinstance(value, torch.Tensor):
                tensors[f"optimizer/{index}/{key}"] = value.detach().cpu().contiguous()
                state[str(index)][key] = {"tensor": f"optimizer/{index}/{key}"}
            else:
                state[str(index)][key] = {"value": value}
    return {"state": state, "param_groups": state_dict["param_groups"]}


def _read(path: Path) -> tuple[dict[str, torch.Tensor], dict]:
    """The tensors and the JSON document, after the format, the hash and the document's keys
    and types are checked."""
    from safetensors import SafetensorError, safe_open

    if not path.is_file():
        raise CheckpointError(f"path: {path} does not exist; expected a training checkpoint")
    try:
        with safe_open(str(path), framework="pt") as file:
            metadata = file.metadata() or {}
            tensors = {key: file.get_tensor(key) for key in file.keys()}  # noqa: SIM118
    except (SafetensorError, OSError, ValueError) as error:
        raise CheckpointError(f"path: {path} is not a readable checkpoint: {error}") from error
    text = metadata.get("qkv", "{}")
    document = checks.parse_document(path, text, FORMAT, FORMAT_VERSION)
    _verify_digest(path, tensors, text, metadata.get(HASH_KEY))
    checks.check_document(path, document)
    return tensors, document


def _verify_digest(path: Path, tensors: dict, text: str, recorded: str | None) -> None:
    if recorded is None:
        raise CheckpointError(
            f"path: {path} carries no SHA-256 ({HASH_KEY!r} in its metadata), so whether it is "
            f"intact cannot be told; expected a checkpoint written by save_checkpoint"
        )
    if checkpoint_digest(tensors, text) != recorded:
        raise CheckpointError(
            f"path: {path} does not match its SHA-256: bytes changed on disk or the file was "
            f"edited. Use a copy made before, or start the run again in another folder"
        )
