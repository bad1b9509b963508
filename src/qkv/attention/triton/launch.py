"""Launchers for the Triton kernels: grids, strides, autotuned block sizes. No autograd here.

Importing this module imports Triton; `qkv` itself never does until a Triton call is made.
Under `TRITON_INTERPRET=1` (tests on CPU) the kernels run in Triton's interpreter, with a
single small configuration instead of autotuning. A sparse pattern runs with fixed blocks (its
block lists and tile masks are laid out for them): 64 x 64, 16 x 16 in the interpreter.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import triton

from qkv.attention.sparse import SparsePattern
from qkv.attention.tiles import TilePlan
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
    pattern: SparsePattern | None = None
    query_lengths: torch.Tensor | None = None  # (B,) int32: rows aligned on their own
    offset_bias: tuple[int, int] | None = None  # an OffsetBias's (max_distance, shift)

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
            "HAS_QUERY_LENGTHS": self.query_lengths is not None,
            "OFFSET_BIAS": self.offset_bias is not None,
            "rel_max": self.offset_bias[0] if self.offset_bias is not None else 0,
            "rel_shift": self.offset_bias[1] if self.offset_bias is not None else 0,
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


_KEY = ["L_q", "L_k", "BLOCK_D", "CAUSAL", "WINDOW", "ALIBI", "OFFSET_BIAS"]
_forward = triton.autotune(
    configs=_configs([(128, 64), (128, 128), (64, 64), (64, 128)]), key=_KEY
)(kernels.attention_forward_kernel)
_backward_dkdv = triton.autotune(
    configs=_configs([(64, 64), (32, 64), (64, 128), (128, 64)]), key=_KEY
)(kernels.attention_backward_dkdv_kernel)
_backward_dq = triton.autotune(
    configs=_configs([(64, 64), (64, 32), (128, 64), (64, 128)]), key=_KEY
)(kernels.attention_backward_dq_kernel)


SPARSE_BLOCK = 16 if INTERPRET else 64


@dataclass(frozen=True)
class SparseBlocks:
    """The computed tiles of a sparse call, as the kernels read them (int32/uint8 on the
    device): by query block (CSR: `rows` offsets into `cols`), by key block (`col_rows` offsets
    into `col_q_blocks`, with `col_slots` pointing at the same tile's entry), and the pattern's
    (block, block) mask of every listed tile (`masks`, in the by-query-block order)."""

    rows: torch.Tensor  # (n_q + 1,)
    cols: torch.Tensor  # (nnz,)
    masks: torch.Tensor  # (nnz, block, block)
    col_rows: torch.Tensor  # (n_k + 1,)
    col_q_blocks: torch.Tensor  # (nnz,)
    col_slots: torch.Tensor  # (nnz,)


@functools.lru_cache(maxsize=8)
def sparse_blocks(pattern, causal, window, sinks, L_q: int, L_k: int, device) -> SparseBlocks:
    """The tiles that causal, the window, sinks and the pattern leave visible (the interval
    arithmetic of `TilePlan.grid`), listed both ways, with the pattern's tile masks."""
    block = SPARSE_BLOCK
    plan = TilePlan(
        query_len=L_q, key_len=L_k, block_q=block, block_k=block, causal=causal,
        window=window, sinks=sinks, lengths=None, has_dense_mask=False, pattern=pattern,
    )  # fmt: skip
    computed, _ = plan.grid(block, block)  # (n_q, n_k)
    q_blocks, k_blocks = computed.nonzero(as_tuple=True)  # by query block, then key block
    offsets = torch.arange(block)
    q_pos = (q_blocks[:, None] * block + offsets + (L_k - L_q)).clamp(max=L_k - 1)  # (nnz, b)
    k_pos = (k_blocks[:, None] * block + offsets).clamp(max=L_k - 1)  # (nnz, b)
    masks = pattern.rule(L_k)(q_pos[:, :, None], k_pos[:, None, :])  # (nnz, b, b)
    by_key = torch.argsort(k_blocks * computed.shape[0] + q_blocks)

    def offsets_of(counts: torch.Tensor) -> torch.Tensor:
        return torch.cat([counts.new_zeros(1), counts.cumsum(0)])

    def on_device(t: torch.Tensor, dtype=torch.int32) -> torch.Tensor:
        return t.to(device=device, dtype=dtype).contiguous()

    return SparseBlocks(
        rows=on_device(offsets_of(computed.sum(dim=1))),
        cols=on_device(k_blocks),
        masks=on_device(masks, torch.uint8),
        col_rows=on_device(offsets_of(computed.sum(dim=0))),
        col_q_blocks=on_device(q_blocks[by_key]),
        col_slots=on_device(by_key),
    )


def _sparse_of(masking: Masking, L_q: int, L_k: int, device) -> SparseBlocks:
    return sparse_blocks(
        masking.pattern, masking.causal, masking.window, masking.sinks, L_q, L_k, device
    )


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


def _offset_args(values: torch.Tensor | None, shape: tuple[int, int, int], placeholder) -> dict:
    """The offset bias's pointer and (batch, head, row) strides, zero where it is shared."""
    if values is None:
        return {"RelBias": placeholder, "rel_stride_b": 0, "rel_stride_h": 0, "rel_stride_m": 0}
    strides = values.expand(*shape, values.shape[-1]).stride()
    return {"RelBias": values, "rel_stride_b": strides[0], "rel_stride_h": strides[1],
            "rel_stride_m": strides[2]}  # fmt: skip


def forward(q, k, v, masking: Masking, offset_values=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Output (B, H, L_q, D) in q's dtype and log-sum-exp (B, H, L_q) in fp32. offset_values:
    the fp32 (B or 1, H or 1, L_q or 1, 2R + 1) values of `masking.offset_bias`, or None."""
    B, H, L_q, D = q.shape
    L_k = k.shape[2]
    out = torch.empty_like(q)
    lse = torch.empty(B, H, L_q, device=q.device, dtype=torch.float32)
    kernel, blocks, fixed = _forward, (q, q, q), {}
    if masking.pattern is not None:
        sparse = _sparse_of(masking, L_q, L_k, q.device)
        kernel, blocks = kernels.attention_forward_kernel, (sparse.rows, sparse.cols, sparse.masks)
        fixed = _fixed_blocks()
    grid = lambda meta: (triton.cdiv(L_q, meta["BLOCK_M"]), B * H)  # noqa: E731
    kernel[grid](
        q,
        k,
        v,
        out,
        lse,
        _or(masking.lengths, q),
        _or(masking.slopes, q),
        _or(masking.query_lengths, q),
        *blocks,
        *_strides(q, k, v, out),
        H,
        H // k.shape[1],
        L_q,
        L_k,
        D,
        **masking.kernel_args(L_q, L_k),
        **_offset_args(offset_values, (B, H, L_q), q),
        PRECISION=_precision(q.dtype),
        BLOCK_D=_block_d(D),
        **fixed,
    )
    return out, lse


def _fixed_blocks() -> dict:
    """The launch options of a sparse call: its blocks are those of its lists, not tuned."""
    block = SPARSE_BLOCK
    return {"BLOCK_M": block, "BLOCK_N": block, "SPARSE": True, "num_warps": 4, "num_stages": 2}


def backward(q, k, v, out, lse, d_out, masking: Masking, offset_values=None):
    """(dq, dk, dv, d_offset_values) from the saved output and log-sum-exp (FlashAttention-2,
    Algorithm 2); d_offset_values (fp32, the shape of offset_values) is None without them."""
    B, H, L_q, D = q.shape
    H_kv, L_k = k.shape[1], k.shape[2]
    d_out = d_out.contiguous()
    delta = torch.empty_like(lse)
    block = 16 if INTERPRET else 64
    kernels.attention_backward_preprocess[(triton.cdiv(L_q, block), B * H)](
        out, d_out, delta, *out.stride()[:3], H, L_q, D, BLOCK_M=block, BLOCK_D=_block_d(D)
    )
    d_q, d_k, d_v = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    d_offset = None if offset_values is None else torch.zeros_like(offset_values)
    offset_args = _offset_args(offset_values, (B, H, L_q), q)
    common = dict(
        **masking.kernel_args(L_q, L_k), PRECISION=_precision(q.dtype), BLOCK_D=_block_d(D)
    )
    strides = _strides(q, k, v, d_out)
    extras = (_or(masking.lengths, q), _or(masking.slopes, q), _or(masking.query_lengths, q))
    dkdv, dq, by_key, by_query, fixed = _backward_dkdv, _backward_dq, (q,) * 4, (q,) * 3, {}
    if masking.pattern is not None:
        sparse = _sparse_of(masking, L_q, L_k, q.device)
        dkdv, dq = kernels.attention_backward_dkdv_kernel, kernels.attention_backward_dq_kernel
        by_key = (sparse.col_rows, sparse.col_q_blocks, sparse.col_slots, sparse.masks)
        by_query, fixed = (sparse.rows, sparse.cols, sparse.masks), _fixed_blocks()
    grid_kv = lambda meta: (triton.cdiv(L_k, meta["BLOCK_N"]), B * H_kv)  # noqa: E731
    dkdv[grid_kv](
        q,
        k,
        v,
        d_out,
        d_k,
        d_v,
        lse,
        delta,
        *extras,
        *by_key,
        *strides,
        H_kv,
        H // H_kv,
        L_q,
        L_k,
        D,
        **common,
        **offset_args,
        **fixed,
    )
    grid_q = lambda meta: (triton.cdiv(L_q, meta["BLOCK_M"]), B * H)  # noqa: E731
    dq[grid_q](
        q,
        k,
        v,
        d_out,
        d_q,
        lse,
        delta,
        *extras,
        *by_query,
        *strides,
        H,
        H // H_kv,
        L_q,
        L_k,
        D,
        **common,
        **offset_args,
        DRelBias=q if d_offset is None else d_offset,
        **fixed,
    )
    return d_q, d_k, d_v, d_offset


def _or(tensor: torch.Tensor | None, placeholder: torch.Tensor) -> torch.Tensor:
    """Kernels take a pointer even for an unused feature; any device tensor will do."""
    return placeholder if tensor is None else tensor
