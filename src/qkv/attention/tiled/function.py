"""`qkv.flash_attention`: exact attention in O(L) memory, forward and backward, any mask or bias.

The loops live in `kernels.py`; the masking of each tile in `tiles.py`. This file takes a
checked `AttentionRequest`, converts to the row layout, and wires both loops into a
`torch.autograd.Function` that saves only the inputs, the output and the log-sum-exp
(FlashAttention-2, section 3.1), the latter with the low part its fp32 rounding drops.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch

from qkv.attention import score_terms
from qkv.attention.option_checks import check_callable
from qkv.attention.request import AttentionRequest, takes_options
from qkv.attention.tiled import kernels
from qkv.attention.tiles import TilePlan
from qkv.validation import check_int

DEFAULT_BLOCK_Q = 256
DEFAULT_BLOCK_K = 256
# Sparse patterns: smaller tiles skip more (BigBird's blocks are 64 keys; Zaheer et al. 2020), and
# at L = 8192 a BigBird call runs fastest in 64 x 64 tiles (benchmarks/sparse.py).
PATTERN_BLOCK = 64


@dataclass(frozen=True)
class Settings:
    """The non-tensor part of a call (plus the dense bool mask, which needs no gradient)."""

    plan: TilePlan
    scale: float
    softcap: float | None
    score_mod: kernels.ScoreMod | None
    dropout_p: float
    seed: int
    mask: torch.Tensor | None
    trace: Callable[[kernels.TraceStep], None] | None


@takes_options
def flash_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    block_q: int = DEFAULT_BLOCK_Q,
    block_k: int = DEFAULT_BLOCK_K,
    return_lse: bool = False,
    trace: Callable[[kernels.TraceStep], None] | None = None,
    **options,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """FlashAttention (Dao et al. 2022; FlashAttention-2, Dao 2023) as tiled PyTorch.

    Never materialises the L_q x L_k scores: query blocks stream over key blocks with a running
    max and sum (online softmax), and the backward recomputes each tile from the saved
    log-sum-exp. Tiles that no query can see are skipped.

    The options are those of `qkv.attention`, made into one `AttentionRequest`: every one is
    served but return_weights (`qkv.attention_weights` recomputes them from the lse).

    Args:
        q: (B, H, L_q, D); k: (B, H_kv, L_k, D); v: (B, H_kv, L_k, D_v); H % H_kv == 0 (GQA/MQA
            served without repeating K/V).
        causal, window, scale, dropout_p, alibi_slopes: as in `qkv.attention` (bottom-right
            alignment).
        sinks: the first `sinks` keys stay visible to every query that may see them causally
            (attention sinks: StreamingLLM, Xiao et al. 2024), on top of the window.
        bias: additive scores, 2-D or 4-D broadcastable to (B, H, L_q, L_k); gets a gradient.
        score_mod: f(score, batch, head, q_idx, k_idx) -> score, applied elementwise after the
            bias with broadcastable index tensors, e.g. ALiBi as
            `lambda s, b, h, i, j: s - slopes[h] * (i - j).abs()`; differentiated per tile,
            and the tensors it closes over that require a gradient (a learned bias table such
            as T5's) get theirs, as in FlexAttention.
        lengths: (B,) valid keys per batch row (padding without an L x L mask).
        query_lengths: (B,) valid queries per batch row; given, causal, windows and sinks align
            each row's last real query with its last real key (FlashAttention's varlen rule),
            and padding queries get output 0.
        mask: an optional dense mask as in `qkv.attention` (bool, True = may attend).
        pattern: a sparse pattern (`qkv.attention.sparse`), intersected with the rest: only
            the tiles it leaves visible are computed, forward and backward (L_q <= L_k).
        softcap: logit soft-capping, scores -> softcap * tanh(scores / softcap) (Gemma 2).
        block_q, block_k: tile sizes; any lengths work, tails are partial tiles.
        return_lse: also return the log-sum-exp (B, H, L_q), fp32 (fp64 for fp64
            inputs), -inf on rows with no visible key.
        trace: called after every tile with a `TraceStep` (running max and sum): a glass box.

    Returns:
        output (B, H, L_q, D_v), or (output, lse) if return_lse. Rows with no visible key: 0.
    """
    request = AttentionRequest(q, k, v, **options)
    reason = refusal(request)
    if reason is not None:
        raise ValueError(reason)
    return tiled_attention(
        request, block_q=block_q, block_k=block_k, return_lse=return_lse, trace=trace
    )


def refusal(request: AttentionRequest) -> str | None:
    """Why the tiled loops cannot serve a request (naming the option), or None."""
    if request.return_weights:
        return (
            "return_weights: the tiled loops return no weights (recompute them exactly with "
            "qkv.attention_weights from the log-sum-exp of qkv.flash_attention(..., "
            "return_lse=True))"
        )
    return None


def tiled_attention(
    request: AttentionRequest,
    *,
    block_q: int,
    block_k: int,
    return_lse: bool = False,
    trace: Callable[[kernels.TraceStep], None] | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Serve a checked request in tiles: what `flash_attention` and backend `tiled` run."""
    check_callable("trace", trace)
    settings = Settings(
        plan=_plan(request, block_q, block_k),
        scale=request.scale,
        softcap=request.softcap,
        score_mod=score_terms.score_mod_with_alibi(request),  # ALiBi per score, never a dense bias
        dropout_p=request.dropout_p,
        seed=int(torch.randint(0, 2**62, (1,)).item()) if request.dropout_p > 0 else 0,
        mask=request.mask if request.has_bool_mask else None,
        trace=trace,
    )
    bias = score_terms.dense_additive(request)  # a float mask is one more additive term
    captured = kernels.captured_tensors(settings.score_mod) if torch.is_grad_enabled() else ()
    output, lse = _FlashAttention.apply(request.q, request.k, request.v, bias, settings, *captured)
    return (output, lse) if return_lse else output


