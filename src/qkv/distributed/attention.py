"""`ring_attention`: exact attention over a sequence split across P processes.

Ring Attention with Blockwise Transformers (Liu et al. 2023): every process keeps its query
block and passes its key/value block around a ring; after P - 1 hops each has met every block,
combining the partial results exactly through their log-sum-exps (`kernels.merge`). A process
holds its own key/value block and at most two others (the one it attends to, the one on its
way), so the sequence grows with P at a fixed memory per process.

The backward circulates too (a `torch.autograd.Function`, no autograd graph over the ring):
key/value blocks go around once more, each with its gradient accumulators dK, dV; every rank
adds its share to the accumulators of the block it holds, recomputing the probabilities from
the saved log-sum-exp, and after P - 1 hops each accumulator comes back to the block's owner.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from qkv.attention.request import make_request
from qkv.distributed.blocks import BlockPair, Masking
from qkv.distributed.kernels import KERNELS, BlockKernel, merge
from qkv.distributed.layout import check_layout, padded_length, segments
from qkv.distributed.ring import BLOCK_TAG, GRADIENT_TAG, Ring
from qkv.validation import check_int


@dataclass(frozen=True)
class RingSettings:
    """The non-tensor part of a call: who holds what, what is visible, how blocks compute."""

    ring: Ring
    masking: Masking
    layout: str
    padded: int  # N_pad: the positions of all shards together
    scale: float
    kernel: BlockKernel

    def pairs(self, step: int, device: torch.device) -> list[BlockPair]:
        """The computed pairs of this rank's queries with the block it holds after `step` hops."""
        P = self.ring.world_size
        mine = segments(self.ring.rank, P, self.padded, self.layout)
        theirs = segments(self.ring.source(step), P, self.padded, self.layout)
        return self.masking.pairs(mine, theirs, device)


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    causal: bool = False,
    window: int | tuple[int, int] | None = None,
    scale: float | None = None,
    layout: str = "zigzag",
    length: int | None = None,
    backend: str = "auto",
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """softmax(Q K^T * scale) V over the whole sequence, for this rank's queries (Liu et al. 2023).

    Every rank of `group` calls it at once, with its shards (`shard_sequence`); each must also
    run the backward, if any (it is a collective too).

    Args:
        q: (B, H, L_local, D); k: (B, H_kv, L_local, D); v: (B, H_kv, L_local, D_v): this
            rank's shards, H % H_kv == 0 (GQA/MQA).
        group: the process group of the ring; None: the default group, or one process when
            torch.distributed is not initialised.
        causal, window, scale: as in `qkv.attention`, on global positions (queries and keys of
            one sequence, so bottom-right alignment is plain position order).
        layout: "zigzag" (load-balanced for causal attention) or "contiguous": how the shards
            were cut (`qkv.distributed.layout`).
        length: the true sequence length N when the shards were padded (default: all
            P * L_local positions are real). Padding is never seen; its queries get output 0.
        backend: how each block pair is computed: "reference" (the eager formula, its scores
            in memory), "tiled" (qkv's FlashAttention loops, memory independent of the block
            length) or "auto" (the eager formula for small blocks, tiles for large ones).
        return_lse: also return the log-sum-exp (B, H, L_local), fp32 (fp64 for fp64 input),
            -inf where a query sees nothing; it carries no gradient.

    Returns:
        output (B, H, L_local, D_v) in q's dtype, or (output, lse).
    """
    request = make_request(
        q, k, v, mask=None, causal=causal, scale=scale, bias=None, window=window,
        dropout_p=0.0, return_weights=False,
    )  # fmt: skip
    if q.shape[2] != k.shape[2]:
        raise ValueError(
            f"q, k: a rank holds the queries and keys of the same positions, got L_local "
            f"{q.shape[2]} for q and {k.shape[2]} for k"
        )
    ring, layout = Ring.of(group), check_layout(layout)
    padded = q.shape[2] * ring.world_size
    name = "q" if length is None else "length"  # the argument the mismatch comes from
    length = padded if length is None else check_int("length", length, minimum=1)
    if padded_length(length, ring.world_size, layout) != padded:
        raise ValueError(
            f"{name}: {length} positions pad to {padded_length(length, ring.world_size, layout)} "
            f"under layout {layout!r} with {ring.world_size} ranks, but the shards hold "
            f"{ring.world_size} x {q.shape[2]} = {padded}; cut them with shard_sequence"
        )
    settings = RingSettings(
        ring=ring,
        masking=Masking(length=length, causal=causal, window=request.window),
        layout=layout,
        padded=padded,
        scale=request.scale,
        kernel=_kernel(backend),
    )
    output, lse = _RingAttention.apply(q, k, v, settings)
    return (output, lse) if return_lse else output


