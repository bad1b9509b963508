"""Relative positions inside attention: T5's bucketed bias and Shaw et al.'s relative keys.

- T5 (Raffel et al. 2020, s2.1): each head adds a learned scalar to the score of query i and
  key j, looked up by the bucket of the offset j - i. Small offsets get a bucket each, larger
  ones share logarithmically wider buckets up to `max_distance`, beyond which all share the
  last; an encoder tells the two directions apart (half the buckets each), a decoder sees only
  j <= i. `T5RelativeBias` gives the bias as a dense (1, H, L_q, L_k) tensor (`bias=` of
  `qkv.attention`) or as a `score_mod` (`qkv.attention.OffsetBias`) that the tiled path, the
  Triton kernels and FlexAttention evaluate tile by tile; both give the table its gradient.
- Shaw et al. 2018 (s3.1, eq. 4): the score gains q_i . a_{clip(j - i, k)}, a learned key vector
  per clipped offset in [-k, k]. `ShawRelativeKeys` precomputes q . a for the 2k + 1 offsets,
  (B, H, L_q, 2k + 1), and turns it into the (B, H, L_q, L_k) bias or a `score_mod` that reads
  it per score (an `OffsetBias`, which the Triton kernels read too); both are differentiable
  with respect to q and the table.

Offsets use the call's key positions and its queries aligned bottom-right (query i at
i + L_k - L_q), as causal masking does: decoding with a cache gives each new query its true
offset to every cached key.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from qkv.attention.offset_bias import OffsetBias
from qkv.validation import check_positive_int

__all__ = ["ShawRelativeKeys", "T5RelativeBias", "t5_relative_bucket"]


def t5_relative_bucket(
    offset: torch.Tensor, *, bidirectional: bool, num_buckets: int = 32, max_distance: int = 128
) -> torch.Tensor:
    """The bucket (same shape, int64) of each key-minus-query offset (Raffel et al. 2020).

    bidirectional: half of the buckets for keys after the query, half for keys at or before it;
    otherwise keys after the query (not seen under causal masking) share bucket 0. In each
    direction, distances below half of its buckets have one bucket each; the rest grow
    logarithmically up to max_distance, and farther ones share the last bucket.

    The logarithmic part divides by the exact buckets of one direction, E = num_buckets // 4
    (bidirectional) or // 2, and by ln(max_distance / E): num_buckets must be at least 4
    (bidirectional) or 2, and max_distance more than E (ValueError otherwise).
    """
    _check_t5_buckets(num_buckets, max_distance, bidirectional=bidirectional)
    buckets = torch.zeros_like(offset)
    if bidirectional:
        num_buckets //= 2
        buckets = buckets + (offset > 0).long() * num_buckets
        distance = offset.abs()
    else:
        distance = (-offset).clamp(min=0)  # keys before the query: how far back
    exact = num_buckets // 2
    spread = torch.log(distance.float() / exact) / math.log(max_distance / exact)
    far = (exact + (spread * (num_buckets - exact)).long()).clamp(max=num_buckets - 1)
    return buckets + torch.where(distance < exact, distance, far)


def _check_t5_buckets(num_buckets: object, max_distance: object, *, bidirectional: object) -> None:
    """Arguments the bucket formula can compute with (Raffel et al. 2020; transformers'
    T5Attention._relative_position_bucket divides by zero, or gives negative buckets, without
    them): E = num_buckets // 4 (bidirectional) or // 2 exact buckets, E >= 1 and max_distance > E.
    """
    check_positive_int("num_buckets", num_buckets)
    check_positive_int("max_distance", max_distance)
    if not isinstance(bidirectional, bool):
        raise TypeError(f"bidirectional: expected a bool, got {bidirectional!r}")
    per_exact = 4 if bidirectional else 2  # buckets per exact bucket of one direction
    if num_buckets < per_exact:
        raise ValueError(
            f"num_buckets: expected at least {per_exact} with bidirectional={bidirectional} "
            f"(the formula divides by the exact buckets of one direction, num_buckets // "
            f"{per_exact}), got {num_buckets}"
        )
    exact = num_buckets // per_exact
    if max_distance <= exact:
        raise ValueError(
            f"max_distance: expected more than the exact buckets of one direction "
            f"(num_buckets // {per_exact} = {exact}; the formula divides by ln(max_distance / "
            f"{exact})), got {max_distance}"
        )


def _offsets(L_q: int, L_k: int, device) -> torch.Tensor:
    """(L_q, L_k) int64: key position j minus query position i + L_k - L_q."""
    query = torch.arange(L_q, device=device).view(-1, 1) + (L_k - L_q)
    return torch.arange(L_k, device=device).view(1, -1) - query


class T5RelativeBias(nn.Module):
    """T5's learned bias per head and offset bucket; `relative_attention_bias` (num_buckets, H)."""

    def __init__(
        self,
        num_heads: int,
        *,
        bidirectional: bool,
        num_buckets: int = 32,
        max_distance: int = 128,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        self.num_heads = check_positive_int("num_heads", num_heads)
        _check_t5_buckets(num_buckets, max_distance, bidirectional=bidirectional)
        self.num_buckets, self.max_distance = num_buckets, max_distance
        self.bidirectional = bidirectional
        self.relative_attention_bias = nn.Embedding(
            num_buckets, num_heads, device=device, dtype=dtype
        )

    def buckets(self, offset: torch.Tensor) -> torch.Tensor:
        return t5_relative_bucket(
            offset, bidirectional=self.bidirectional, num_buckets=self.num_buckets,
            max_distance=self.max_distance,
        )  # fmt: skip

    def forward(self, L_q: int, L_k: int) -> torch.Tensor:
        """The bias (1, H, L_q, L_k) for `qkv.attention(..., bias=...)`."""
        offset = _offsets(L_q, L_k, self.relative_attention_bias.weight.device)
        values = self.relative_attention_bias(self.buckets(offset))  # (L_q, L_k, H)
        return values.permute(2, 0, 1).unsqueeze(0)  # (1, H, L_q, L_k)

    def score_mod(self, L_q: int, L_k: int) -> OffsetBias:
        """score + bias[h, bucket(j - i')] per score (FlexAttention's signature), without an
        L_q x L_k tensor: an `OffsetBias` holding each head's bias for the offsets -R .. R,
        R = max_distance (buckets stop changing there, so clipping is exact). Made with
        gradients enabled, the table gets its gradient from the backends that differentiate
        a score_mod (tiled, Triton); made under no_grad it is a constant (torch 2.13's CPU
        FlexAttention fails to compile a captured tensor that requires a gradient, and has no
        backward anyway)."""
        table = self.relative_attention_bias.weight  # (num_buckets, H)
        table = table if torch.is_grad_enabled() else table.detach()
        R = self.max_distance
        offsets = torch.arange(-R, R + 1, device=table.device)  # (2R + 1,)
        values = table[self.buckets(offsets)].t()  # (H, 2R + 1)
        return OffsetBias(values.reshape(1, self.num_heads, 1, 2 * R + 1), R, L_k - L_q)


class ShawRelativeKeys(nn.Module):
    """Relative position keys a_{clip(j - i, k)} (Shaw et al. 2018, eq. 4), one learned vector
    of head_dim per clipped offset, shared by the heads: `relative_keys` (2k + 1, D)."""

    def __init__(self, head_dim: int, *, max_distance: int, device=None, dtype=None) -> None:
        super().__init__()
        self.head_dim = check_positive_int("head_dim", head_dim)
        self.max_distance = check_positive_int("max_distance", max_distance)
        self.relative_keys = nn.Parameter(
            torch.randn(2 * max_distance + 1, head_dim, device=device, dtype=dtype) * 0.02
        )

    def _scores(self, q: torch.Tensor, scale: float) -> torch.Tensor:
        """scale * q . a_r for every clipped offset r: (B, H, L_q, 2k + 1)."""
        return (q @ self.relative_keys.to(q.dtype).t()) * scale

    def _index(self, offset: torch.Tensor) -> torch.Tensor:
        return offset.clamp(-self.max_distance, self.max_distance) + self.max_distance

    def forward(self, q: torch.Tensor, L_k: int, *, scale: float | None = None) -> torch.Tensor:
        """The bias (B, H, L_q, L_k) = scale * q_i . a_{clip(j - i')} for q (B, H, L_q, D);
        scale defaults to 1/sqrt(D), that of the scores it joins."""
        scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
        table = self._scores(q, scale)  # (B, H, L_q, 2k + 1)
        index = self._index(_offsets(q.shape[2], L_k, q.device))  # (L_q, L_k)
        return table.gather(-1, index.expand(*q.shape[:2], -1, -1))  # (B, H, L_q, L_k)

    def score_mod(self, q: torch.Tensor, L_k: int, *, scale: float | None = None) -> OffsetBias:
        """The same term per score, read from the (B, H, L_q, 2k + 1) table (an `OffsetBias`,
        FlexAttention's signature); gradients reach q and the relative keys through the table."""
        scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
        table = self._scores(q, scale)  # (B, H, L_q, 2k + 1)
        return OffsetBias(table, self.max_distance, L_k - q.shape[2])
