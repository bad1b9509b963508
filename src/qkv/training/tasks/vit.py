"""The `vit` task: a Vision Transformer learns the 8x8 handwritten digits scikit-learn ships.

The 1,797 digits (`qkv.data.load_digits`) are split by class into training, validation and
test sets (`qkv.data.split_digits`, seeded by data_seed). Each 8x8 image is cut into patches of
patch_size pixels (2: a 4 x 4 grid of 16 patch tokens) and classified by `qkv.models.ViT`
(Dosovitskiy et al. 2021): pre-norm encoder blocks, then the [class] token, the mean of the
patch tokens, or learned queries (Jaegle et al. 2021) read by a linear head. The loss is the
summed cross-entropy of the ten classes.

The defaults train on the images as they are: with 2 x 2 patches, a shift of one pixel moves
every stroke to another place in its patch, and such shifted digits slow the learning more than
they help in a short run. `max_shift` > 0 moves each training image by a random whole number of
pixels in [-max_shift, max_shift] along each axis (`qkv.data.shift_images`), a fresh draw at
every step, seeded by (data_seed, step). Evaluation reports the loss and accuracy on the
validation set and the accuracy on the held-out test set, on unshifted images.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import ClassVar

import torch
import torch.nn.functional as F

from qkv.data import digit_splits, shift_images
from qkv.models import ViT, ViTConfig, save
from qkv.models.vit_config import POOLING_KINDS, VIT_POSITION_KINDS
from qkv.validation import check_choice

__all__ = ["VitOptions", "VitTask"]

TASK_FILE = "task.json"
_EVAL_BATCH = 512


@dataclass(frozen=True)
class VitOptions:
    """Data and model sizes of the vit task (`qkv train vit --help`)."""

    patch_size: int = 2
    embed_dim: int = 64
    num_layers: int = 4
    num_heads: int = 4
    ffn_dim: int = 128
    pooling: str = "cls"  # "cls", "mean" or "latent"
    position: str = "learned"  # "learned" or "sinusoidal2d"
    num_latents: int = 4
    latent_blocks: int = 0
    dropout: float = 0.1
    max_shift: int = 0  # augmentation: random shifts of up to this many pixels
    valid_fraction: float = 0.1
    test_fraction: float = 0.2
    data_seed: int = 0  # which digits go to validation and test, and the shifts drawn

    FLAG_HELP: ClassVar[dict[str, str]] = {
        "patch_size": "side of the square patches the 8x8 digits are cut into",
        "num_layers": "encoder blocks",
        "pooling": "what the head reads: 'cls' (a [class] token), 'mean' (of the patch tokens) "
        "or 'latent' (learned queries cross-attending to the patch tokens)",
        "position": "'learned' position embeddings or fixed 'sinusoidal2d' ones (half the "
        "channels per axis)",
        "num_latents": "learned queries of --pooling latent",
        "latent_blocks": "self-attention blocks over the latents of --pooling latent",
        "max_shift": "training images move by up to this many pixels per axis (0: no shifts)",
        "valid_fraction": "share of each digit held out for validation",
        "test_fraction": "share of each digit held out for the test",
        "data_seed": "seed of the data split and of the shifts drawn",
    }


class VitTask:
    """Digits, augmentation and model of the vit task; see the module docstring."""

    name = "vit"
    # `qkv train vit` defaults: reach >= 97% test accuracy in a few CPU minutes.
    training_defaults = {
        "steps": 1500, "batch_size": 64, "learning_rate": 3e-3, "schedule": "cosine",
        "weight_decay": 0.05, "warmup_fraction": 0.05,
    }  # fmt: skip

    def __init__(self, options: VitOptions = VitOptions()) -> None:
        check_choice("pooling", options.pooling, POOLING_KINDS)
        check_choice("position", options.position, VIT_POSITION_KINDS)
        self.options = options
        self.config = self._config()  # checks the sizes before the data is read
        splits = digit_splits(
            valid_fraction=options.valid_fraction, test_fraction=options.test_fraction,
            seed=options.data_seed,
        )  # fmt: skip
        self.train_set, self.valid_set, self.test_set = splits.train, splits.valid, splits.test

    def __len__(self) -> int:
        return len(self.train_set)

    def describe(self) -> dict:
        return {"name": self.name, **asdict(self.options)}

    def _config(self) -> ViTConfig:
        options = self.options
        return ViTConfig.from_name(
            "vit-digits", patch_size=options.patch_size, embed_dim=options.embed_dim,
            num_layers=options.num_layers, num_heads=options.num_heads,
            ffn_dim=options.ffn_dim, pooling=options.pooling, position=options.position,
            num_latents=options.num_latents, latent_blocks=options.latent_blocks,
            dropout=options.dropout,
        )  # fmt: skip

    def build_model(self) -> ViT:
        return ViT(self.config)

    def collate(self, indices: list[int], *, step: int = 0) -> dict[str, torch.Tensor]:
        """{"images": (B, 1, 8, 8) shifted at random, "labels": (B,)}; the shifts are a pure
        function of (data_seed, step), so a resumed run draws the same ones."""
        index = torch.tensor(indices, dtype=torch.long)
        generator = torch.Generator().manual_seed(self.options.data_seed * 1_000_003 + step)
        images = shift_images(
            self.train_set.images[index], max_shift=self.options.max_shift, generator=generator
        )
        return {"images": images, "labels": self.train_set.labels[index]}

    def counts(self, batch: dict[str, torch.Tensor]) -> dict[str, int]:
        return {"images": len(batch["labels"])}

    def num_tokens(self, batch: dict[str, torch.Tensor]) -> int:
        return len(batch["labels"]) * self.config.num_tokens

    def loss_sums(self, model, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The cross-entropy of the batch's images, summed (in fp32)."""
        logits = model(batch["images"]).logits  # (B, 10)
        return {"images": F.cross_entropy(logits.float(), batch["labels"], reduction="sum")}

    @torch.no_grad()
    def evaluate(self, model: ViT) -> dict[str, float]:
        """Validation loss and accuracy, and test accuracy, on unshifted images. Call it with
        the model in eval mode."""
        valid_loss, valid_accuracy = _loss_and_accuracy(model, self.valid_set)
        _, test_accuracy = _loss_and_accuracy(model, self.test_set)
        return {
            "valid_loss": valid_loss,
            "valid_accuracy": valid_accuracy,
            "test_accuracy": test_accuracy,
        }

    def save(self, model: ViT, path: str | os.PathLike) -> Path:
        """The model as a qkv checkpoint (`qkv.models.load` reads it), task.json beside it."""
        path = save(model, path)
        (path / TASK_FILE).write_text(json.dumps(self.describe(), indent=2) + "\n")
        return path


def _loss_and_accuracy(model: ViT, data) -> tuple[float, float]:
    """Mean cross-entropy and share of correct predictions over `data` (LabelledImages)."""
    device = next(model.parameters()).device
    total, correct = 0.0, 0
    for start in range(0, len(data), _EVAL_BATCH):
        images = data.images[start : start + _EVAL_BATCH].to(device)
        labels = data.labels[start : start + _EVAL_BATCH].to(device)
        logits = model(images).logits.float()  # (b, 10)
        total += float(F.cross_entropy(logits, labels, reduction="sum"))
        correct += int((logits.argmax(dim=-1) == labels).sum())
    return total / max(len(data), 1), correct / max(len(data), 1)
