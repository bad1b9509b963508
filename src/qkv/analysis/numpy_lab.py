"""Attention in plain NumPy, forward and backward by hand: the math without a framework.

Scaled dot-product attention (Vaswani et al. 2017, s3.2.1) and multi-head attention (s3.2.2),
written with nothing but NumPy so that every step, including the gradients an autograd engine
would otherwise hide, is on the page. For one head, with scale = 1 / sqrt(D):

    forward                              backward (dO = dLoss/dO given)
    S = Q K^T * scale     (L_q, L_k)     dV = P^T dO
    P = softmax(S)        (L_q, L_k)     dP = dO V^T
    O = P V               (L_q, D)       dS = P * (dP - rowsum(dP * P))
                                         dQ = dS K * scale
                                         dK = dS^T Q * scale

dS is the softmax Jacobian diag(p) - p p^T applied to each row of dP. A boolean mask is True
where a query MAY attend (qkv's convention); a query with no visible key gets P = 0, hence
output 0 and zero gradients, never NaN. Multi-head attention adds the projections
(W_q, W_k, W_v, W_o, stored as PyTorch's `nn.Linear` stores them, y = x W^T + b), the split
into heads and the merge; its backward runs the same steps in reverse.

Every array is float64 in the tests; any float dtype works, and the results keep it. This
module imports NumPy (and Python's math) only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

__all__ = [
    "AttentionGradients",
    "MultiHeadCache",
    "MultiHeadGradients",
    "MultiHeadWeights",
    "attention_backward",
    "attention_forward",
    "masked_softmax",
    "merge_heads",
    "multi_head_backward",
    "multi_head_forward",
    "split_heads",
]


# --- scaled dot-product attention ---------------------------------------------------------------


def masked_softmax(scores: np.ndarray, mask: np.ndarray | None = None) -> np.ndarray:
    """Softmax over the last axis, the row maximum subtracted first; where `mask` is False the
    weight is 0, and a row with no True entry is all zeros. scores (..., L_k); mask broadcast
    to it. Returns (..., L_k)."""
    if mask is not None:
        scores = np.where(mask, scores, -np.inf)  # (..., L_k)
    row_max = scores.max(axis=-1, keepdims=True)  # (..., 1): -inf on a fully masked row
    row_max = np.where(np.isfinite(row_max), row_max, 0.0)
    exponentials = np.exp(scores - row_max)  # (..., L_k): exp(-inf) = 0
    total = exponentials.sum(axis=-1, keepdims=True)  # (..., 1): 0 on a fully masked row
    return exponentials / np.where(total > 0, total, 1.0)


def attention_forward(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    *,
    mask: np.ndarray | None = None,
    scale: float | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """softmax(Q K^T * scale) V and the weights P (Vaswani et al. 2017, s3.2.1, Equation 1).

    q (..., L_q, D), k (..., L_k, D), v (..., L_k, D_v), the leading axes broadcast (e.g.
    (B, H)). mask: bool, broadcastable to (..., L_q, L_k), True where a query may attend.
    scale: default 1 / sqrt(D). Returns output (..., L_q, D_v) and weights (..., L_q, L_k),
    which `attention_backward` needs.
    """
    _check_attention_inputs(q, k, v, mask)
    scale = _scale(scale, q.shape[-1])
    scores = (q @ np.swapaxes(k, -1, -2)) * scale  # (..., L_q, L_k)
    weights = masked_softmax(scores, mask)  # (..., L_q, L_k)
    return weights @ v, weights  # (..., L_q, D_v), (..., L_q, L_k)


@dataclass(frozen=True)
class AttentionGradients:
    """dLoss/dq, dLoss/dk, dLoss/dv, each the shape of its input."""

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray


def attention_backward(
    d_out: np.ndarray,
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    weights: np.ndarray,
    *,
    scale: float | None = None,
) -> AttentionGradients:
    """The gradients of `attention_forward`, by hand.

    d_out (..., L_q, D_v): dLoss/doutput. q, k, v: the forward's inputs; weights (..., L_q,
    L_k): the P it returned (masking lives in P: a masked weight is 0, so no gradient flows
    through it). scale: the forward's. Returns dq, dk, dv.
    """
    scale = _scale(scale, q.shape[-1])
    p = weights
    d_v = np.swapaxes(p, -1, -2) @ d_out  # (..., L_k, D_v): dV = P^T dO
    d_p = d_out @ np.swapaxes(v, -1, -2)  # (..., L_q, L_k): dP = dO V^T
    row_dot = (d_p * p).sum(axis=-1, keepdims=True)  # (..., L_q, 1): rowsum(dP * P)
    d_s = p * (d_p - row_dot)  # (..., L_q, L_k): the softmax Jacobian, row by row
    d_q = (d_s @ k) * scale  # (..., L_q, D): dQ = dS K * scale
    d_k = (np.swapaxes(d_s, -1, -2) @ q) * scale  # (..., L_k, D): dK = dS^T Q * scale
    return AttentionGradients(q=d_q, k=d_k, v=d_v)


# --- multi-head attention -----------------------------------------------------------------------


@dataclass(frozen=True)
class MultiHeadWeights:
    """The four projections of multi-head attention, as `nn.Linear` stores them: weight
    (out_features, in_features), y = x W^T + b. q_weight (E, E), k_weight and v_weight (E,
    E_kv) (E_kv: the context's width), out_weight (E, E); each bias (E,)."""

    q_weight: np.ndarray
    q_bias: np.ndarray
    k_weight: np.ndarray
    k_bias: np.ndarray
    v_weight: np.ndarray
    v_bias: np.ndarray
    out_weight: np.ndarray
    out_bias: np.ndarray


@dataclass(frozen=True)
class MultiHeadCache:
    """What the backward needs from the forward: its inputs, the per-head q, k, v (B, H, L, D),
    the attention weights (B, H, L_q, L_k) and the merged heads (B, L_q, E)."""

    x: np.ndarray
    context: np.ndarray
    weights: MultiHeadWeights
    num_heads: int
    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    attention_weights: np.ndarray
    merged: np.ndarray


@dataclass(frozen=True)
class MultiHeadGradients:
    """dLoss/dx (B, L_q, E), dLoss/dcontext (B, L_k, E_kv) (for self-attention, where context
    is x, the gradient of x is their sum) and the gradient of every weight and bias."""

    x: np.ndarray
    context: np.ndarray
    weights: MultiHeadWeights


def split_heads(x: np.ndarray, num_heads: int) -> np.ndarray:
    """(B, L, E) -> (B, H, L, E // H): each head reads its own slice of the features."""
    B, L, E = x.shape
    return x.reshape(B, L, num_heads, E // num_heads).transpose(0, 2, 1, 3)  # (B, H, L, D)


def merge_heads(x: np.ndarray) -> np.ndarray:
    """(B, H, L, D) -> (B, L, H * D): the heads side by side, the inverse of split_heads."""
    B, H, L, D = x.shape
    return x.transpose(0, 2, 1, 3).reshape(B, L, H * D)  # (B, L, E)


def multi_head_forward(
    x: np.ndarray,
    context: np.ndarray | None = None,
    *,
    weights: MultiHeadWeights,
    num_heads: int,
    mask: np.ndarray | None = None,
) -> tuple[np.ndarray, MultiHeadCache]:
    """MultiHead(Q, K, V) = Concat(head_1, ..., head_H) W_o (Vaswani et al. 2017, s3.2.2).

    x (B, L_q, E): the queries' input; context (B, L_k, E_kv): the keys' and values' input
    (default x: self-attention). num_heads divides E. mask: bool, broadcastable to (B, H, L_q,
    L_k), True where a query may attend, e.g. (L_q, L_k) or key padding (B, 1, 1, L_k).
    Returns the output (B, L_q, E) and the cache `multi_head_backward` reads.
    """
    context = x if context is None else context
    _check_multi_head_inputs(x, context, weights, num_heads)
    q = split_heads(_linear(x, weights.q_weight, weights.q_bias), num_heads)  # (B, H, L_q, D)
    k = split_heads(_linear(context, weights.k_weight, weights.k_bias), num_heads)  # (B,H,L_k,D)
    v = split_heads(_linear(context, weights.v_weight, weights.v_bias), num_heads)  # (B,H,L_k,D)
    heads, attention_weights = attention_forward(q, k, v, mask=mask)  # (B, H, L_q, D)
    merged = merge_heads(heads)  # (B, L_q, E)
    output = _linear(merged, weights.out_weight, weights.out_bias)  # (B, L_q, E)
    cache = MultiHeadCache(
        x=x, context=context, weights=weights, num_heads=num_heads, q=q, k=k, v=v,
        attention_weights=attention_weights, merged=merged,
    )  # fmt: skip
    return output, cache


def multi_head_backward(d_out: np.ndarray, cache: MultiHeadCache) -> MultiHeadGradients:
    """The gradients of `multi_head_forward`, by hand: the output projection, the merge, each
    head's attention (`attention_backward`), the split and the input projections, in reverse.
    d_out (B, L_q, E): dLoss/doutput."""
    weights = cache.weights
    d_out_weight, d_out_bias, d_merged = _linear_backward(d_out, cache.merged, weights.out_weight)
    d_heads = split_heads(d_merged, cache.num_heads)  # (B, H, L_q, D)
    d_qkv = attention_backward(d_heads, cache.q, cache.k, cache.v, cache.attention_weights)
    d_q_weight, d_q_bias, d_x = _linear_backward(merge_heads(d_qkv.q), cache.x, weights.q_weight)
    d_k_weight, d_k_bias, d_from_k = _linear_backward(
        merge_heads(d_qkv.k), cache.context, weights.k_weight
    )
    d_v_weight, d_v_bias, d_from_v = _linear_backward(
        merge_heads(d_qkv.v), cache.context, weights.v_weight
    )
    gradients = MultiHeadWeights(
        q_weight=d_q_weight, q_bias=d_q_bias, k_weight=d_k_weight, k_bias=d_k_bias,
        v_weight=d_v_weight, v_bias=d_v_bias, out_weight=d_out_weight, out_bias=d_out_bias,
    )  # fmt: skip
    return MultiHeadGradients(x=d_x, context=d_from_k + d_from_v, weights=gradients)


def _linear(x: np.ndarray, weight: np.ndarray, bias: np.ndarray) -> np.ndarray:
    """x W^T + b: (B, L, in) -> (B, L, out), as nn.Linear."""
    return x @ weight.T + bias


def _linear_backward(
    d_y: np.ndarray, x: np.ndarray, weight: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For y = x W^T + b with dLoss/dy = d_y (B, L, out): dW = sum over (B, L) of d_y^T x
    (out, in), db = sum of d_y (out,), dx = d_y W (B, L, in)."""
    d_weight = np.einsum("blo,bli->oi", d_y, x)  # (out, in)
    return d_weight, d_y.sum(axis=(0, 1)), d_y @ weight


# --- argument checks ----------------------------------------------------------------------------


def _scale(scale: float | None, head_dim: int) -> float:
    if scale is None:
        return 1.0 / math.sqrt(head_dim)  # a Python float: float32 inputs stay float32
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not scale > 0:
        raise ValueError(f"scale: expected a number > 0 or None, got {scale!r}")
    return float(scale)


def _check_attention_inputs(q: object, k: object, v: object, mask: object) -> None:
    for name, array in (("q", q), ("k", k), ("v", v)):
        if not isinstance(array, np.ndarray) or array.ndim < 2:
            raise ValueError(
                f"{name}: expected a NumPy array of shape (..., L, D), got {array!r:.60}"
            )
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"k: expected the last axis of q ({q.shape[-1]}), got shape {k.shape}")
    if k.shape[-2] != v.shape[-2]:
        raise ValueError(f"v: expected {k.shape[-2]} keys like k, got shape {v.shape}")
    if mask is not None:
        if not isinstance(mask, np.ndarray) or mask.dtype != np.bool_:
            raise ValueError(f"mask: expected a bool NumPy array or None, got {mask!r:.60}")
        expected = (*np.broadcast_shapes(q.shape[:-2], k.shape[:-2]), q.shape[-2], k.shape[-2])
        try:
            np.broadcast_shapes(mask.shape, expected)
        except ValueError:
            raise ValueError(
                f"mask: expected a shape broadcastable to {expected}, got {mask.shape}"
            ) from None


def _check_multi_head_inputs(
    x: object, context: object, weights: MultiHeadWeights, num_heads: object
) -> None:
    if isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads < 1:
        raise ValueError(f"num_heads: expected an int >= 1, got {num_heads!r}")
    for name, array in (("x", x), ("context", context)):
        if not isinstance(array, np.ndarray) or array.ndim != 3:
            raise ValueError(f"{name}: expected a NumPy array (B, L, E), got {array!r:.60}")
    E = x.shape[-1]
    if E % num_heads:
        raise ValueError(
            f"num_heads: expected a divisor of the embedding width {E}, got {num_heads}"
        )
    if context.shape[0] != x.shape[0]:
        raise ValueError(f"context: expected batch {x.shape[0]} like x, got shape {context.shape}")
    E_kv = context.shape[-1]
    expected = {
        "q_weight": (E, E), "k_weight": (E, E_kv), "v_weight": (E, E_kv), "out_weight": (E, E),
        "q_bias": (E,), "k_bias": (E,), "v_bias": (E,), "out_bias": (E,),
    }  # fmt: skip
    for name, shape in expected.items():
        seen = getattr(weights, name).shape
        if seen != shape:
            raise ValueError(f"weights.{name}: expected shape {shape}, got {seen}")
