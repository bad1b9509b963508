"""`fused_losses(model)`: inside the block, `F.cross_entropy` on what `model` returns (its logits,
or views of them) runs with a fused backward (`fused_cross_entropy`), whoever calls it: a
training task, or a user's loop.

Over a language model's vocabulary the (N, V) tensors of the loss are the largest of a training
step, and PyTorch's backward makes two more of them: a zero gradient for nll_loss to scatter
into, then log_softmax's backward. Here the gradient, softmax(logits) - the target distribution,
is written into the saved log-probabilities in place: no new (N, V) buffer, and two passes over
it instead of four.

The value is F.cross_entropy's (class-index targets, `ignore_index`, `label_smoothing`, mean or
sum; Szegedy et al. 2016 for the smoothing), and so is the gradient, up to float rounding.
Because the backward reuses the saved log-probabilities, it runs once: a second backward
through the same loss (retain_graph=True) raises PyTorch's "modified by an inplace operation"
error, and the loss is not twice differentiable.

How the loss is reached: a forward hook on the model hands out its floating-point CPU outputs
that need a gradient as `LossInput` tensors, a subclass whose `__torch_function__` sends the
F.cross_entropy calls it serves (CPU float32 logits (N, V), class indices (N,), no class
weights, reduction "mean" or "sum") to `fused_cross_entropy`. Only the few ops on those outputs
pass through Python; the model's own ops, and a loss it computes itself from labels, do not.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

__all__ = ["LossInput", "fused_cross_entropy", "fused_losses"]

_SIGNATURE = inspect.signature(F.cross_entropy)


def fused_cross_entropy(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
) -> torch.Tensor:
    """F.cross_entropy(logits, targets, ignore_index=..., reduction=..., label_smoothing=...)
    for logits (N, V) and class indices (N,), with the fused backward of the module doc.

    reduction "mean" divides by the number of targets that are not `ignore_index` (NaN when
    there is none, as F.cross_entropy gives), "sum" does not. Returns a scalar in logits' dtype.
    """
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction: expected 'mean' or 'sum', got {reduction!r}")
    if logits.dim() != 2 or targets.shape != logits.shape[:1]:
        raise ValueError(
            f"targets: expected shape (N,) for logits (N, V) = {tuple(logits.shape)}, got "
            f"{tuple(targets.shape)}"
        )
    mean = reduction == "mean"
    return _FusedCrossEntropy.apply(logits, targets, ignore_index, float(label_smoothing), mean)


class _FusedCrossEntropy(torch.autograd.Function):
    """loss = sum over labelled rows of [(1 - eps) * -log p(y) + eps * mean_j -log p(j)],
    divided by their count for the mean; d loss / d logits = (softmax - eps / V - (1 - eps) *
    one_hot(y)) on labelled rows (divided by the count for the mean), 0 on the others."""

    @staticmethod
    def forward(ctx, logits, targets, ignore_index: int, smoothing: float, mean: bool):
        log_probs = torch.log_softmax(logits, dim=-1)  # (N, V)
        labelled = targets != ignore_index  # (N,)
        safe_targets = torch.where(labelled, targets, 0)  # any id for the unlabelled rows
        per_row = -log_probs.gather(1, safe_targets[:, None]).squeeze(1)  # (N,): -log p(y)
        if smoothing:
            per_row = (1.0 - smoothing) * per_row - smoothing * log_probs.mean(dim=-1)
        total = torch.where(labelled, per_row, 0.0).sum()
        count = labelled.sum()  # a tensor: nothing is read back to the host
        ctx.save_for_backward(log_probs, safe_targets, labelled, count)
        ctx.smoothing, ctx.mean = smoothing, mean
        return total / count if mean else total

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss: torch.Tensor):
        log_probs, safe_targets, labelled, count = ctx.saved_tensors
        scale = grad_loss / count if ctx.mean else grad_loss
        row_scale = torch.where(labelled, scale, 0.0)[:, None]  # (N, 1)
        grad = log_probs.exp_()  # (N, V) softmax, in place: the log-probs are not needed again
        if ctx.smoothing:
            grad.sub_(ctx.smoothing / grad.shape[-1])
        grad.mul_(row_scale)
        grad.scatter_add_(1, safe_targets[:, None], -(1.0 - ctx.smoothing) * row_scale)
        return grad, None, None, None, None


@contextlib.contextmanager
def fused_losses(model: nn.Module) -> Iterator[nn.Module]:
    """Inside the block, the floating-point CPU tensors that `model` returns with a gradient
    (alone, or as fields of its output dataclass, or in a tuple or dict) are `LossInput`
    tensors, on which F.cross_entropy runs `fused_cross_entropy` where it serves the call.
    Yields the model; on exit its hook is removed."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected an nn.Module, got {type(model).__name__}")
    handle = model.register_forward_hook(lambda module, args, output: _as_loss_inputs(output))
    try:
        yield model
    finally:
        handle.remove()


class LossInput(torch.Tensor):
    """A model's output inside `fused_losses`: a plain tensor whose F.cross_entropy calls that
    `fused_cross_entropy` serves run it. Ops on it give LossInput tensors (views of logits stay
    servable); every other op is PyTorch's."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.cross_entropy:
            call = _served(_SIGNATURE.bind(*args, **kwargs).arguments)
            if call is not None:
                logits, targets, options = call
                return fused_cross_entropy(logits.as_subclass(torch.Tensor), targets, **options)
        return super().__torch_function__(func, types, args, kwargs)


def _as_loss_inputs(output):
    """`output` with its floating-point CPU tensors that need a gradient as LossInput ones."""
    if isinstance(output, torch.Tensor):
        wanted = output.is_floating_point() and output.device.type == "cpu"
        if wanted and output.requires_grad and type(output) is torch.Tensor:
            return output.as_subclass(LossInput)
        return output
    if dataclasses.is_dataclass(output) and not isinstance(output, type):
        fields = {f.name: getattr(output, f.name) for f in dataclasses.fields(output) if f.init}
        marked = {name: _as_loss_inputs(value) for name, value in fields.items()}
        changed = {name: value for name, value in marked.items() if value is not fields[name]}
        return dataclasses.replace(output, **changed) if changed else output
    if type(output) in (tuple, list):
        return type(output)(_as_loss_inputs(item) for item in output)
    if type(output) is dict:
        return {key: _as_loss_inputs(value) for key, value in output.items()}
    return output


def _served(arguments: dict) -> tuple | None:
    """(logits, targets, options) of a call `fused_cross_entropy` serves, else None."""
    logits, targets = arguments["input"], arguments["target"]
    plain = all(arguments.get(name) is None for name in ("weight", "size_average", "reduce"))
    reduction = arguments.get("reduction", "mean")
    if not plain or reduction not in ("mean", "sum") or torch.compiler.is_compiling():
        return None
    if not (isinstance(logits, torch.Tensor) and isinstance(targets, torch.Tensor)):
        return None
    if logits.dtype != torch.float32 or logits.device.type != "cpu" or logits.dim() != 2:
        return None
    if targets.dtype != torch.int64 or targets.shape != logits.shape[:1]:
        return None
    if not (torch.is_grad_enabled() and logits.requires_grad):
        return None  # no backward: F.cross_entropy's forward is as fast
    options = {
        "ignore_index": arguments.get("ignore_index", -100),
        "reduction": reduction,
        "label_smoothing": arguments.get("label_smoothing", 0.0),
    }
    return logits, targets, options
