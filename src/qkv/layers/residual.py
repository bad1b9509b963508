"""The residual connection around a sub-layer, with its norm, in one of two arrangements
(compared by Xiong et al. 2020):

    post-norm  x = norm(x + dropout(sublayer(x)))     Vaswani et al. 2017, s3.1, "Add & Norm"
    pre-norm   x = x + dropout(sublayer(norm(x)))     Xiong et al. 2020; GPT-2, Llama

Blocks (qkv.layers.blocks, qkv.models.gpt, qkv.models.t5) pick one of the two functions once,
at construction, instead of branching in every forward.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

__all__ = ["post_norm", "pre_norm"]

Sublayer = Callable[[torch.Tensor], torch.Tensor]


def post_norm(x: torch.Tensor, sublayer: Sublayer, norm: nn.Module, dropout: nn.Module):
    """Add & Norm, as in Vaswani et al. 2017, s3.1: norm(x + dropout(sublayer(x)))."""
    return norm(x + dropout(sublayer(x)))


def pre_norm(x: torch.Tensor, sublayer: Sublayer, norm: nn.Module, dropout: nn.Module):
    """Pre-norm residual (Xiong et al. 2020): x + dropout(sublayer(norm(x))).

    The residual path carries x untouched, which keeps deep stacks trainable without warm-up.
    """
    return x + dropout(sublayer(norm(x)))
