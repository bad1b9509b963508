"""Training checkpoints: everything needed to go on as if the run had never stopped.

One safetensors file holds the model's tensors, the optimizer's state tensors (AdamW's moments
and step counts) and the RNG state; its JSON metadata holds the rest (step, optimizer
hyper-parameters, scheduler state, what the caller adds). No pickle: loading cannot run code.

One file, written to a temporary name, flushed to disk and renamed over the previous checkpoint
(`os.replace` is atomic on POSIX): a run killed at any moment, SIGKILL included, leaves either the
old checkpoint or the new one, never half of one. Dropout draws from the global CPU generator,
and the data order is a pure function of (seed, step), so with the RNG state restored a resumed
run takes bit for bit the steps the uninterrupted one would have taken.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from qkv.models.checkpoints.core import CheckpointError, save_safetensors
from qkv.models.serialization import unique_tensors, write_atomically

__all__ = ["CHECKPOINT_NAME", "TrainingState", "load_checkpoint", "save_checkpoint"]

CHECKPOINT_NAME = "checkpoint.safetensors"
FORMAT, FORMAT_VERSION = "qkv-training", 1


@dataclass(frozen=True)
class TrainingState:
    """What `load_checkpoint` read back: the step reached and the caller's extra metadata."""

    step: int
    extra: dict


def save_checkpoint(
    path: str | os.PathLike,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    step: int,
    extra: dict | None = None,
) -> Path:
    """Write model, optimizer, scheduler, RNG state and `step` (optimizer steps done) to
    `path` atomically. `extra` must be JSON-serialisable (e.g. metrics, the run's options)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors, tied = unique_tensors(model.state_dict())
    tensors = {f"model/{name}": tensor for name, tensor in tensors.items()}
    optimizer_document = _split_optimizer_state(optimizer.state_dict(), tensors)
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
    metadata = {"qkv": json.dumps(document)}
    write_atomically(path, lambda temporary: save_safetensors(tensors, temporary, metadata))
    return path


def load_checkpoint(
    path: str | os.PathLike,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
) -> TrainingState:
    """Restore what `save_checkpoint` wrote into freshly built objects, and the RNG state.

    The model's keys and shapes are checked first: a mismatch raises `CheckpointError` listing
    them and leaves everything untouched."""
    tensors, document = _read(Path(path))
    model_tensors = {k.removeprefix("model/"): v for k, v in tensors.items() if k[:6] == "model/"}
    _check_model(model, model_tensors, document.get("tied_weights", {}), path)
    model.load_state_dict(_expand_tied(model_tensors, document.get("tied_weights", {})))
    optimizer.load_state_dict(_join_optimizer_state(document["optimizer"], tensors))
    scheduler.load_state_dict(document["scheduler"])
    torch.set_rng_state(tensors["rng/torch"])
    return TrainingState(step=int(document["step"]), extra=document.get("extra", {}))


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


def _join_optimizer_state(document: dict, tensors: dict[str, torch.Tensor]) -> dict:
    state = {
        int(index): {
            key: tensors[entry["tensor"]] if "tensor" in entry else entry["value"]
            for key, entry in values.items()
        }
        for index, values in document["state"].items()
    }
    return {"state": state, "param_groups": document["param_groups"]}


def _read(path: Path) -> tuple[dict[str, torch.Tensor], dict]:
    from safetensors import SafetensorError, safe_open

    if not path.is_file():
        raise CheckpointError(f"path: {path} does not exist; expected a training checkpoint")
    try:
        with safe_open(str(path), framework="pt") as file:
            metadata = file.metadata() or {}
            tensors = {key: file.get_tensor(key) for key in file.keys()}  # noqa: SIM118
    except (SafetensorError, OSError, ValueError) as error:
        raise CheckpointError(f"path: {path} is not a readable checkpoint: {error}") from error
    document = json.loads(metadata.get("qkv", "{}"))
    if document.get("format") != FORMAT or document.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"path: {path} is not a qkv training checkpoint (format {FORMAT!r} version "
            f"{FORMAT_VERSION}); a model saved with qkv.models.save loads with qkv.models.load"
        )
    return tensors, document


def _check_model(model: nn.Module, tensors: dict, tied: dict, path: str | os.PathLike) -> None:
    expected, _ = unique_tensors(model.state_dict())
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    misshaped = sorted(
        key
        for key in set(expected) & set(tensors)
        if tuple(expected[key].shape) != tuple(tensors[key].shape)
    )
    if missing or unexpected or misshaped:
        raise CheckpointError(
            f"path: {path} does not fit {type(model).__name__}: missing {missing[:10]}, "
            f"unexpected {unexpected[:10]}, mis-shaped {misshaped[:10]}"
        )


def _expand_tied(tensors: dict[str, torch.Tensor], tied: dict[str, str]) -> dict:
    return {**tensors, **{name: tensors[first] for name, first in tied.items()}}
