"""Shared helpers for the layer tests: random weights, so that copying them is really tested."""

import torch
from torch import nn


def randomize_(module: nn.Module, seed: int = 0, std: float = 0.3) -> nn.Module:
    """Fill every parameter with N(0, std) (LayerNorm weights around 1): zero biases and unit
    norms would hide a bias or norm weight that was not copied."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in module.named_parameters():
            noise = torch.randn(parameter.shape, generator=generator, dtype=torch.float64) * std
            if "norm" in name and name.endswith("weight"):
                noise = noise + 1.0
            parameter.copy_(noise.to(parameter.dtype))
    return module
