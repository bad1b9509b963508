"""The checks every attention call runs: q, k, v and the scale. Each option a call sets is
checked against them by qkv.attention.option_checks.

`AttentionRequest` runs them once, when it is made; no backend checks again. A bad input fails
with a TypeError (a value of the wrong type) or a ValueError (the right type, out of range)
that names the argument, what was seen and what was expected.
"""

from __future__ import annotations

import math

import torch


def check_tensors(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """q (B, H, L_q, D), k (B, H_kv, L_k, D), v (B, H_kv, L_k, D_v): one floating dtype, one
    device, D >= 1, D_v >= 1, and H_kv dividing H."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(
                f"{name}: expected 4 dimensions (B, H, L, D), got shape {tuple(t.shape)}"
            )
        if not t.is_floating_point():
            raise TypeError(f"{name}: expected a floating-point tensor, got dtype {t.dtype}")
    if not q.dtype == k.dtype == v.dtype:
        raise TypeError(f"q, k, v: expected one dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}")
    if not q.device == k.device == v.device:
        raise ValueError(
            f"q, k, v: expected one device, got q {q.device}, k {k.device}, v {v.device}"
        )
    (B, H, _, D), (B_k, H_kv, L_k, D_k), (B_v, H_v, L_v, D_v) = q.shape, k.shape, v.shape
    if not B == B_k == B_v:
        raise ValueError(f"q, k, v: batch sizes differ: q {B}, k {B_k}, v {B_v}")
    if H_kv != H_v or L_k != L_v:
        raise ValueError(
            f"k, v: expected the same (H_kv, L_k), got k {(H_kv, L_k)}, v {(H_v, L_v)}"
        )
    if D_k != D:
        raise ValueError(f"q, k: head dims differ: q has D={D}, k has D={D_k}")
    # D = 0 leaves every score 0 (uniform weights over noise) and D_v = 0 an empty output:
    # no model means either, and the tiled kernels cannot even lay such rows out.
    if D == 0 or D_v == 0:
        raise ValueError(f"q, k, v: expected head dims D >= 1 and D_v >= 1, got D={D}, D_v={D_v}")
    if H_kv == 0 or H % H_kv:
        raise ValueError(
            f"k: its {H_kv} key/value heads must divide the {H} query heads of q "
            f"(MHA: equal, GQA: a divisor, MQA: 1)"
        )


def check_scale(scale: float | None, head_dim: int) -> float:
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale: expected a float or None, got {type(scale).__name__} {scale!r}")
    if not math.isfinite(scale):
        raise ValueError(f"scale: expected a finite number, got {scale}")
    return float(scale)
