"""Differential attention: the difference of two softmax maps (Ye et al. 2024, s2.1).

Each head splits its queries and keys into two halves and attends with both:

    [Q_1; Q_2] = X W_q,   [K_1; K_2] = X W_k,   V = X W_v
    DiffAttn(X) = (softmax(Q_1 K_1^T / sqrt(d)) - lambda softmax(Q_2 K_2^T / sqrt(d))) V   (eq. 1)
    lambda = exp(lambda_q1 . lambda_k1) - exp(lambda_q2 . lambda_k2) + lambda_init         (eq. 2)
    lambda_init = 0.8 - 0.6 exp(-0.3 (l - 1)),  l = 1 .. L the index of the layer

and the heads are normalised one by one, scaled and concatenated (eq. 3):

    head_h' = (1 - lambda_init) RMSNorm(head_h),   out = Concat(head_1', ..., head_H') W_o

The subtraction cancels the attention that both maps give to irrelevant context ("attention
noise"), as a differential amplifier cancels common-mode noise (Ye et al. 2024, s1, s2.1).

Sizes (s2.1): with E = embed_dim and H differential heads, each head has query and key halves
of size d = E / (2H) and values of size 2d, so q_proj is E -> H * 2d = E, as in a Transformer
of the same width with 2H heads of size d (the paper sets H = E / 2d, "d equal to the head
dimension of Transformer", to align parameters and FLOPs); out_proj is E -> E. Keys and values
may have fewer heads (GQA, Ainslie et al. 2023): H_kv heads of [K_1; K_2] and V, each shared by
H / H_kv query heads, both halves of a query head reading the halves of the same key head.

Each softmax map is one call of `qkv.attention` (A1 V - lambda A2 V), so masks, causal
alignment, windows, GQA and every backend work as they do in `MultiHeadAttention`.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from qkv.attention import attention
from qkv.layers.attention_checks import check_heads, check_rope
from qkv.layers.norms import RMSNorm
from qkv.positional import RotaryEmbedding
from qkv.validation import check_positive_int, describe

__all__ = ["DifferentialAttention", "lambda_init"]


def lambda_init(depth: int) -> float:
    """lambda_init = 0.8 - 0.6 exp(-0.3 (depth - 1)) for the layer at 1-based index `depth`
    (Ye et al. 2024, eq. 2): 0.2 for the first layer, rising towards 0.8 with depth."""
    check_positive_int("depth", depth)
    return 0.8 - 0.6 * math.exp(-0.3 * (depth - 1))


class DifferentialAttention(nn.Module):
    """Multi-head differential attention (Ye et al. 2024, s2.1), self-attention.

    Args:
        embed_dim: E, the width of the input and of the output; a multiple of 2 * num_heads.
        num_heads: H differential heads; query/key halves of size d = E // (2H), values 2d.
        num_kv_heads: H_kv key/value heads, dividing H (default H).
        depth: l, the 1-based index of this layer in its stack; sets lambda_init (eq. 2).
        bias: biases on the four projections (the paper's code has none).
        rope: a `qkv.positional.RotaryEmbedding` of head_dim d, applied to Q_1, Q_2, K_1, K_2.
        backend: the `qkv.attention` backend of both softmax maps.

    Parameters: q_proj (E -> H * 2d), k_proj (E -> H_kv * 2d), v_proj (E -> H_kv * 2d),
    out_proj (H * 2d -> E); lambda_q1, lambda_k1, lambda_q2, lambda_k2 (d,), drawn from
    N(0, 0.1^2) as in the paper's code, one lambda shared by every head of the layer; and
    head_norm, an RMSNorm over the 2d features of each head (eq. 3; the paper's "headwise
    normalization", drawn as GroupNorm in its Figure 2) with a learnable weight (2d,) shared by
    the heads, eps 1e-5 (the eps keeps a head that sees no key at 0, with finite gradients).
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        num_kv_heads: int | None = None,
        *,
        depth: int,
        bias: bool = False,
        rope: RotaryEmbedding | None = None,
        backend: str = "auto",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        _check_sizes(embed_dim, num_heads, num_kv_heads)
        self.embed_dim, self.num_heads, self.num_kv_heads = embed_dim, num_heads, num_kv_heads
        self.head_dim = embed_dim // num_heads // 2  # d: one query/key half; values are 2d
        self.depth = check_positive_int("depth", depth)
        self.lambda_init = lambda_init(depth)
        self.rope = check_rope(
            rope, self.head_dim, size="embed_dim // num_heads // 2, the size of one query/key half"
        )
        if not isinstance(bias, bool):
            raise TypeError(f"bias: expected a bool, got {describe(bias)}")
        if not isinstance(backend, str):
            raise TypeError(f"backend: expected a str, got {describe(backend)}")
        self.backend = backend
        factory = {"device": device, "dtype": dtype}
        width, kv_width = num_heads * 2 * self.head_dim, num_kv_heads * 2 * self.head_dim
        self.q_proj = nn.Linear(embed_dim, width, bias=bias, **factory)
        self.k_proj = nn.Linear(embed_dim, kv_width, bias=bias, **factory)
        self.v_proj = nn.Linear(embed_dim, kv_width, bias=bias, **factory)
        self.out_proj = nn.Linear(width, embed_dim, bias=bias, **factory)
        self.lambda_q1 = nn.Parameter(torch.empty(self.head_dim, **factory))
        self.lambda_k1 = nn.Parameter(torch.empty(self.head_dim, **factory))
        self.lambda_q2 = nn.Parameter(torch.empty(self.head_dim, **factory))
        self.lambda_k2 = nn.Parameter(torch.empty(self.head_dim, **factory))
        self.head_norm = RMSNorm(2 * self.head_dim, eps=1e-5, **factory)
        self.reset_lambda()

    def reset_lambda(self) -> None:
        """Draw lambda_q1, lambda_k1, lambda_q2, lambda_k2 from N(0, 0.1^2) again."""
        for vector in (self.lambda_q1, self.lambda_k1, self.lambda_q2, self.lambda_k2):
            nn.init.normal_(vector, mean=0.0, std=0.1)

    def lambda_value(self) -> torch.Tensor:
        """lambda = exp(lambda_q1 . lambda_k1) - exp(lambda_q2 . lambda_k2) + lambda_init
        (eq. 2), a 0-d tensor in float32 at least (float64 for float64 parameters)."""
        dtype = torch.promote_types(self.lambda_q1.dtype, torch.float32)
        first = torch.dot(self.lambda_q1.to(dtype), self.lambda_k1.to(dtype))
        second = torch.dot(self.lambda_q2.to(dtype), self.lambda_k2.to(dtype))
        return torch.exp(first) - torch.exp(second) + self.lambda_init

    def forward(
        self,
        x: torch.Tensor,
        *,
        mask: torch.Tensor | None = None,
        causal: bool = False,
        window: int | tuple[int, int] | None = None,
        positions: torch.Tensor | None = None,
        return_weights: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Differential self-attention over `x` (B, L, E).

        mask, causal and window mean what they mean in `qkv.attention` and apply to both maps:
        a bool mask is True where a query MAY attend (a float mask is additive), of shape
        (L, L) or (B|1, H|1, L, L), H the differential heads. positions: token positions for
        `rope`, (L,) or (B, L); default 0 .. L - 1. A query that sees no key gets output 0.

        Returns the output (B, L, E), or (output, weights) if return_weights, the weights being
        the difference map A1 - lambda A2 (B, H, L, L) that multiplies V (rows need not sum
        to 1, and may be negative).
        """
        self._check_call(x, positions)
        B, L, _ = x.shape
        H, D = self.num_heads, self.head_dim
        q_first, q_second, k_first, k_second, v = self._project(x, positions)
        options = {"mask": mask, "causal": causal, "window": window, "backend": self.backend}
        first = attention(q_first, k_first, v, return_weights=return_weights, **options)
        second = attention(q_second, k_second, v, return_weights=return_weights, **options)
        out1, out2 = (first[0], second[0]) if return_weights else (first, second)
        lam = self.lambda_value()
        heads = out1 - lam.to(out1.dtype) * out2  # (B, H, L, 2D): (A1 - lambda A2) V
        heads = self.head_norm(heads) * (1.0 - self.lambda_init)  # (B, H, L, 2D)
        output = heads.transpose(1, 2).reshape(B, L, H * 2 * D)  # (B, L, H * 2D): concat heads
        output = self.out_proj(output)  # (B, L, E)
        if not return_weights:
            return output
        weights1, weights2 = first[1], second[1]  # each (B, H, L, L)
        return output, weights1 - lam.to(weights1.dtype) * weights2  # (B, H, L, L)

    def _project(self, x: torch.Tensor, positions: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
        """The query halves q_first, q_second (B, H, L, D) and the key halves k_first, k_second
        (B, H_kv, L, D) after RoPE, and v (B, H_kv, L, 2D)."""
        B, L, _ = x.shape
        H, H_kv, D = self.num_heads, self.num_kv_heads, self.head_dim
        # each head's 2D projected features are [first half; second half]: as 2H (2H_kv)
        # heads of size D, the halves of head h sit at 2h and 2h + 1
        q = self.q_proj(x).view(B, L, 2 * H, D).transpose(1, 2)  # (B, 2H, L, D)
        k = self.k_proj(x).view(B, L, 2 * H_kv, D).transpose(1, 2)  # (B, 2H_kv, L, D)
        v = self.v_proj(x).view(B, L, H_kv, 2 * D).transpose(1, 2)  # (B, H_kv, L, 2D)
        if self.rope is not None:  # rotates every D-sized half alike, at the same positions
            q, k = self.rope(q, k, positions=positions)
        q_first, q_second = q[:, 0::2], q[:, 1::2]  # each (B, H, L, D)
        k_first, k_second = k[:, 0::2], k[:, 1::2]  # each (B, H_kv, L, D)
        return q_first, q_second, k_first, k_second, v

    def extra_repr(self) -> str:
        return (
            f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, "
            f"num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, depth={self.depth}, "
            f"lambda_init={self.lambda_init:.4f}, backend={self.backend!r}"
        )

    def _check_call(self, x: torch.Tensor, positions: torch.Tensor | None) -> None:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x: expected a torch.Tensor, got {type(x).__name__}")
        if x.dim() != 3 or x.shape[-1] != self.embed_dim:
            raise ValueError(f"x: expected shape (B, L, {self.embed_dim}), got {tuple(x.shape)}")
        if positions is not None and self.rope is None:
            raise ValueError(
                "positions: given, but this layer has no rope to use them; expected "
                "positions=None, or a layer built with rope=RotaryEmbedding(...)"
            )


def _check_sizes(embed_dim: int, num_heads: int, num_kv_heads: int) -> None:
    check_positive_int("embed_dim", embed_dim)
    check_positive_int("num_heads", num_heads)
    check_positive_int("num_kv_heads", num_kv_heads)
    if embed_dim % (2 * num_heads):
        raise ValueError(
            f"embed_dim: {embed_dim} is not divisible by 2 * num_heads={2 * num_heads}; "
            f"expected a multiple of it (each head has two query/key halves of size "
            f"embed_dim // (2 * num_heads))"
        )
    check_heads(embed_dim, num_heads, num_kv_heads)
