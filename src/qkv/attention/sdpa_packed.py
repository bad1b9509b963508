"""Packed sequences through SDPA as a padded batch: the `sdpa` backend's path for a call whose
only structure is a `qkv.attention.sparse.Packed` pattern, causal or not (`sdpa.repads`).

The sequences packed along L are gathered into (B * S, H, n_max, D), attended with each
sequence's own keys, and scattered back, so no score across sequences is computed and the
kernel's work is that of a padded batch, not of the whole packed length squared.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from qkv.attention.nan_rows import fill_nan_rows, nan_rows, without_nan_keys
from qkv.attention.request import AttentionRequest

__all__ = ["repadded"]


def repadded(request: AttentionRequest, *, enable_gqa: bool) -> torch.Tensor:
    """Packed sequences through the kernel as a padded batch: gather (B, H, T, D) into
    (B * S, H, n_max, D), attend with each sequence's key padding (causal within it, if the
    pattern or the call asks), scatter back; (B, H, T, D_v). enable_gqa: whether SDPA takes
    `enable_gqa` (torch >= 2.5); else K/V are repeated for GQA/MQA."""
    q, k, v = request.q, request.k, request.v
    B, H, T, _ = q.shape
    offsets = torch.tensor(request.pattern.query_offsets, device=q.device)
    lengths = offsets.diff()  # (S,)
    n_max = max(int(lengths.max()), 1)
    slot = torch.arange(n_max, device=q.device)  # (n_max,)
    real = slot < lengths[:, None]  # (S, n_max)
    index = (offsets[:-1, None] + slot).clamp(max=max(T - 1, 0))  # (S, n_max) packed positions
    flat = index.reshape(-1)

    def gather(x: torch.Tensor) -> torch.Tensor:  # (B, H_x, T, D) -> (B * S, H_x, n_max, D)
        picked = x[:, :, flat].view(B, x.shape[1], *index.shape, x.shape[-1])
        return picked.permute(0, 2, 1, 3, 4).reshape(-1, x.shape[1], n_max, x.shape[-1])

    # each sequence's own keys; an empty sequence gets one dummy key, its rows are dropped
    keys = real | ((lengths == 0)[:, None] & (slot == 0))
    allowed = keys[:, None, None, :]  # (S, 1, 1, n_max)
    if request.causal or request.pattern.causal:
        allowed = allowed & torch.ones(n_max, n_max, dtype=torch.bool, device=q.device).tril()
    allowed = allowed.repeat(B, 1, 1, 1)  # (B * S, 1, n_max | 1, n_max)
    gqa = {"enable_gqa": True} if request.group_size > 1 and enable_gqa else {}
    k_rows, v_rows = gather(k), gather(v)
    if request.group_size > 1 and not gqa:
        k_rows = k_rows.repeat_interleave(request.group_size, dim=1)
        v_rows = v_rows.repeat_interleave(request.group_size, dim=1)
    output = F.scaled_dot_product_attention(
        gather(q),
        without_nan_keys(k_rows),
        v_rows,
        attn_mask=allowed,
        dropout_p=request.dropout_p,
        scale=request.scale,
        **gqa,
    )  # fmt: skip  (B * S, H, n_max, D_v)
    output = fill_nan_rows(output, nan_rows(gather(q), k_rows, allowed))
    output = output.view(B, -1, H, n_max, output.shape[-1]).permute(0, 2, 1, 3, 4)
    keep = real.reshape(-1)  # (S * n_max,): the slots that hold a token
    return output.reshape(B, H, -1, output.shape[-1])[:, :, keep]  # (B, H, T, D_v)
