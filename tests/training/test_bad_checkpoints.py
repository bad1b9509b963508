"""A catalogue of damaged training checkpoints: each is refused by `load_checkpoint` with a
CheckpointError that names the file and what is wrong, and leaves the model untouched.

Each entry is (what is wrong, how the file is damaged, the error expected, its message). Edits
that a corrupted disk could make are written as they are; edits that only a writer with a bug
could make (a key missing from the metadata, a tensor of another dtype) are re-hashed, so that
the check behind the SHA-256 is the one tested."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from qkv.models import CheckpointError
from qkv.training import build_optimizer, build_scheduler, load_checkpoint, save_checkpoint
from qkv.training.checkpoint import HASH_KEY, checkpoint_digest
from qkv.training.tasks import TranslateTask

from .tiny import TINY

MODEL_KEY = "model/source_embedding.weight"
MOMENT_KEY = "optimizer/0/exp_avg"


@pytest.fixture(scope="module")
def task():
    return TranslateTask(TINY)


def _objects(task):
    torch.manual_seed(0)
    model = task.build_model()
    optimizer = build_optimizer(model, learning_rate=1e-3)
    return model, optimizer, build_scheduler(optimizer, warmup_steps=1, total_steps=4)


@pytest.fixture(scope="module")
def good_bytes(task, tmp_path_factory) -> bytes:
    """A checkpoint after one real step, so that the optimizer holds moments and counts."""
    model, optimizer, scheduler = _objects(task)
    task.loss_sums(model, task.collate(list(range(8))))["tokens"].backward()
    optimizer.step()
    scheduler.step()
    path = tmp_path_factory.mktemp("good") / "checkpoint.safetensors"
    save_checkpoint(path, model=model, optimizer=optimizer, scheduler=scheduler, step=1)
    return path.read_bytes()


def _read(path: Path) -> tuple[dict, dict]:
    with safe_open(str(path), framework="pt") as file:
        metadata = dict(file.metadata())
        return {key: file.get_tensor(key) for key in file.keys()}, metadata  # noqa: SIM118


def _rewrite(
    edit_document: Callable[[dict], object] | None = None,
    edit_tensors: Callable[[dict], None] | None = None,
    *,
    rehash: bool = True,
    edit_metadata: Callable[[dict], None] | None = None,
) -> Callable[[Path], None]:
    """A damage: the file written again with its metadata or tensors edited (edit_document
    changes the document in place, or returns the one to write instead)."""

    def damage(path: Path) -> None:
        tensors, metadata = _read(path)
        if edit_document is not None:
            document = json.loads(metadata["qkv"])
            metadata["qkv"] = json.dumps(edit_document(document) or document)
        if edit_tensors is not None:
            edit_tensors(tensors)
        if rehash:
            metadata[HASH_KEY] = checkpoint_digest(tensors, metadata["qkv"])
        if edit_metadata is not None:
            edit_metadata(metadata)
        save_file(tensors, str(path), metadata=metadata)

    return damage


def _flip_tensor_bytes(path: Path) -> None:
    """64 bytes inverted in the middle of the tensor data, as a failing disk could."""
    data = bytearray(path.read_bytes())
    header = 8 + int.from_bytes(data[:8], "little")
    middle = (header + len(data)) // 2
    data[middle : middle + 64] = bytes(255 - b for b in data[middle : middle + 64])
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _pop(key: str):
    def edit(document: dict) -> None:
        del document[key]

    return edit


def _set(key: str, value: object):
    return lambda document: document.update({key: value})


def _retype(key: str, dtype: torch.dtype):
    return lambda tensors: tensors.update({key: tensors[key].to(dtype)})


def _reshape(key: str):
    return lambda tensors: tensors.update({key: torch.zeros(tensors[key].shape[0] + 1)})


def _poison(key: str, value: float):
    def edit(tensors: dict) -> None:
        tensors[key] = tensors[key].clone()
        tensors[key].view(-1)[3] = value

    return edit


def _drop_tensor(key: str):
    def edit(tensors: dict) -> None:
        del tensors[key]

    return edit


def _edit_optimizer(change: Callable[[dict], object]):
    def edit(document: dict) -> None:
        change(document["optimizer"])

    return edit


CATALOGUE = [
    ("64 bytes of tensor data flipped", _flip_tensor_bytes, CheckpointError,
     r"does not match its SHA-256"),
    ("the file cut in half", _truncate, CheckpointError, r"not a readable checkpoint"),
    ("the metadata edited, hash not updated", _rewrite(_set("step", 3), rehash=False),
     CheckpointError, r"does not match its SHA-256"),
    ("the hash removed", _rewrite(edit_metadata=lambda m: m.pop(HASH_KEY)), CheckpointError,
     r"carries no SHA-256"),
    ("the metadata not JSON", _rewrite(edit_metadata=lambda m: m.update(qkv="{step: 1")),
     CheckpointError, r"metadata is not valid JSON"),
    ("the metadata a list", _rewrite(lambda d: [d]), CheckpointError,
     r"metadata is a list; expected a JSON object"),
    ("format_version of another qkv", _rewrite(_set("format_version", 1)), CheckpointError,
     r"format_version 1; this qkv reads version 2"),
    ("no 'optimizer'", _rewrite(_pop("optimizer")), CheckpointError, r"no 'optimizer'"),
    ("no 'scheduler'", _rewrite(_pop("scheduler")), CheckpointError, r"no 'scheduler'"),
    ("no 'step'", _rewrite(_pop("step")), CheckpointError, r"no 'step'"),
    ("step -5", _rewrite(_set("step", -5)), CheckpointError, r"step: expected an int >= 0, got -5"),
    ("step a string", _rewrite(_set("step", "3")), CheckpointError,
     r"step: expected an int >= 0, got '3'"),
    ("scheduler a number", _rewrite(_set("scheduler", 7)), CheckpointError,
     r"'scheduler' is int; expected a JSON object"),
    ("scheduler of another kind", _rewrite(_set("scheduler", {"gamma": 0.5})), CheckpointError,
     r"scheduler state has keys \['gamma'\]"),
    ("no RNG state", _rewrite(edit_tensors=_drop_tensor("rng/torch")), CheckpointError,
     r"rng/torch"),
    ("RNG state of another dtype", _rewrite(edit_tensors=_retype("rng/torch", torch.int32)),
     CheckpointError, r"rng/torch.*torch.int32"),
    ("a model tensor stored as int32", _rewrite(edit_tensors=_retype(MODEL_KEY, torch.int32)),
     CheckpointError, r"mis-typed.*source_embedding.weight: file torch.int32, model torch.float32"),
    ("a model tensor of another shape", _rewrite(edit_tensors=_reshape(MODEL_KEY)),
     CheckpointError, r"mis-shaped.*source_embedding.weight"),
    ("a NaN weight", _rewrite(edit_tensors=_poison(MODEL_KEY, float("nan"))), CheckpointError,
     r"holds values that are not finite \(model/source_embedding.weight\); it is no state"),
    ("an infinite moment", _rewrite(edit_tensors=_poison(MOMENT_KEY, float("inf"))),
     CheckpointError, r"not finite \(optimizer/0/exp_avg\)"),
    ("a model tensor missing", _rewrite(edit_tensors=_drop_tensor(MODEL_KEY)), CheckpointError,
     r"missing.*source_embedding.weight"),
    ("an optimizer moment of another shape", _rewrite(edit_tensors=_reshape(MOMENT_KEY)),
     CheckpointError, r"optimizer/0/exp_avg: shape \(61,\).*expected \(60, 32\)"),
    ("an optimizer moment stored as int32", _rewrite(edit_tensors=_retype(MOMENT_KEY, torch.int32)),
     CheckpointError, r"optimizer/0/exp_avg: .*torch.int32.*expected .*torch.float32"),
    ("an optimizer step count stored as int64",
     _rewrite(edit_tensors=_retype("optimizer/0/step", torch.int64)), CheckpointError,
     r"optimizer/0/step: .*torch.int64.*expected a floating 0-d"),
    ("an optimizer tensor missing", _rewrite(edit_tensors=_drop_tensor(MOMENT_KEY)),
     CheckpointError, r"optimizer/0/exp_avg.*not in the file"),
    ("optimizer state for a parameter that does not exist",
     _rewrite(_edit_optimizer(lambda o: o["state"].update({"999": o["state"]["0"]}))),
     CheckpointError, r"optimizer state for parameter '999'"),
    ("optimizer parameter groups of other sizes",
     _rewrite(_edit_optimizer(lambda o: o["param_groups"][0]["params"].pop())),
     CheckpointError, r"parameter groups of sizes"),
    ("optimizer without param_groups", _rewrite(_edit_optimizer(lambda o: o.pop("param_groups"))),
     CheckpointError, r"'optimizer' needs 'state' and 'param_groups'"),
    ("tied weights naming a missing tensor",
     _rewrite(_set("tied_weights", {"lm_head.weight": "nothing.weight"})), CheckpointError,
     r"tied_weights"),
]  # fmt: skip


@pytest.mark.parametrize(
    "damage, error, message",
    [entry[1:] for entry in CATALOGUE],
    ids=[entry[0] for entry in CATALOGUE],
)
def test_a_damaged_checkpoint_is_refused_by_name_and_changes_nothing(
    task, good_bytes, tmp_path, damage, error, message
):
    path = tmp_path / "checkpoint.safetensors"
    path.write_bytes(good_bytes)
    damage(path)
    model, optimizer, scheduler = _objects(task)
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    with pytest.raises(error, match=message) as caught:
        load_checkpoint(path, model=model, optimizer=optimizer, scheduler=scheduler)
    assert str(path) in str(caught.value)
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, before[name]), name
    assert optimizer.state_dict()["state"] == {}  # nothing loaded into the optimizer either
    assert scheduler.last_epoch == 0


def test_the_undamaged_checkpoint_loads(task, good_bytes, tmp_path):
    """The catalogue's damages are what fails: the same file, untouched or re-hashed as is,
    loads."""
    path = tmp_path / "checkpoint.safetensors"
    path.write_bytes(good_bytes)
    _rewrite()(path)
    model, optimizer, scheduler = _objects(task)
    state = load_checkpoint(path, model=model, optimizer=optimizer, scheduler=scheduler)
    assert state.step == 1 and scheduler.last_epoch == 1
    assert set(optimizer.state_dict()["state"]) == set(range(len(list(model.parameters()))))
