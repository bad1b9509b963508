"""A diverging run stops at the first NaN or inf, before it can do harm (`qkv.training.loop`).

After backward the step's loss is checked (`check_loss`), then the gradient's global norm, the
one clipping computes or computed for the check when clip_norm is None
(`clip_and_check_gradient`): NaN or inf stops the run with `LossNotFiniteError`
(`GradientNotFiniteError` for a finite loss with a poisoned gradient) before the optimizer
touches the weights, rather than skipping the step (which would make the run silently differ
from the one its options describe, and hide an overflow that comes back). Before an evaluation
or a checkpoint the weights are checked finite too (`check_weights`), so the checkpoint on disk
is always the last good state.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from torch import nn

from qkv.training import sharded
from qkv.training.checkpoint import CHECKPOINT_NAME
from qkv.training.distributed import Distributed, all_reduce_sum

__all__ = [
    "GradientNotFiniteError",
    "LossNotFiniteError",
    "check_loss",
    "check_weights",
    "clip_and_check_gradient",
]


class LossNotFiniteError(RuntimeError):
    """The loss (or the gradient, or the weights) became NaN or inf; the run stopped before the
    failing step updated the weights, or before non-finite weights reached a checkpoint."""


class GradientNotFiniteError(LossNotFiniteError):
    """The loss was finite but its gradient was not; a LossNotFiniteError, so that one
    `except` stops on both."""


def check_loss(loss_terms: dict[str, float], step: int, out_dir: Path) -> None:
    """Stop before the optimizer step on a NaN or inf loss."""
    if not all(math.isfinite(value) for value in loss_terms.values()):
        raise LossNotFiniteError(
            f"step {step + 1}: the loss is {loss_terms['loss']} (not finite); the run stopped "
            f"before updating the weights, and {out_dir / CHECKPOINT_NAME} (if any) is the last "
            f"good state. Lower the learning rate, raise warmup_steps or set clip_norm."
        )


def clip_and_check_gradient(
    model: nn.Module, clip_norm: float | None, step: int, out_dir: Path
) -> None:
    """Clip the gradient's global L2 norm to clip_norm (if set); stop on a NaN or inf norm
    before the optimizer step (clipping a NaN gradient leaves it NaN)."""
    if clip_norm is not None:
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip_norm)
    else:
        gradients = [p.grad for p in model.parameters() if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(gradients)
    value = float(sharded.full(norm))
    if not math.isfinite(value):
        raise GradientNotFiniteError(
            f"step {step + 1}: the gradient's norm is {value} (not finite) while the loss is "
            f"finite; the run stopped before updating the weights, and "
            f"{out_dir / CHECKPOINT_NAME} (if any) is the last good state. Look for an op whose "
            f"backward overflows or divides by zero (bf16, sqrt or log near 0, a custom kernel)"
        )


def check_weights(model: nn.Module, done: int, out_dir: Path, context: Distributed) -> None:
    """Non-finite weights (an optimizer overflow) never overwrite the last good checkpoint.
    Each process checks its part (all of it, or its shards) and they agree on the verdict."""
    named = list(model.named_parameters())
    flags = torch.stack([(~torch.isfinite(sharded.local(p))).any().double() for _, p in named])
    found = all_reduce_sum(flags, context).tolist()
    bad = [name for (name, _), count in zip(named, found, strict=True) if count]
    if bad:
        raise LossNotFiniteError(
            f"the weights after step {done} are not finite ({', '.join(bad[:5])}); they were not "
            f"written, and {out_dir / CHECKPOINT_NAME} (if any) is the last good state. Lower "
            f"the learning rate, raise warmup_steps or set clip_norm"
        )
