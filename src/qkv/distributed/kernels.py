"""Attention of one query block against one key block, returning what the ring combines.

Ring attention (Liu et al. 2023) computes, on each rank, partial attention of its queries
against each arriving key block; the partial results are combined exactly through their
log-sum-exps, as FlashAttention combines tiles (Dao et al. 2022): `merge` below. The backward
recomputes each block's probabilities from the *global* log-sum-exp and output, so each block's
contribution to dq, dk, dv is exact on its own (FlashAttention-2, Dao 2023, Algorithm 2).

Every kernel keeps one contract (inputs in the compute dtype, fp32 or fp64):
    forward(q, k, v, visible, scale) -> out (B, H, bq, D_v), lse (B, H, bq)
    backward(q, k, v, out, lse, d_out, visible, scale) -> dq, dk, dv
with q (B, H, bq, D), k (B, H_kv, bk, D), v (B, H_kv, bk, D_v), visible bool (bq, bk) or None.
`reference` is the eager formula (the (bq, bk) scores in memory); `tiled` runs qkv's
FlashAttention loops (`qkv.attention.tiled.kernels`), whose memory does not grow with bk;
`auto` picks one of them per block by its size.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from qkv.attention.tiled import kernels as tiled_kernels
from qkv.attention.tiled.function import DEFAULT_BLOCK_K, DEFAULT_BLOCK_Q
from qkv.attention.tiles import TilePlan

NEG_INF = float("-inf")


@dataclass(frozen=True)
class BlockKernel:
    name: str
    forward: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    backward: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def merge(
    out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor
) -> None:
    """Fold one block's (out, lse) into the running (out, lse) of the same queries, in place.

    out (B, H, bq, D_v), lse (B, H, bq): softmax over the union of both key sets, exactly:
    lse' = log(e^lse + e^block_lse), out' = e^(lse - lse') out + e^(block_lse - lse') block_out.
    """
    new_lse = torch.logaddexp(lse, block_lse)
    finite = new_lse.masked_fill(new_lse == NEG_INF, 0.0)  # rows that have seen nothing yet
    out.mul_(torch.exp(lse - finite).unsqueeze(-1))
    out.add_(block_out * torch.exp(block_lse - finite).unsqueeze(-1))
    lse.copy_(new_lse)


def _grouped_scores(q, k, visible, scale) -> torch.Tensor:
    """(B, H, bq, D) x (B, H_kv, bk, D) -> masked scores (B, H_kv, G, bq, bk), no K copy."""
    H_kv = k.shape[1]
    q = q.unflatten(1, (H_kv, -1)) * scale  # (B, H_kv, G, bq, D)
    scores = q @ k.unsqueeze(2).transpose(-1, -2)  # (B, H_kv, G, bq, bk)
    return scores if visible is None else scores.masked_fill(~visible, NEG_INF)


def _reference_forward(q, k, v, visible, scale):
    scores = _grouped_scores(q, k, visible, scale)  # (B, H_kv, G, bq, bk)
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)  # (B, H_kv, G, bq, 1)
    probs = torch.exp(scores - lse.masked_fill(lse == NEG_INF, 0.0))  # empty rows: 0
    out = probs @ v.unsqueeze(2)  # (B, H_kv, G, bq, D_v)
    return out.flatten(1, 2), lse.squeeze(-1).flatten(1, 2)  # (B, H, bq, D_v), (B, H, bq)


def _reference_backward(q, k, v, out, lse, d_out, visible, scale):
    H_kv = k.shape[1]
    scores = _grouped_scores(q, k, visible, scale)  # (B, H_kv, G, bq, bk)
    lse = lse.unflatten(1, (H_kv, -1)).unsqueeze(-1)  # (B, H_kv, G, bq, 1)
    probs = torch.exp(scores - lse.masked_fill(lse == NEG_INF, 0.0))  # P, as in the forward
    d_out = d_out.unflatten(1, (H_kv, -1))  # (B, H_kv, G, bq, D_v)
    delta = (d_out * out.unflatten(1, (H_kv, -1))).sum(-1, keepdim=True)  # rowsum(dO * O)
    d_v = (probs.transpose(-1, -2) @ d_out).sum(2)  # (B, H_kv, bk, D_v)
    d_scores = probs * (d_out @ v.unsqueeze(2).transpose(-1, -2) - delta)  # P * (dP - D)
    d_q = (d_scores @ k.unsqueeze(2)).flatten(1, 2) * scale  # (B, H, bq, D)
    d_k = (d_scores.transpose(-1, -2) @ q.unflatten(1, (H_kv, -1))).sum(2) * scale
    return d_q, d_k, d_v  # d_k: (B, H_kv, bk, D)


def _tiled_problem(q, k, v, visible, scale) -> tiled_kernels.Problem:
    """The block as a problem for qkv's FlashAttention loops (rows layout, see its kernels)."""
    plan = TilePlan(
        query_len=q.shape[2], key_len=k.shape[2], block_q=DEFAULT_BLOCK_Q,
        block_k=DEFAULT_BLOCK_K, causal=False, window=None, sinks=0, lengths=None,
        has_dense_mask=visible is not None,
    )  # fmt: skip
    return tiled_kernels.Problem(
        q_rows=tiled_kernels.to_rows(q * scale, k.shape[1]),  # (B, H_kv, bq * G, D)
        k=k, v=v, group=q.shape[1] // k.shape[1], bias=None,
        mask=None if visible is None else visible.view(1, 1, 1, *visible.shape),
        plan=plan, softcap=None, score_mod=None, dropout_p=0.0, seed=0,
    )  # fmt: skip


