"""The vit task: its loss is PyTorch's cross-entropy, its accuracy scikit-learn's, its shifts
reproducible, and `qkv train vit` end to end gives a model folder `qkv.models.load` reads."""

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F
from sklearn.metrics import accuracy_score

from qkv.cli import main
from qkv.models import ViT, load
from qkv.training.tasks import TASKS, VitOptions, VitTask

TINY = VitOptions(patch_size=4, embed_dim=16, num_layers=1, num_heads=2, ffn_dim=32,
                  dropout=0.0)  # fmt: skip
TINY_FLAGS = ["--patch-size", "4", "--embed-dim", "16", "--num-layers", "1", "--num-heads", "2",
              "--ffn-dim", "32", "--dropout", "0", "--threads", "1"]  # fmt: skip


@pytest.fixture(scope="module")
def task():
    return VitTask(TINY)


def test_registered_as_vit():
    assert TASKS["vit"] == (VitTask, VitOptions)


def test_loss_sum_over_count_is_pytorchs_mean_cross_entropy(task):
    torch.manual_seed(0)
    model = task.build_model().eval()
    assert isinstance(model, ViT) and model.config.grid == (2, 2)
    batch = task.collate([0, 3, 7, 11], step=0)
    assert batch["images"].shape == (4, 1, 8, 8) and task.counts(batch) == {"images": 4}
    expected = F.cross_entropy(model(batch["images"]).logits, batch["labels"])
    torch.testing.assert_close(task.loss_sums(model, batch)["images"] / 4, expected)
    assert task.num_tokens(batch) == 4 * 5  # 4 patches and the [class] token per image


def test_collate_shifts_are_a_function_of_the_step(task):
    plain = task.collate([1, 2], step=5)
    assert torch.equal(plain["images"], task.train_set.images[[1, 2]])  # max_shift=0: as is
    shifting = VitTask(dataclasses.replace(TINY, max_shift=1))
    indices = list(range(32))
    first = shifting.collate(indices, step=5)["images"]
    assert torch.equal(first, shifting.collate(indices, step=5)["images"])
    assert not torch.equal(first, shifting.collate(indices, step=6)["images"])
    originals = shifting.train_set.images[:32]
    assert not torch.equal(first, originals)
    # a shift only moves ink: the total of each image can only drop (at the border)
    assert torch.all(first.sum(dim=(1, 2, 3)) <= originals.sum(dim=(1, 2, 3)) + 1e-5)


def test_accuracy_is_scikit_learns(task):
    torch.manual_seed(1)
    model = task.build_model().eval()
    metrics = task.evaluate(model)
    with torch.no_grad():
        predicted = model(task.test_set.images).logits.argmax(-1)
    assert metrics["test_accuracy"] == pytest.approx(
        accuracy_score(task.test_set.labels.numpy(), predicted.numpy())
    )
    with torch.no_grad():
        logits = model(task.valid_set.images).logits
    expected = float(F.cross_entropy(logits, task.valid_set.labels))
    assert metrics["valid_loss"] == pytest.approx(expected, rel=1e-5)


def test_train_vit_from_the_command_line(tmp_path, capsys):
    out = tmp_path / "run"
    flags = [*TINY_FLAGS, "--steps", "3", "--batch-size", "16", "--pooling", "latent",
             "--position", "sinusoidal2d", "--out", str(out)]  # fmt: skip
    assert main(["train", "vit", *flags]) == 0
    captured = capsys.readouterr()
    assert "step 3/3" in captured.err and "test_accuracy:" in captured.out
    summary = json.loads((out / "summary.json").read_text())
    assert summary["task"] == "vit" and 0.0 <= summary["metrics"]["test_accuracy"] <= 1.0
    model = load(out / "model")
    assert isinstance(model, ViT) and model.config.pooling == "latent"
    assert json.loads((out / "model" / "task.json").read_text())["position"] == "sinusoidal2d"


def test_bad_options_are_clear_errors(tmp_path, capsys):
    assert main(["train", "vit", "--pooling", "max", "--out", str(tmp_path)]) == 1
    assert (
        "pooling: expected one of ('cls', 'mean', 'latent'), got 'max'" in capsys.readouterr().err
    )
    assert main(["train", "vit", "--patch-size", "3", "--out", str(tmp_path)]) == 1
    assert "patch_size: 3 does not divide image_size=8" in capsys.readouterr().err
