"""The error a quantized product may make: what PyTorch's own dense product makes in its dtype."""

import torch
import torch.nn.functional as F


def dense_error_bound(x: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype) -> float:
    """Twice the largest error of PyTorch's dense product in `dtype` against float64, or a few
    ulps of the output's size where that error happens to be 0."""
    exact = F.linear(x.double(), weight.double())
    dense = F.linear(x.to(dtype), weight.to(dtype)).double()
    floor = 4 * torch.finfo(dtype).eps * exact.abs().max().item()
    return max(2 * (dense - exact).abs().max().item(), floor)
