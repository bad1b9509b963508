"""`qkv.triton_attention`: the Triton kernels behind a `torch.autograd.Function`.

Layer 2 of 3: checks the call, makes the inputs contiguous, and saves only q, k, v, the output
and the log-sum-exp for the backward (FlashAttention-2). Triton is imported on the first call.
"""

from __future__ import annotations

import dataclasses

import torch

from qkv.attention.offset_bias import OffsetBias
from qkv.attention.request import check_lengths, make_request
from qkv.attention.sparse import SparsePattern
from qkv.validation import check_int

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 128


def triton_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    window: int | tuple[int, int] | None = None,
    sinks: int = 0,
    alibi_slopes: torch.Tensor | None = None,
    lengths: torch.Tensor | None = None,
    query_lengths: torch.Tensor | None = None,
    pattern: SparsePattern | None = None,
    offset_bias: OffsetBias | None = None,
    scale: float | None = None,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """FlashAttention-2 on the GPU: the same conventions as `qkv.flash_attention`.

    q: (B, H, L_q, D); k, v: (B, H_kv, L_k, D) with H % H_kv == 0 (no K/V copy); D <= 128;
    fp16, bf16 (fp32 accumulation) or fp32. causal/window aligned bottom-right; `sinks` first
    keys always visible (StreamingLLM); `alibi_slopes` (H,) adds -slope_h * |i' - j| (ALiBi);
    `lengths` (B,) valid keys per row; `query_lengths` (B,) valid queries per row, each row
    then aligned on its own (as `qkv.attention`); `pattern` a sparse pattern
    (`qkv.attention.sparse`): only the blocks it leaves visible are loaded, forward and
    backward. `offset_bias` (`qkv.attention.OffsetBias`: T5's bias, Shaw et al.'s relative
    keys) adds its value per score, read tile by tile, and its values get their gradient.
    Returns output, or (output, lse (B, H, L_q) fp32).
    """
    from qkv.attention.triton.launch import Masking

    request = make_request(
        q,
        k,
        v,
        mask=None,
        causal=causal,
        scale=scale,
        bias=None,
        window=window,
        dropout_p=0.0,
        return_weights=False,
        pattern=pattern,
        query_lengths=query_lengths,
    )
    reason = unsupported(q, v)
    if reason is not None:
        raise ValueError(f"q, k, v: {reason}")
    masking = Masking(
        causal=request.causal,
        window=request.window,
        sinks=check_int("sinks", sinks, minimum=0),
        lengths=_device_lengths(lengths, request.batch, request.key_len, q.device),
        slopes=_device_slopes(alibi_slopes, request.num_heads, q.device),
        scale=request.scale,
        pattern=request.pattern,
        query_lengths=_device_lengths(
            request.query_lengths, request.batch, request.query_len, q.device
        ),  # fmt: skip
    )
    offset_values = _offset_values(offset_bias, request)
    if offset_values is not None:
        masking = dataclasses.replace(
            masking, offset_bias=(offset_bias.max_distance, offset_bias.shift)
        )
    q, k, v = (t.contiguous() for t in (q, k, v))
    output, lse = _TritonAttention.apply(q, k, v, masking, offset_values)
    return (output, lse) if return_lse else output


def unsupported(q: torch.Tensor, v: torch.Tensor) -> str | None:
    """Why the kernels cannot take these tensors, or None."""
    if q.dtype not in SUPPORTED_DTYPES:
        return f"dtype {q.dtype} is not one of fp16, bf16, fp32"
    if q.shape[-1] > MAX_HEAD_DIM:
        return f"head dim {q.shape[-1]} > {MAX_HEAD_DIM}"
    if v.shape[-1] != q.shape[-1]:
        return f"v's head dim {v.shape[-1]} differs from q's {q.shape[-1]}"
    return None


class _TritonAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, masking, offset_values):
        from qkv.attention.triton import launch

        output, lse = launch.forward(q, k, v, masking, offset_values)
        ctx.save_for_backward(q, k, v, output, lse, offset_values)
        ctx.masking = masking
        ctx.mark_non_differentiable(lse)
        return output, lse

    @staticmethod
    def backward(ctx, d_output, _d_lse):
        from qkv.attention.triton import launch

        q, k, v, output, lse, offset_values = ctx.saved_tensors
        d_q, d_k, d_v, d_offset = launch.backward(
            q, k, v, output, lse, d_output, ctx.masking, offset_values
        )
        if not ctx.needs_input_grad[4]:
            d_offset = None
        return d_q, d_k, d_v, None, d_offset


def _offset_values(offset_bias, request) -> torch.Tensor | None:
    """The bias's values as the kernels read them (fp32, contiguous), after checking that
    they broadcast over this call."""
    if offset_bias is None:
        return None
    if not isinstance(offset_bias, OffsetBias):
        raise TypeError(f"offset_bias: expected a qkv.attention.OffsetBias, got {offset_bias!r}")
    offset_bias.check_call(request.batch, request.num_heads, request.query_len, request.key_len)
    values = offset_bias.values
    if values.device != request.q.device:
        raise ValueError(f"offset_bias: values on {values.device}, q on {request.q.device}")
    return values.to(torch.float32).contiguous()


def _device_lengths(lengths, batch: int, key_len: int, device) -> torch.Tensor | None:
    values = check_lengths(lengths, batch, key_len)
    return None if values is None else torch.tensor(values, device=device, dtype=torch.int32)


def _device_slopes(slopes, num_heads: int, device) -> torch.Tensor | None:
    if slopes is None:
        return None
    if not isinstance(slopes, torch.Tensor) or slopes.shape != (num_heads,):
        raise ValueError(f"alibi_slopes: expected a tensor of shape ({num_heads},), got {slopes!r}")
    return slopes.to(device=device, dtype=torch.float32).contiguous()
