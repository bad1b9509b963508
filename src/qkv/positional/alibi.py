"""ALiBi, attention with linear biases (Press et al. 2022, "Train Short, Test Long", section 3).

ALiBi adds no position vectors at all. Each head h subtracts slope_h times the query-key distance
from its attention scores, score_ij - m_h * |i - j|, so attention fades linearly with distance, at a
rate that differs per head; the bias is defined for any length, which is what lets a model trained
on short inputs run on long ones.

The slopes are a geometric sequence, 2^(-8/n), 2^(-16/n), ..., 2^(-8) for n heads (8 heads:
1/2, 1/4, ..., 1/256). For a head count that is not a power of two the paper takes the slopes
of the closest smaller power of two and fills up with every other slope of twice that power.
"""

from __future__ import annotations

import torch

from qkv.positional._checks import angle_dtype, check_floating_dtype
from qkv.validation import check_int

__all__ = ["alibi_bias", "alibi_slopes"]


def alibi_slopes(num_heads: int) -> torch.Tensor:
    """The per-head slopes m_h of ALiBi (Press et al. 2022, section 3 and its `get_slopes`).

    For a power of two n: 2^(-8/n) * (2^(-8/n))^h for h = 0 .. n-1. Otherwise, with
    p = 2^floor(log2 num_heads): the p slopes of p heads, then the slopes of 2p heads at indices
    0, 2, 4, ... until there are num_heads (12 heads: the 8-head slopes, then 2^-0.5, 2^-1.5,
    2^-2.5, 2^-3.5). Returns a float32 tensor of shape (num_heads,).
    """
    return _slopes(num_heads).to(torch.float32)


def alibi_bias(
    num_heads: int,
    L_q: int,
    L_k: int,
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """The ALiBi score bias -m_h * |i - j|, ready for `qkv.attention(..., bias=...)`.

    Query i sits at key position i + (L_k - L_q): the last query lines up with the last key,
    the bottom-right alignment of `qkv.masks.causal` (and of decoding with a KV cache). Under a
    causal mask only j <= i survives and this is exactly the paper's -m * (i - j); without one
    (an encoder) keys ahead of the query are penalised by distance too.

    The bias is computed in float32 (float64 when `dtype` is float64), then cast to `dtype`.
    Returns a (1, num_heads, L_q, L_k) tensor; 0 on the aligned diagonal.
    """
    slopes = _slopes(num_heads)  # validates num_heads
    check_int("L_q", L_q, minimum=0)
    check_int("L_k", L_k, minimum=0)
    check_floating_dtype("dtype", dtype)
    compute_dtype = angle_dtype(dtype)
    query_pos = torch.arange(L_q, device=device).unsqueeze(1) + (L_k - L_q)  # (L_q, 1)
    key_pos = torch.arange(L_k, device=device).unsqueeze(0)  # (1, L_k)
    distance = (query_pos - key_pos).abs().to(compute_dtype)  # (L_q, L_k)
    slopes = slopes.to(device=device, dtype=compute_dtype).view(num_heads, 1, 1)  # (H, 1, 1)
    bias = -slopes * distance  # (H, L_q, L_k)
    return bias.unsqueeze(0).to(dtype)  # (1, H, L_q, L_k)


def _slopes(num_heads: int) -> torch.Tensor:
    """The slopes in float64, shape (num_heads,): see `alibi_slopes`."""
    check_int("num_heads", num_heads, minimum=1)
    power = 1 << (num_heads.bit_length() - 1)  # 2^floor(log2 num_heads)
    slopes = _geometric_slopes(power)  # (power,)
    if power < num_heads:
        fill = _geometric_slopes(2 * power)[0::2][: num_heads - power]  # (num_heads - power,)
        slopes = torch.cat((slopes, fill))  # (num_heads,)
    return slopes


def _geometric_slopes(count: int) -> torch.Tensor:
    """2^(-8/count), 2^(-16/count), ..., 2^(-8) in float64: the slopes of a power-of-two count."""
    exponents = torch.arange(1, count + 1, dtype=torch.float64)  # (count,)
    return torch.pow(2.0, -8.0 * exponents / count)
