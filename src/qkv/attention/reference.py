"""Backend `reference`: attention as the formula reads, in eager PyTorch.

    Attention(Q, K, V) = softmax(Q K^T * scale + bias) V        (Vaswani et al. 2017, s3.2.1)

with the soft-cap, ALiBi and score_mod of `AttentionRequest`, in its order.

The one backend that returns the attention weights. Scores and softmax statistics are computed in
fp32 (fp64 stays fp64) whatever the input dtype, so fp16 scores cannot overflow.
Masked scores are -inf, never a finite sentinel. A query row with no visible key gets weights 0
and output 0, with finite gradients (a NaN guard: softmax of an all -inf row is 0/0).
"""

from __future__ import annotations

import torch

from qkv.attention import score_terms
from qkv.attention.dropout import dropout
from qkv.attention.request import AttentionRequest

name = "reference"
summary = "eager math with fp32 softmax statistics; returns the weights; O(L_q * L_k) memory"


def why_not(request: AttentionRequest) -> str | None:
    """The reference backend serves every request."""
    return None


def notes(request: AttentionRequest) -> list[str]:
    out = ["materialises the (B, H, L_q, L_k) score matrix in fp32"]
    if request.group_size > 1:
        out.append(
            f"GQA/MQA: {request.num_heads} query heads read {request.num_kv_heads} K/V heads "
            f"through a broadcast view, no copy"
        )
    return out


def run(request: AttentionRequest) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (output (B, H, L_q, D_v), weights (B, H, L_q, L_k)), both in q's dtype."""
    q, v = request.q, request.v
    compute_dtype = torch.promote_types(q.dtype, torch.float32)
    scores = _grouped_scores(request, compute_dtype)  # (B, H, L_q, L_k)
    if request.softcap is not None:  # Gemma 2's soft-capping, before any bias
        scores = request.softcap * torch.tanh(scores / request.softcap)
    additive = score_terms.additive(request)
    if additive is not None:
        scores = scores + additive.to(compute_dtype)
    if request.score_mod is not None:
        scores = request.score_mod(scores, *score_terms.score_indices(request))
    allowed = score_terms.allowed(request)
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    if allowed is None and additive is None and request.score_mod is None:  # no row is empty
        weights = torch.softmax(scores, dim=-1)
    else:
        weights = _softmax_without_nan(scores)
    if request.dropout_p > 0.0:
        weights = dropout(weights, request.dropout_p)  # qkv's: a cheaper mask on the CPU
    output = _grouped_weighted_sum(request, weights, v.to(compute_dtype))
    return output.to(q.dtype), weights.to(q.dtype)


def _grouped_scores(request: AttentionRequest, dtype: torch.dtype) -> torch.Tensor:
    """Q K^T * scale with each group of query heads sharing one K head (no K copy)."""
    B, H, L_q, D = request.q.shape
    H_kv, G = request.num_kv_heads, request.group_size
    q = (request.q.to(dtype) * request.scale).view(B, H_kv, G, L_q, D)
    k = request.k.to(dtype).unsqueeze(2)  # (B, H_kv, 1, L_k, D)
    scores = q @ k.transpose(-1, -2)  # (B, H_kv, G, L_q, L_k)
    return scores.view(B, H, L_q, request.key_len)


def _grouped_weighted_sum(
    request: AttentionRequest, weights: torch.Tensor, v: torch.Tensor
) -> torch.Tensor:
    """weights @ V with each group of query heads sharing one V head (no V copy)."""
    B, H, L_q, L_k = weights.shape
    H_kv, G = request.num_kv_heads, request.group_size
    grouped = weights.view(B, H_kv, G, L_q, L_k) @ v.unsqueeze(2)  # (B, H_kv, G, L_q, D_v)
    return grouped.view(B, H, L_q, v.shape[-1])


def _softmax_without_nan(scores: torch.Tensor) -> torch.Tensor:
    """Softmax over keys; a row whose scores are all -inf gets weights 0 instead of NaN.

    Such a row is temporarily filled with zeros so softmax stays finite (and so does its gradient),
    then its weights are zeroed. This is done for any source of -inf (bool masks, additive masks,
    biases).
    """
    empty_row = scores.amax(dim=-1, keepdim=True) == float("-inf")  # (B, H, L_q, 1)
    weights = torch.softmax(scores.masked_fill(empty_row, 0.0), dim=-1)
    return weights.masked_fill(empty_row, 0.0)