def _kernel(backend: str) -> BlockKernel:
    if backend not in KERNELS:
        raise ValueError(f"backend: expected one of {list(KERNELS)}, got {backend!r}")
    return KERNELS[backend]


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, settings: RingSettings):
        output, lse = _forward(q, k, v, settings)  # compute dtype
        ctx.save_for_backward(q, k, v, output, lse)
        ctx.settings = settings
        ctx.mark_non_differentiable(lse)
        return output.to(q.dtype), lse

    @staticmethod
    def backward(ctx, d_output, _d_lse):
        q, k, v, output, lse = ctx.saved_tensors
        d_q, d_k, d_v = _backward(q, k, v, output, lse, d_output.to(output.dtype), ctx.settings)
        return d_q.to(q.dtype), d_k.to(k.dtype), d_v.to(v.dtype), None


def _compute_dtype(q: torch.Tensor) -> torch.dtype:
    return torch.promote_types(q.dtype, torch.float32)  # softmax statistics in fp32 or fp64


def _forward(q, k, v, settings: RingSettings) -> tuple[torch.Tensor, torch.Tensor]:
    """Attend to the held block while the next one travels (Liu et al. 2023)."""
    dtype, ring, kernel = _compute_dtype(q), settings.ring, settings.kernel
    q = q.to(dtype)
    output = q.new_zeros(*q.shape[:-1], v.shape[-1])  # (B, H, L_local, D_v)
    lse = q.new_full(q.shape[:-1], float("-inf"))  # (B, H, L_local)
    block = (k, v)
    for step in range(ring.world_size):
        last = step == ring.world_size - 1
        incoming = None if last else ring.shift(block, BLOCK_TAG)
        k_held, v_held = (t.to(dtype) for t in block)
        for pair in settings.pairs(step, q.device):
            rows, cols = pair.query_rows, pair.key_rows
            block_out, block_lse = kernel.forward(
                q[:, :, rows], k_held[:, :, cols], v_held[:, :, cols], pair.visible, settings.scale
            )
            merge(output[:, :, rows], lse[:, :, rows], block_out, block_lse)
        if incoming is not None:
            block = incoming.wait()
    return output, lse


def _backward(q, k, v, output, lse, d_output, settings: RingSettings):
    """Blocks travel as in the forward; each block's dK, dV accumulator follows it one step
    behind and arrives home after P - 1 hops (the owner's own share waits for it)."""
    dtype, ring = _compute_dtype(q), settings.ring
    q = q.to(dtype)
    d_q = torch.zeros_like(q)  # (B, H, L_local, D)
    block, travelling, own = (k, v), None, None
    for step in range(ring.world_size):
        last = step == ring.world_size - 1
        incoming = None if last else ring.shift(block, BLOCK_TAG)
        k_held, v_held = (t.to(dtype) for t in block)
        d_k, d_v = torch.zeros_like(k_held), torch.zeros_like(v_held)
        for pair in settings.pairs(step, q.device):
            rows, cols = pair.query_rows, pair.key_rows
            grads = settings.kernel.backward(
                q[:, :, rows], k_held[:, :, cols], v_held[:, :, cols], output[:, :, rows],
                lse[:, :, rows], d_output[:, :, rows], pair.visible, settings.scale,
            )  # fmt: skip
            d_q[:, :, rows] += grads[0]
            d_k[:, :, cols] += grads[1]
            d_v[:, :, cols] += grads[2]
        if step == 0:
            own = (d_k, d_v)  # completed by the accumulator that comes home at the end
        else:
            if travelling is not None:  # this block's shares from the ranks before
                earlier_k, earlier_v = travelling.wait()
                d_k, d_v = d_k + earlier_k, d_v + earlier_v
            travelling = ring.shift((d_k, d_v), GRADIENT_TAG)
        if incoming is not None:
            block = incoming.wait()
    d_k, d_v = own
    if travelling is not None:
        others_k, others_v = travelling.wait()  # every other rank's share of our block
        d_k, d_v = d_k + others_k, d_v + others_v
    return d_q, d_k, d_v
