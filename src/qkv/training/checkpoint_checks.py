"""What a training checkpoint must hold before any of it is loaded.

`qkv.training.checkpoint.load_checkpoint` reads the file, checks its SHA-256, then calls these:
the JSON document's keys and types, then every tensor against the object it goes into. A model
tensor must have the name, shape and dtype of the model's own (`load_state_dict` would cast an
int32 file to float silently); an optimizer state tensor the shape and dtype of its parameter,
or, for a step count, be a floating scalar (torch's Adam/AdamW keep `step` as a float tensor,
and `Optimizer.load_state_dict` casts moments to the parameter's dtype silently too). Each
failure is one CheckpointError naming the file, raised before anything is changed.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import torch
from torch import nn

from qkv.models.checkpoints.core import CheckpointError
from qkv.models.safetensors_io import unique_tensors

__all__ = [
    "check_document",
    "check_scheduler",
    "model_state",
    "optimizer_state",
    "parse_document",
    "rng_state",
]

# the document keys that hold a JSON object
_OBJECTS = ("tied_weights", "optimizer", "scheduler", "extra")


def parse_document(path: Path, text: str, format_name: str, version: int) -> dict:
    """The metadata's JSON document, if it is one of ours and of this version."""
    try:
        document = json.loads(text)
    except json.JSONDecodeError as error:
        raise CheckpointError(f"path: {path}: the metadata is not valid JSON: {error}") from error
    if not isinstance(document, dict):
        raise CheckpointError(
            f"path: {path}: the metadata is a {type(document).__name__}; expected a JSON object"
        )
    if document.get("format") != format_name:
        raise CheckpointError(
            f"path: {path} is not a qkv training checkpoint (format {format_name!r}); a model "
            f"saved with qkv.models.save loads with qkv.models.load"
        )
    if document.get("format_version") != version:
        raise CheckpointError(
            f"path: {path} has format_version {document.get('format_version')!r}; this qkv "
            f"reads version {version}. Start the run again in another folder"
        )
    return document


def check_document(path: Path, document: dict) -> None:
    """Every key save_checkpoint writes, with its type."""
    for key in ("step", *_OBJECTS):
        if key not in document:
            raise CheckpointError(
                f"path: {path}: the metadata has no {key!r}; expected the keys save_checkpoint "
                f"writes: {['step', *_OBJECTS]}"
            )
    step = document["step"]
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise CheckpointError(f"path: {path}: step: expected an int >= 0, got {step!r}")
    for key in _OBJECTS:
        if not isinstance(document[key], dict):
            raise CheckpointError(
                f"path: {path}: {key!r} is {type(document[key]).__name__}; expected a JSON object"
            )


def finite(path: Path, tensors: dict) -> None:
    """Every floating-point tensor of the model and the optimizer must be finite: training
    never writes a NaN or inf state (qkv.training.loop checks the weights first), so such a
    file is no "last good state" to resume from."""
    bad = [
        name
        for name, tensor in sorted(tensors.items())
        if name.startswith(("model/", "optimizer/"))
        and tensor.is_floating_point()
        and not torch.isfinite(tensor).all()
    ]
    if bad:
        raise CheckpointError(
            f"path: {path} holds values that are not finite ({', '.join(bad[:5])}); it is no "
            f"state a run can go on from. Resume from a copy made before, or start again "
            f"(--overwrite)"
        )


def model_state(path: Path, model: nn.Module, tensors: dict, tied: dict) -> dict:
    """The model's state dict from the file's "model/" tensors, once names, ties, shapes and
    dtypes all fit."""
    found = {key[6:]: value for key, value in tensors.items() if key.startswith("model/")}
    expected, model_tied = unique_tensors(model.state_dict())
    both = sorted(set(expected) & set(found))
    problems = {
        "missing": sorted(set(expected) - set(found)),
        "unexpected": sorted(set(found) - set(expected)),
        "mis-shaped": [
            f"{key}: file {tuple(found[key].shape)}, model {tuple(expected[key].shape)}"
            for key in both
            if found[key].shape != expected[key].shape
        ],
        "mis-typed": [
            f"{key}: file {found[key].dtype}, model {expected[key].dtype}"
            for key in both
            if found[key].dtype != expected[key].dtype
        ],
    }
    if any(problems.values()):
        listed = "; ".join(f"{label} {keys[:10]}" for label, keys in problems.items() if keys)
        raise CheckpointError(f"path: {path} does not fit {type(model).__name__}: {listed}")
    if tied != model_tied:
        raise CheckpointError(
            f"path: {path}: tied_weights {tied} differ from the ties of "
            f"{type(model).__name__}, {model_tied}"
        )
    return {**found, **{name: found[first] for name, first in tied.items()}}


