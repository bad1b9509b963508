"""`qkv.triton_attention`: the Triton kernels behind a `torch.autograd.Function`.

Layer 2 of 3: makes one checked `AttentionRequest` of the call, makes the inputs contiguous, and
saves only q, k, v, the output and the log-sum-exp for the backward (FlashAttention-2). Triton
is imported on the first call.
"""

from __future__ import annotations

import dataclasses

import torch

from qkv.attention.offset_bias import OffsetBias
from qkv.attention.request import AttentionRequest, takes_options

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 128


@takes_options
def triton_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    offset_bias: OffsetBias | None = None,
    return_lse: bool = False,
    **options,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """FlashAttention-2 on the GPU: the same conventions as `qkv.flash_attention`.

    q: (B, H, L_q, D); k, v: (B, H_kv, L_k, D) with H % H_kv == 0 (no K/V copy); D <= 128;
    fp16, bf16 (fp32 accumulation) or fp32. The options of `qkv.attention` that the kernels
    read: causal/window aligned bottom-right; `sinks` first keys always visible
    (StreamingLLM); `alibi_slopes` (H,) adds -slope_h * |i' - j| (ALiBi); `lengths` (B,) valid
    keys per row; `query_lengths` (B,) valid queries per row, each row then aligned on its
    own (as `qkv.attention`); `pattern` a sparse pattern (`qkv.attention.sparse`): only the
    blocks it leaves visible are loaded, forward and backward; `scale`. The others (mask, bias,
    dropout_p, softcap, return_weights, a score_mod) are refused by name. `offset_bias`
    (`qkv.attention.OffsetBias`: T5's bias, Shaw et al.'s relative keys) adds its value per
    score, read tile by tile, and its values get their gradient. Returns output, or (output,
    lse (B, H, L_q) fp32).
    """
    if offset_bias is not None:
        if not isinstance(offset_bias, OffsetBias):
            raise TypeError(
                f"offset_bias: expected a qkv.attention.OffsetBias, got {offset_bias!r}"
            )
        if options.get("score_mod") is not None:
            raise ValueError("offset_bias, score_mod: expected one of them, got both")
        options["score_mod"] = offset_bias  # what the request calls it
    request = AttentionRequest(q, k, v, **options)
    reason = refusal(request)
    if reason is not None:
        raise ValueError(reason)
    return kernel_attention(request, return_lse=return_lse)


def refusal(request: AttentionRequest) -> str | None:
    """Why the kernels cannot serve a request (naming the option), or None."""
    if request.return_weights:
        return "return_weights: the kernels return no weights"
    if request.mask is not None or request.bias is not None:
        return (
            "mask, bias: the kernels take no dense mask or bias (qkv.triton_attention takes "
            "lengths= for padding and alibi_slopes= for ALiBi instead)"
        )
    if request.dropout_p > 0:
        return "dropout_p: the kernels have no dropout"
    if request.softcap is not None:
        return "softcap: the kernels have no soft-cap"
    if request.score_mod is not None and not isinstance(request.score_mod, OffsetBias):
        return (
            "score_mod: the kernels take a score_mod only as a qkv.attention.OffsetBias (T5's "
            "bias, Shaw et al.'s relative keys), which they read per tile"
        )
    q, v = request.q, request.v
    if q.dtype not in SUPPORTED_DTYPES:
        return f"q, k, v: dtype {q.dtype} is not one of fp16, bf16, fp32"
    if q.shape[-1] > MAX_HEAD_DIM:
        return f"q, k, v: head dim {q.shape[-1]} > {MAX_HEAD_DIM}"
    if v.shape[-1] != q.shape[-1]:
        return f"q, k, v: v's head dim {v.shape[-1]} differs from q's {q.shape[-1]}"
    return None


def kernel_attention(
    request: AttentionRequest, *, return_lse: bool = False
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Serve a checked request with the kernels: what `triton_attention` and backend `triton`
    run."""
    from qkv.attention.triton.launch import Masking

    device = request.q.device
    masking = Masking(
        causal=request.causal,
        window=request.window,
        sinks=request.sinks,
        lengths=_int32(request.lengths, device),
        slopes=_fp32(request.alibi_slopes),
        scale=request.scale,
        pattern=request.pattern,
        query_lengths=_int32(request.query_lengths, device),
    )
    offset_bias = request.score_mod  # an OffsetBias or None (see `refusal`)
    offset_values = None
    if offset_bias is not None:
        offset_values = _offset_values(offset_bias, request)
        masking = dataclasses.replace(
            masking, offset_bias=(offset_bias.max_distance, offset_bias.shift)
        )
    q, k, v = (t.contiguous() for t in (request.q, request.k, request.v))
    output, lse = _TritonAttention.apply(q, k, v, masking, offset_values)
    return (output, lse) if return_lse else output


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


def _offset_values(offset_bias: OffsetBias, request: AttentionRequest) -> torch.Tensor:
    """The bias's values as the kernels read them (fp32, contiguous), after checking that
    they broadcast over this call."""
    offset_bias.check_call(request.batch, request.num_heads, request.query_len, request.key_len)
    values = offset_bias.values
    if values.device != request.q.device:
        raise ValueError(f"offset_bias: values on {values.device}, q on {request.q.device}")
    return values.to(torch.float32).contiguous()


def _int32(lengths: tuple[int, ...] | None, device: torch.device) -> torch.Tensor | None:
    """Row lengths, (B,) int32 on the device, as the kernels read them."""
    return None if lengths is None else torch.tensor(lengths, device=device, dtype=torch.int32)


def _fp32(slopes: torch.Tensor | None) -> torch.Tensor | None:
    """ALiBi slopes (already on q's device), (H,) fp32 and contiguous, as the kernels read them."""
    return None if slopes is None else slopes.to(torch.float32).contiguous()
