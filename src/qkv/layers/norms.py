"""The "Norm" of "Add & Norm": LayerNorm (Ba et al. 2016) and RMSNorm (Zhang & Sennrich 2019).

Both normalise each position over its features, independently of the batch and of the sequence
length, which is why Transformers prefer them to BatchNorm. The statistics are computed in fp32
whatever the input dtype, as `F.layer_norm` and Llama's RMSNorm do, so bf16/fp16 activations do
not lose the mean.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from qkv.validation import check_positive_float, check_positive_int

__all__ = ["LayerNorm", "RMSNorm"]


class LayerNorm(nn.Module):
    """LayerNorm(x) = (x - mean(x)) / sqrt(var(x) + eps) * weight + bias, over the last axis.

    mean and var are taken over the E features of each position; var is the biased (1/E)
    variance, as in Ba et al. 2016 and `nn.LayerNorm`. `bias=False` drops the additive term
    (as `nn.LayerNorm(bias=False)`). Input (..., E), output the same shape and dtype.
    """

    def __init__(
        self,
        dim: int,
        *,
        eps: float = 1e-5,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.dim = check_positive_int("dim", dim)
        self.eps = check_positive_float("eps", eps)
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(dim, device=device, dtype=dtype)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _check_last_dim(x, self.dim)
        compute_dtype = torch.promote_types(x.dtype, torch.float32)
        # The formula above, as PyTorch's fused kernel (one pass forward and backward; the
        # unfused mean/var/rsqrt ops cost ~8x more in a training step): biased var, eps inside.
        weight = self.weight.to(compute_dtype)
        bias = None if self.bias is None else self.bias.to(compute_dtype)
        out = F.layer_norm(x.to(compute_dtype), (self.dim,), weight, bias, self.eps)
        return out.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}, bias={self.bias is not None}"


class RMSNorm(nn.Module):
    """RMSNorm(x) = x / sqrt(mean(x^2) + eps) * weight (Zhang & Sennrich 2019; Llama).

    No mean subtraction and no bias: only the scale of each position is normalised. Computed as
    Llama does: in fp32, cast back to the input dtype, then multiplied by `weight`
    (`weight * x.to(input_dtype)`). Input (..., E), output the same shape.
    """

    def __init__(
        self,
        dim: int,
        *,
        eps: float = 1e-6,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.dim = check_positive_int("dim", dim)
        self.eps = check_positive_float("eps", eps)
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _check_last_dim(x, self.dim)
        h = x.to(torch.promote_types(x.dtype, torch.float32))
        # h / sqrt(mean(h^2) + eps) in one call: on the CPU PyTorch runs the same pow, mean and
        # rsqrt as the formula written out (identical results) without a Python round trip per
        # op, which decoding pays at every layer, and a fused kernel where it has one.
        normalized = F.rms_norm(h, (self.dim,), eps=self.eps)
        return self.weight * normalized.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}"


def _check_last_dim(x: torch.Tensor, dim: int) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x: expected a torch.Tensor, got {type(x).__name__}")
    if x.dim() == 0 or x.shape[-1] != dim:
        raise ValueError(f"x: expected a last axis of size {dim}, got shape {tuple(x.shape)}")
