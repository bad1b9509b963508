"""Launchers for the Triton kernels: grids, strides, autotuned block sizes. No autograd here.

Importing this module imports Triton; `qkv` itself never does until a Triton call is made.
Under `TRITON_INTERPRET=1` (tests on CPU) the kernels run in Triton's interpreter, with a
single small configuration instead of autotuning.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton

from qkv.attention.triton import kernels

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@dataclass(frozen=True)
class Masking:
    """Scalars the kernels read for visibility, in key counts (see kernels.py's docstring)."""

    causal: bool
    window: tuple[int, int] | None
    sinks: int
    lengths: torch.Tensor | None  # (B,) int32 on the device
    slopes: torch.Tensor | None  # (H,) fp32 ALiBi slopes on the device
    scale: float

    def kernel_args(self, L_q: int, L_k: int) -> dict:
        left, right = self.window if self.window is not None else (0, 0)
        if self.causal:
            future = 0
        elif self.window is not None:
            future = right
        else:
            future = L_q + L_k  # unbounded: sinks are visible from every query
        return {
            "scale_log2": self.scale * 1.4426950408889634,
            "left": left,
            "right": right,
            "sinks": self.sinks,
            "future": future,
            "CAUSAL": self.causal,
            "WINDOW": self.window is not None,
            "ALIBI": self.slopes is not None,
            "HAS_LENGTHS": self.lengths is not None,
        }


def _configs(block_pairs, warps=(4, 8), stages=(2, 3)) -> list[triton.Config]:
    if INTERPRET:
        return [triton.Config({"BLOCK_M": 16, "BLOCK_N": 16}, num_warps=1, num_stages=1)]
    return [
        triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s)
        for m, n in block_pairs
        for w in warps
        for s in stages
    ]


_KEY = ["L_q", "L_k", "BLOCK_D", "CAUSAL", "WINDOW", "ALIBI"]
_forward = triton.autotune(
    configs=_configs([(128, 64), (128, 128), (64, 64), (64, 128)]), key=_KEY
)(kernels.attention_forward_kernel)
_backward_dkdv = triton.autotune(
    configs=_configs([(64, 64), (32, 64), (64, 128), (128, 64)]), key=_KEY
)(kernels.attention_backward_dkdv_kernel)
_backward_dq = triton.autotune(
    configs=_configs([(64, 64), (64, 32), (128, 64), (64, 128)]), key=_KEY
)(kernels.attention_backward_dq_kernel)


def _block_d(head_dim: int) -> int:
    return max(16, triton.next_power_of_2(head_dim))


def _precision(dtype: torch.dtype) -> str:
    """fp32 inputs get exact fp32 products; fp16/bf16 use the tensor cores' fp32 accumulation
    ("tf32" only matters for fp32). See kernels._dot for "upcast"."""
    if dtype == torch.float32:
        return "ieee"
    return "upcast" if INTERPRET and dtype == torch.bfloat16 else "tf32"


def _strides(*tensors: torch.Tensor) -> list[int]:
    """(batch, head, row) strides of each (B, H, L, D) tensor; the last dim is contiguous."""
    return [s for t in tensors for s in t.stride()[:3]]


def forward(q, k, v, masking: Masking) -> tuple[torch.Tensor, torch.Tensor]:
    """Output (B, H, L_q, D) in q's dtype and log-sum-exp (B, H, L_q) in fp32."""
    B, H, L_q, D = q.shape
    L_k = k.shape[2]
    out = torch.empty_like(q)
    lse = torch.empty(B, H, L_q, device=q.device, dtype=torch.float32)
    grid = lambda meta: (triton.cdiv(L_q, meta["BLOCK_M"]), B * H)  # noqa: E731
    _forward[grid](
        q,
        k,
        v,
        out,
        lse,
        _or(masking.lengths, q),
        _or(masking.slopes, q),
        *_strides(q, k, v, out),
        H,
        H // k.shape[1],
        L_q,
        L_k,
        D,
        **masking.kernel_args(L_q, L_k),
        PRECISION=_precision(q.dtype),
        BLOCK_D=_block_d(D),
    )
    return out, lse


def backward(q, k, v, out, lse, d_out, masking: Masking):
    """(dq, dk, dv) from the saved output and log-sum-exp (FlashAttention-2, Algorithm 2)."""
    B, H, L_q, D = q.shape
    H_kv, L_k = k.shape[1], k.shape[2]
    d_out = d_out.contiguous()
    delta = torch.empty_like(lse)
    block = 16 if INTERPRET else 64
    kernels.attention_backward_preprocess[(triton.cdiv(L_q, block), B * H)](
        out, d_out, delta, *out.stride()[:3], H, L_q, D, BLOCK_M=block, BLOCK_D=_block_d(D)
    )
    d_q, d_k, d_v = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    common = dict(
        **masking.kernel_args(L_q, L_k), PRECISION=_precision(q.dtype), BLOCK_D=_block_d(D)
    )
    strides = _strides(q, k, v, d_out)
    extras = (_or(masking.lengths, q), _or(masking.slopes, q))
    grid_kv = lambda meta: (triton.cdiv(L_k, meta["BLOCK_N"]), B * H_kv)  # noqa: E731
    _backward_dkdv[grid_kv](
        q,
        k,
        v,
        d_out,
        d_k,
        d_v,
        lse,
        delta,
        *extras,
        *strides,
        H_kv,
        H // H_kv,
        L_q,
        L_k,
        D,
        **common,
    )
    grid_q = lambda meta: (triton.cdiv(L_q, meta["BLOCK_M"]), B * H)  # noqa: E731
    _backward_dq[grid_q](
        q,
        k,
        v,
        d_out,
        d_q,
        lse,
        delta,
        *extras,
        *strides,
        H,
        H // H_kv,
        L_q,
        L_k,
        D,
        **common,
    )
    return d_q, d_k, d_v


def _or(tensor: torch.Tensor | None, placeholder: torch.Tensor) -> torch.Tensor:
    """Kernels take a pointer even for an unused feature; any device tensor will do."""
    return placeholder if tensor is None else tensor