def _tiled_forward(q, k, v, visible, scale):
    problem = _tiled_problem(q, k, v, visible, scale)
    out_rows, lse_rows = tiled_kernels.forward(problem)  # (B, H_kv, bq * G, D_v | 1)
    out = tiled_kernels.from_rows(out_rows, problem.group)  # (B, H, bq, D_v)
    return out, tiled_kernels.from_rows(lse_rows, problem.group).squeeze(-1)  # (B, H, bq)


def _tiled_backward(q, k, v, out, lse, d_out, visible, scale):
    problem, H_kv = _tiled_problem(q, k, v, visible, scale), k.shape[1]
    grads = tiled_kernels.backward(
        problem,
        tiled_kernels.to_rows(out, H_kv),
        tiled_kernels.to_rows(lse.unsqueeze(-1), H_kv),
        tiled_kernels.to_rows(d_out, H_kv),
        need_bias_grad=False,
    )
    d_q_rows, d_k, d_v = grads[:3]  # no bias, no score_mod: the rest is None
    d_q = tiled_kernels.from_rows(d_q_rows, problem.group) * scale  # d(q * scale) -> dq
    return d_q, d_k, d_v


# `auto` runs a block on the eager formula while its scores are few, on the tiles above: there
# the tiles are faster as well as smaller (forward + backward, fp32, one CPU thread: tiled
# takes 1.7x the eager time on 128 x 128 blocks, about 1x on 256 x 256, 0.4x on 1024 x 1024).
AUTO_TILED_FROM_SCORES = 256 * 256


def _auto_forward(q, k, v, visible, scale):
    return _by_size(q, k).forward(q, k, v, visible, scale)


def _auto_backward(q, k, v, out, lse, d_out, visible, scale):
    return _by_size(q, k).backward(q, k, v, out, lse, d_out, visible, scale)


KERNELS = {
    "auto": BlockKernel("auto", _auto_forward, _auto_backward),
    "reference": BlockKernel("reference", _reference_forward, _reference_backward),
    "tiled": BlockKernel("tiled", _tiled_forward, _tiled_backward),
}


def _by_size(q: torch.Tensor, k: torch.Tensor) -> BlockKernel:
    tiled = q.shape[2] * k.shape[2] >= AUTO_TILED_FROM_SCORES
    return KERNELS["tiled" if tiled else "reference"]
