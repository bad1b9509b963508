"""Training losses over sequences of token predictions.

Label smoothing (Szegedy et al. 2016; Vaswani et al. 2017 section 5.4, eps_ls = 0.1) trains
against (1 - eps) * one_hot(y) + eps / V instead of one_hot(y): the model is pushed to be less
sure of itself, which "hurts perplexity ... but improves accuracy and BLEU score".

`cross_entropy` is F.cross_entropy with a fused backward. Over a language model's vocabulary the
(tokens, V) tensors of the loss are the largest of a training step (4096 x 32000 fp32 = 524 MB
for the 50M Llama at B = 8, L = 512), and PyTorch's backward makes two more of them: a zero
gradient for nll_loss to scatter into, then log_softmax's backward. Here the gradient,
softmax(logits) - target distribution, is written into the saved log-probabilities in place:
no new (tokens, V) buffer, two passes instead of four, and no page faults for a fresh buffer
of that size (a measurably faster forward + backward on the CPU; see benchmarks/models.py).
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

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

    The value and gradient of `F.cross_entropy(logits.float(), targets, ignore_index=-100,
    label_smoothing=eps)` (tested), computed in fp32, except that no labelled target gives 0
    (and zero gradients) instead of NaN. The backward reuses the saved log-probabilities as its
    output (see the module docstring), so it runs once: a second backward through the same
    graph (retain_graph=True) raises PyTorch's "modified by an inplace operation" error, and
    the loss is not twice differentiable.
    """
    return _CrossEntropy.apply(logits.float(), targets, float(label_smoothing))


class _CrossEntropy(torch.autograd.Function):
    """loss = sum over labelled rows of [(1 - eps) * -log p(y) + eps * mean_j -log p(j)] / count;
    d loss / d logits = (softmax - eps / V - (1 - eps) * one_hot(y)) / count on labelled rows."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, smoothing: float):
        log_probs = torch.log_softmax(logits, dim=-1)  # (N, V)
        labelled = targets != IGNORE_INDEX  # (N,)
        safe_targets = torch.where(labelled, targets, 0)  # any id for the unlabelled rows
        per_row = -log_probs.gather(1, safe_targets[:, None]).squeeze(1)  # (N,): -log p(y)
        if smoothing:
            per_row = (1.0 - smoothing) * per_row - smoothing * log_probs.mean(dim=-1)
        count = labelled.sum().clamp(min=1)
        ctx.save_for_backward(log_probs, safe_targets, labelled, count)
        ctx.smoothing = smoothing
        return torch.where(labelled, per_row, 0.0).sum() / count

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss: torch.Tensor):
        log_probs, safe_targets, labelled, count = ctx.saved_tensors
        row_scale = torch.where(labelled, grad_loss / count, 0.0)[:, None]  # (N, 1)
        grad = log_probs.exp_()  # (N, V) softmax, in place: the log-probs are not needed again
        if ctx.smoothing:
            grad.sub_(ctx.smoothing / grad.shape[-1])
        grad.mul_(row_scale)
        grad.scatter_add_(1, safe_targets[:, None], -(1.0 - ctx.smoothing) * row_scale)
        return grad, None, None


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
