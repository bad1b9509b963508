"""Exact attention maps from the fast path: recompute chosen probabilities from the lse.

A fused or tiled forward keeps only the log-sum-exp per query, lse_i = log sum_j exp(s_ij).
That is enough to recover any weight exactly: p_ij = exp(s_ij - lse_i). So the map of a few
heads and rows costs memory linear in what is selected, and no eager re-run of the model.
"""

from __future__ import annotations

import torch

from qkv.attention import score_terms
from qkv.attention.request import AttentionRequest, takes_options
from qkv.attention.tiles import TilePlan


@takes_options
def attention_weights(
    q: torch.Tensor,
    k: torch.Tensor,
    lse: torch.Tensor,
    *,
    heads: list[int] | torch.Tensor | None = None,
    rows: list[int] | torch.Tensor | None = None,
    **options,
) -> torch.Tensor:
    """Probabilities (B, len(heads), len(rows), L_k) of the selected heads and query rows.

    q: (B, H, L_q, D), k: (B, H_kv, L_k, D), lse: (B, H, L_q) from
    `qkv.flash_attention(..., return_lse=True)` called with the same options (those of
    `qkv.attention`). heads/rows default to all. Dropout is not reapplied: these are the
    pre-dropout weights.
    """
    request = AttentionRequest(q, k, k, **options)  # k stands in for v, which is not needed
    B, H, L_q, _ = q.shape
    if lse.shape != (B, H, L_q):
        raise ValueError(f"lse: expected shape (B, H, L_q) = {(B, H, L_q)}, got {tuple(lse.shape)}")
    head_index = _index("heads", heads, H, q.device)
    row_index = _index("rows", rows, L_q, q.device)
    kv_index = head_index // request.group_size  # the K/V head each selected query head reads
    dtype = torch.promote_types(q.dtype, torch.float32)
    q_sel = q.to(dtype)[:, head_index][:, :, row_index] * request.scale  # (B, h, r, D)
    scores = q_sel @ k.to(dtype)[:, kv_index].transpose(-1, -2)  # (B, h, r, L_k)
    if request.softcap is not None:
        scores = request.softcap * torch.tanh(scores / request.softcap)
    additive = score_terms.dense_additive(request)
    if additive is not None:
        scores = scores + _select(additive, head_index, row_index).to(dtype)
    score_mod = score_terms.score_mod_with_alibi(request)
    if score_mod is not None:
        batch = torch.arange(B, device=q.device).view(-1, 1, 1, 1)
        key_index = torch.arange(k.shape[2], device=q.device).view(1, 1, 1, -1)
        scores = score_mod(
            scores, batch, head_index.view(1, -1, 1, 1), row_index.view(1, 1, -1, 1), key_index
        )
    visible = _visible(request, row_index)
    if request.has_bool_mask:
        visible = visible & _select(request.mask, head_index, row_index)
    scores = scores.masked_fill(~visible, float("-inf"))
    lse_sel = lse.to(dtype)[:, head_index][:, :, row_index].unsqueeze(-1)  # (B, h, r, 1)
    lse_sel = lse_sel.masked_fill(lse_sel == float("-inf"), 0.0)  # empty rows: weights 0
    return torch.exp(scores - lse_sel).to(q.dtype)


def _visible(request: AttentionRequest, row_index: torch.Tensor) -> torch.Tensor:
    """Bool (B|1, 1, r, L_k): which keys the tiled rule leaves visible to the selected rows."""
    plan = TilePlan(
        query_len=request.query_len,
        key_len=request.key_len,
        block_q=1,
        block_k=1,
        causal=request.causal,
        window=request.window,
        sinks=request.sinks,
        lengths=request.lengths,
        has_dense_mask=False,
        pattern=request.pattern,
        query_lengths=request.query_lengths,
    )
    return plan.visible(row_index, torch.arange(request.key_len, device=row_index.device))


def _select(t: torch.Tensor, head_index: torch.Tensor, row_index: torch.Tensor) -> torch.Tensor:
    """Pick heads and rows from a 2-D or 4-D (B|1, H|1, L_q|1, L_k) mask or bias."""
    t = t.view(1, 1, *t.shape) if t.dim() == 2 else t
    if t.shape[1] > 1:
        t = t[:, head_index]
    if t.shape[2] > 1:
        t = t[:, :, row_index]
    return t


def _index(name: str, selection, size: int, device) -> torch.Tensor:
    if selection is None:
        return torch.arange(size, device=device)
    index = torch.as_tensor(selection, device=device).reshape(-1)
    if index.is_floating_point() or index.numel() == 0 or index.min() < 0 or index.max() >= size:
        raise ValueError(f"{name}: expected integer indices in [0, {size}), got {selection!r}")
    return index.long()
