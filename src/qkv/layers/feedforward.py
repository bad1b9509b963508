"""The position-wise feed-forward network: the second sub-layer of every Transformer block.

    FFN(x) = W_2 sigma(x W_1 + b_1) + b_2          (Vaswani et al. 2017, s3.3)

The same two linear maps act on every position independently; the hidden width (typically 4 * E) is
where the block's non-linear capacity lives. sigma is ReLU in the original paper and GELU
(Hendrycks & Gimpel 2016) in BERT and GPT. `SwiGLU` is the gated variant of Llama (Shazeer 2020).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from qkv.layers._dropout import make_dropout
from qkv.validation import check_positive_int, check_probability

__all__ = ["ACTIVATIONS", "FeedForward", "SwiGLU"]

# GELU(x) = x * Phi(x) with the exact erf (BERT), or its tanh approximation (GPT-2, "gelu_new").
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "relu": F.relu,
    "gelu": F.gelu,
    "gelu_tanh": partial(F.gelu, approximate="tanh"),
}


class FeedForward(nn.Module):
    """down_proj(dropout(activation(up_proj(x)))): (..., E) -> (..., hidden_dim) -> (..., E).

    activation: "relu" (Vaswani et al. 2017), "gelu" (exact, BERT) or "gelu_tanh" (GPT-2).
    The dropout sits on the hidden activations, where `nn.TransformerEncoderLayer` puts it.
    """

    def __init__(
        self,
        embed_dim: int,
        hidden_dim: int,
        *,
        activation: str = "relu",
        dropout: float = 0.0,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        check_positive_int("embed_dim", embed_dim)
        check_positive_int("hidden_dim", hidden_dim)
        if activation not in ACTIVATIONS:
            raise ValueError(
                f"activation: expected one of {sorted(ACTIVATIONS)}, got {activation!r}"
            )
        self.activation = activation
        factory = {"device": device, "dtype": dtype}
        self.up_proj = nn.Linear(embed_dim, hidden_dim, bias=bias, **factory)
        self.dropout = make_dropout(check_probability("dropout", dropout))
        self.down_proj = nn.Linear(hidden_dim, embed_dim, bias=bias, **factory)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = ACTIVATIONS[self.activation](self.up_proj(x))  # (..., hidden_dim)
        return self.down_proj(self.dropout(hidden))  # (..., E)

    def extra_repr(self) -> str:
        return f"activation={self.activation!r}"


class SwiGLU(nn.Module):
    """down_proj(silu(gate_proj(x)) * up_proj(x)): the gated FFN of Shazeer 2020 ("GLU Variants
    Improve Transformer"), as used by Llama (`LlamaMLP`).

    The gate decides, per hidden unit, how much of the linear `up_proj` branch passes. Llama has
    no biases (`bias=False`); hidden_dim is usually about 8/3 * E so that the three matrices cost
    what the two of a 4 * E FFN do. Input (..., E), output (..., E).
    """

    def __init__(
        self,
        embed_dim: int,
        hidden_dim: int,
        *,
        bias: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        check_positive_int("embed_dim", embed_dim)
        check_positive_int("hidden_dim", hidden_dim)
        factory = {"device": device, "dtype": dtype}
        self.gate_proj = nn.Linear(embed_dim, hidden_dim, bias=bias, **factory)
        self.up_proj = nn.Linear(embed_dim, hidden_dim, bias=bias, **factory)
        self.down_proj = nn.Linear(hidden_dim, embed_dim, bias=bias, **factory)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_proj(x), self.up_proj(x)  # each (..., hidden_dim)
        return self.down_proj(F.silu(gate) * up)  # (..., E)
