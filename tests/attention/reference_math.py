"""The outside reference for qkv.attention: PyTorch's F.scaled_dot_product_attention.

Written independently of qkv: masks from explicit index arithmetic, GQA by repeating K/V (what
Hugging Face's repeat_kv does), everything folded into one additive float mask for SDPA. The only
convention layered on top is qkv's promise: a query with no visible key outputs 0.
"""

import torch
import torch.nn.functional as F


def visible_keys(L_q, L_k, *, causal=False, window=None):
    """(L_q, L_k) bool from index arithmetic; queries aligned bottom-right to the keys."""
    i = torch.arange(L_q).unsqueeze(1) + (L_k - L_q)  # query positions in key coordinates
    j = torch.arange(L_k).unsqueeze(0)
    allowed = torch.ones(L_q, L_k, dtype=torch.bool)
    if causal:
        allowed &= j <= i
    if isinstance(window, int):
        allowed &= (j <= i) & (i - j < window)
    elif window is not None:
        left, right = window
        allowed &= (j >= i - left) & (j <= i + right)
    return allowed


def sdpa_reference(q, k, v, *, mask=None, causal=False, scale=None, bias=None, window=None):
    """Output (B, H, L_q, D_v) of SDPA with every constraint as one additive mask."""
    B, H, L_q, _ = q.shape
    H_kv, L_k = k.shape[1], k.shape[2]
    k = k.repeat_interleave(H // H_kv, dim=1)  # (B, H, L_k, D)
    v = v.repeat_interleave(H // H_kv, dim=1)  # (B, H, L_k, D_v)
    additive = torch.zeros(B, H, L_q, L_k, dtype=q.dtype)
    additive = additive.masked_fill(
        ~visible_keys(L_q, L_k, causal=causal, window=window), -torch.inf
    )
    if mask is not None and mask.dtype == torch.bool:
        additive = additive.masked_fill(~mask, -torch.inf)
    elif mask is not None:
        additive = additive + mask
    if bias is not None:
        additive = additive + bias
    empty_row = torch.isneginf(additive).all(dim=-1, keepdim=True)
    output = F.scaled_dot_product_attention(q, k, v, attn_mask=additive, scale=scale)
    return torch.where(empty_row, 0.0, output)