def optimizer_state(
    path: Path, optimizer: torch.optim.Optimizer, document: dict, tensors: dict
) -> dict:
    """The optimizer's state dict from the document and the "optimizer/" tensors, each tensor
    checked against the parameter it belongs to."""
    groups, state = document.get("param_groups"), document.get("state")
    if not (isinstance(groups, list) and isinstance(state, dict)) or not all(
        isinstance(group, dict) and isinstance(group.get("params"), list) for group in groups
    ):
        raise CheckpointError(
            f"path: {path}: 'optimizer' needs 'state' and 'param_groups' objects; got keys "
            f"{sorted(document)}"
        )
    saved_sizes = [len(group["params"]) for group in groups]
    sizes = [len(group["params"]) for group in optimizer.param_groups]
    if saved_sizes != sizes:
        raise CheckpointError(
            f"path: {path}: the optimizer state has parameter groups of sizes {saved_sizes}; "
            f"this optimizer's are {sizes}"
        )
    parameters = dict(
        zip(
            (str(index) for group in groups for index in group["params"]),
            itertools.chain.from_iterable(group["params"] for group in optimizer.param_groups),
            strict=True,
        )
    )
    loaded = {}
    for index, values in state.items():
        if index not in parameters or not isinstance(values, dict):
            raise CheckpointError(
                f"path: {path}: optimizer state for parameter {index!r}, which its param_groups "
                f"do not list (or which is not an object)"
            )
        loaded[int(index)] = {
            key: _state_value(path, entry, key, parameters[index], tensors)
            for key, entry in values.items()
        }
    return {"state": loaded, "param_groups": groups}


def _state_value(path: Path, entry: object, key: str, parameter: torch.Tensor, tensors: dict):
    if isinstance(entry, dict) and "value" in entry:
        return entry["value"]
    name = entry.get("tensor") if isinstance(entry, dict) else None
    if name not in tensors:
        raise CheckpointError(
            f"path: {path}: the optimizer state names tensor {name!r}, which is not in the file"
        )
    tensor = tensors[name]
    seen = f"shape {tuple(tensor.shape)}, dtype {tensor.dtype}"
    if key == "step":
        if tensor.dim() != 0 or not tensor.is_floating_point():
            raise CheckpointError(
                f"path: {path}: {name}: {seen}; expected a floating 0-d tensor (a step count)"
            )
    elif tensor.shape != parameter.shape or tensor.dtype != parameter.dtype:
        raise CheckpointError(
            f"path: {path}: {name}: {seen}; expected {tuple(parameter.shape)}, "
            f"{parameter.dtype}, like its parameter"
        )
    return tensor


def check_scheduler(
    path: Path, scheduler: torch.optim.lr_scheduler.LRScheduler, state: dict
) -> None:
    """The keys any torch scheduler keeps, with their types. Other keys are not compared:
    they vary with the torch release, and load_state_dict sets them as they come."""
    groups = len(scheduler.optimizer.param_groups)
    last_epoch, base_lrs = state.get("last_epoch"), state.get("base_lrs")
    if not (
        isinstance(last_epoch, int)
        and not isinstance(last_epoch, bool)
        and last_epoch >= 0
        and isinstance(base_lrs, list)
        and len(base_lrs) == groups
    ):
        raise CheckpointError(
            f"path: {path}: the scheduler state has keys {sorted(state)[:10]}; expected "
            f"'last_epoch' (an int >= 0, got {last_epoch!r}) and 'base_lrs' (one per parameter "
            f"group, {groups})"
        )


def rng_state(path: Path, tensors: dict) -> torch.Tensor:
    """The saved CPU generator state, which must look like this torch's own."""
    own = torch.get_rng_state()
    if "rng/torch" not in tensors:
        raise CheckpointError(
            f"path: {path} has no tensor 'rng/torch' (the random number generator's state)"
        )
    saved = tensors["rng/torch"]
    if saved.dtype != own.dtype or saved.shape != own.shape:
        raise CheckpointError(
            f"path: {path}: rng/torch: expected a {own.dtype} tensor of shape "
            f"{tuple(own.shape)}, got {saved.dtype} {tuple(saved.shape)}"
        )
    return saved
