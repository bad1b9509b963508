"""Training losses over sequences of token predictions.

Cross-entropy is PyTorch's `F.cross_entropy`, taken in fp32 whatever the logits' dtype, as a
mean over the labelled positions (targets of -100 are skipped). A faster backward for the CPU,
which needs no new (tokens, V) buffer, is swapped in from outside
(`qkv.acceleration.fused_losses`).

Label smoothing (Szegedy et al. 2016; Vaswani et al. 2017 section 5.4, eps_ls = 0.1) trains
against (1 - eps) * one_hot(y) + eps / V instead of one_hot(y): the model is pushed to be less
sure of itself, which "hurts perplexity ... but improves accuracy and BLEU score".
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from qkv.validation import check_probability

__all__ = ["IGNORE_INDEX", "cross_entropy", "sequence_cross_entropy"]

IGNORE_INDEX = -100  # a label that is not predicted (padding), as in PyTorch and Hugging Face


def sequence_cross_entropy(
    logits: torch.Tensor, labels: torch.Tensor, *, label_smoothing: float = 0.0
) -> torch.Tensor:
    """Mean cross-entropy over the labelled positions: logits (B, L, V), labels (B, L).

    Labels equal to -100 are skipped. The same value as `F.cross_entropy(logits.view(-1, V),
    labels.view(-1), ignore_index=-100, label_smoothing=eps)`, computed in fp32 whatever the
    logits' dtype, except that a batch with no labelled position gives 0 (and zero gradients)
    instead of NaN. Returns a scalar tensor.
    """
    _check(logits, labels)
    check_probability("label_smoothing", label_smoothing)
    V = logits.shape[-1]
    return cross_entropy(
        logits.reshape(-1, V),  # (B * L, V)
        labels.reshape(-1),  # (B * L,)
        label_smoothing=label_smoothing,
    )


def cross_entropy(
    logits: torch.Tensor, targets: torch.Tensor, *, label_smoothing: float = 0.0
) -> torch.Tensor:
    """Mean cross-entropy of logits (N, V) against targets (N,), skipping targets == -100.

    `F.cross_entropy(logits.float(), targets, ignore_index=-100, label_smoothing=eps)`, as
    the sum over the labelled targets divided by their count, so that no labelled target gives
    0 (and zero gradients) instead of NaN. Returns a float32 scalar tensor.
    """
    total = F.cross_entropy(
        logits.float(),
        targets,
        ignore_index=IGNORE_INDEX,
        reduction="sum",
        label_smoothing=float(label_smoothing),
    )
    count = (targets != IGNORE_INDEX).sum().clamp(min=1)  # a tensor: no read back to the host
    return total / count


def _check(logits: torch.Tensor, labels: torch.Tensor) -> None:
    if not isinstance(logits, torch.Tensor) or not logits.is_floating_point():
        raise TypeError(f"logits: expected a floating-point tensor, got {_describe(logits)}")
    if (
        not isinstance(labels, torch.Tensor)
        or labels.is_floating_point()
        or labels.is_complex()
        or labels.dtype == torch.bool
    ):
        raise TypeError(f"labels: expected an integer tensor, got {_describe(labels)}")
    if logits.dim() != 3 or tuple(labels.shape) != tuple(logits.shape[:2]):
        raise ValueError(
            f"labels: expected shape (B, L) = {tuple(logits.shape[:2])} for logits (B, L, V) "
            f"of shape {tuple(logits.shape)}, got {tuple(labels.shape)}"
        )
    real = labels[labels != IGNORE_INDEX]
    V = logits.shape[-1]
    if real.numel() and (int(real.min()) < 0 or int(real.max()) >= V):
        raise ValueError(
            f"labels: expected token ids in [0, {V}) or {IGNORE_INDEX}, got values in "
            f"[{int(real.min())}, {int(real.max())}]"
        )


def _describe(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"dtype {value.dtype}, shape {tuple(value.shape)}"
    return type(value).__name__