class _FlashAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, bias, settings: Settings, *captured):
        # captured: what settings.score_mod reads and needs a gradient; it reads them itself
        ctx.captured = captured
        problem = _problem(q, k, v, bias, settings)
        out_rows, lse_rows, lse_low = kernels.forward_with_low(problem, settings.trace)
        ctx.save_for_backward(q, k, v, bias, out_rows, lse_rows, lse_low)
        ctx.settings = settings
        output = kernels.from_rows(out_rows, problem.group).to(q.dtype)  # (B, H, L_q, D_v)
        lse = kernels.from_rows(lse_rows, problem.group).squeeze(-1)  # (B, H, L_q)
        ctx.mark_non_differentiable(lse)
        return output, lse

    @staticmethod
    def backward(ctx, d_output, _d_lse):
        q, k, v, bias, out_rows, lse_rows, lse_low = ctx.saved_tensors
        settings: Settings = ctx.settings
        problem = dataclasses.replace(_problem(q, k, v, bias, settings), captured=ctx.captured)
        d_out_rows = kernels.to_rows(d_output.to(out_rows.dtype), k.shape[1])
        d_q_rows, d_k, d_v, d_bias, d_captured = kernels.backward(
            problem,
            out_rows,
            lse_rows,
            d_out_rows,
            need_bias_grad=ctx.needs_input_grad[3],
            lse_low=lse_low,  # P as exact as the eager softmax's (kernels._unround_lse)
        )
        d_q = kernels.from_rows(d_q_rows * settings.scale, problem.group).to(q.dtype)
        if d_bias is not None:
            d_bias = d_bias.reshape(bias.shape).to(bias.dtype)
        return d_q, d_k.to(k.dtype), d_v.to(v.dtype), d_bias, None, *d_captured


def _problem(q, k, v, bias, settings: Settings) -> kernels.Problem:
    """Inputs in the row layout and the compute dtype (fp32, or fp64 for fp64 inputs)."""
    dtype = torch.promote_types(q.dtype, torch.float32)
    H, H_kv = q.shape[1], k.shape[1]
    return kernels.Problem(
        q_rows=kernels.to_rows(q.to(dtype) * settings.scale, H_kv),
        k=k.to(dtype),
        v=v.to(dtype),
        group=H // H_kv,
        bias=None if bias is None else _grouped(bias.to(dtype), H, H_kv),
        mask=None if settings.mask is None else _grouped(settings.mask, H, H_kv),
        plan=settings.plan,
        softcap=settings.softcap,
        score_mod=settings.score_mod,
        dropout_p=settings.dropout_p,
        seed=settings.seed,
    )


def _grouped(t: torch.Tensor, H: int, H_kv: int) -> torch.Tensor:
    """(L_q, L_k) or (B|1, H|1, L_q|1, L_k|1) -> (B|1, H_kv|1, G|1, L_q|1, L_k|1), a view."""
    t = t.view(1, 1, *t.shape) if t.dim() == 2 else t
    if t.shape[1] == 1:
        return t.unsqueeze(1)  # (B|1, 1, 1, L_q|1, L_k|1)
    return t.view(t.shape[0], H_kv, H // H_kv, *t.shape[2:])


def _plan(request: AttentionRequest, block_q, block_k) -> TilePlan:
    return TilePlan(
        query_len=request.query_len,
        key_len=request.key_len,
        block_q=check_int("block_q", block_q, minimum=1),
        block_k=check_int("block_k", block_k, minimum=1),
        causal=request.causal,
        window=request.window,
        sinks=request.sinks,
        lengths=request.lengths,
        query_lengths=request.query_lengths,
        has_dense_mask=request.has_bool_mask,  # a float mask was folded into the bias
        pattern=request.pattern,
    )
