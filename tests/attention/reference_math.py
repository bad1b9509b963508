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
    additive = torch.zeros(B, H, L_q, L_k, dtype=q.dtype, device=q.device)
    visible = visible_keys(L_q, L_k, causal=causal, window=window).to(q.device)
    additive = additive.masked_fill(~visible, -torch.inf)
    if mask is not None and mask.dtype == torch.bool:
        additive = additive.masked_fill(~mask, -torch.inf)
    elif mask is not None:
        additive = additive + mask
    if bias is not None:
        additive = additive + bias
    empty_row = torch.isneginf(additive).all(dim=-1, keepdim=True)
    output = F.scaled_dot_product_attention(q, k, v, attn_mask=additive, scale=scale)
    return torch.where(empty_row, 0.0, output)


def visible_with_sinks(L_q, L_k, *, causal=False, window=None, sinks=0, lengths=None):
    """(B|1, 1, L_q, L_k) bool: structural window/causal, OR the first `sinks` keys (never
    ahead of what causal or the window's right edge allows), AND j < lengths[b]."""
    i = torch.arange(L_q).unsqueeze(1) + (L_k - L_q)
    j = torch.arange(L_k).unsqueeze(0)
    visible = visible_keys(L_q, L_k, causal=causal, window=window)
    if causal or isinstance(window, int):
        ahead = 0
    elif window is not None:
        ahead = window[1]
    else:
        ahead = L_k
    visible = visible | ((j < sinks) & (j <= i + ahead))
    visible = visible[None, None]
    if lengths is not None:
        visible = visible & (j < lengths.view(-1, 1, 1, 1))
    return visible


def eager_reference(
    q,
    k,
    v,
    *,
    causal=False,
    window=None,
    sinks=0,
    lengths=None,
    bias=None,
    score_mod=None,
    softcap=None,
    scale=None,
    dropout_keep=None,
    dropout_p=0.0,
):
    """Attention as eager math with every tiled feature, differentiable; (output, lse)."""
    B, H, L_q, D = q.shape
    L_k = k.shape[2]
    k = k.repeat_interleave(H // k.shape[1], dim=1)  # (B, H, L_k, D)
    v = v.repeat_interleave(H // v.shape[1], dim=1)  # (B, H, L_k, D_v)
    scores = (q @ k.transpose(-1, -2)) * (D**-0.5 if scale is None else scale)
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    if bias is not None:
        scores = scores + bias
    if score_mod is not None:
        index = torch.arange
        scores = score_mod(
            scores,
            index(B).view(-1, 1, 1, 1),
            index(H).view(1, -1, 1, 1),
            index(L_q).view(1, 1, -1, 1),
            index(L_k).view(1, 1, 1, -1),
        )
    visible = visible_with_sinks(
        L_q, L_k, causal=causal, window=window, sinks=sinks, lengths=lengths
    )
    scores = scores.masked_fill(~visible, -torch.inf)
    empty = ~visible.any(dim=-1, keepdim=True)
    weights = torch.softmax(scores.masked_fill(empty, 0.0), dim=-1).masked_fill(empty, 0.0)
    if dropout_keep is not None:
        weights = weights * dropout_keep / (1 - dropout_p)
    return weights @ v, torch.logsumexp(scores, dim=-1)
