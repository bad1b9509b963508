"""Dropout with a cheaper mask on the CPU: 16 random bits per element instead of bernoulli_.

Inverted dropout (Srivastava et al. 2014; the Transformer's regularisation, Vaswani et al. 2017
s5.4, and BERT's 0.1 on the hidden states and on the attention weights): in training each
element is zeroed with probability p and the survivors are scaled by 1 / (1 - p), so the
expectation of every element is unchanged.

On the CPU, PyTorch's `F.dropout` draws its mask with `bernoulli_`, one random number per
element through a slow path: for the attention weights of a BERT-base layer it can cost more
than the layer's attention matmuls (benchmarks/models.py). Here one 64-bit draw gives the masks
of four elements: its four 16-bit lanes are compared with a threshold, several times cheaper.
The price is that the keep probability is k / 65536 with k = round((1 - p) * 65536): p within
2^-17 of the one asked for (FlashAttention rounds it to 1/255), and the survivors are scaled by
65536 / k, so the expectation stays exact. The backward pass multiplies the gradient by the
same saved mask (a bool per element, as PyTorch's dropout saves). Only portable tensor ops are
used (integer draws, a comparison, a select): no CPU feature is needed. Other devices use
`F.dropout`, whose GPU kernels are already fused.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["dropout"]

_LEVELS = 1 << 16  # the values of a 16-bit lane


def dropout(
    x: torch.Tensor, p: float, *, training: bool = True, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Zero each element of `x` with probability p (to 2^-17 on the CPU) in training, scaling
    the rest so the expectation is `x`; the identity when not training or p == 0.

    x: any shape, floating point. p in [0, 1]. generator: the random source (default: the
    global one, so `torch.manual_seed` makes the masks reproducible). Same shape and dtype out.
    """
    if not isinstance(p, (int, float)) or isinstance(p, bool) or not 0.0 <= p <= 1.0:
        raise ValueError(f"p: expected a probability in [0, 1], got {p!r}")
    if not training or p == 0.0:
        return x
    if x.device.type != "cpu":
        return F.dropout(x, p=p, training=True)
    kept_levels = round((1.0 - p) * _LEVELS)  # k: lanes below the threshold are kept
    if kept_levels == 0:  # p within 2^-17 of 1: nothing survives (0, not NaN, for inf inputs)
        return x.masked_fill(torch.ones((), dtype=torch.bool, device=x.device), 0.0)
    return _BitMaskDropout.apply(x, kept_levels, generator)


def _keep_mask(
    shape: torch.Size, kept_levels: int, generator: torch.Generator | None = None
) -> torch.Tensor:
    """A bool mask of `shape`, each element True with probability kept_levels / 65536.

    torch.Tensor.random_ over the full int64 range, viewed as four int16 lanes per draw; a lane
    is uniform over [-32768, 32768), so `lane < kept_levels - 32768` has the probability asked.
    """
    count = shape.numel()
    draws = torch.empty((count + 3) // 4, dtype=torch.int64)
    draws.random_(-(2**63), 2**63 - 1, generator=generator)  # bounds: the whole int64 range
    lanes = draws.view(torch.int16)[:count].view(shape)
    return lanes < kept_levels - _LEVELS // 2


class _BitMaskDropout(torch.autograd.Function):
    """y = x * mask * scale; dy/dx = mask * scale, with the bool mask saved for backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, kept_levels: int, generator) -> torch.Tensor:
        keep = _keep_mask(x.shape, kept_levels, generator)
        ctx.save_for_backward(keep)
        ctx.scale = _LEVELS / kept_levels
        return torch.where(keep, x * ctx.scale, 0.0)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (keep,) = ctx.saved_tensors
        return torch.where(keep, grad * ctx.scale, 0.0), None, None
