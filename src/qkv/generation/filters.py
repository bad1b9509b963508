"""The filters of sampling (`qkv.generation.sampling.next_token`): top-k and top-p (nucleus)
keep the most likely tokens of each row and set the others to -inf."""

from __future__ import annotations

import torch

__all__ = ["filter_top_k", "filter_top_p"]


def filter_top_k(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """Keep the `top_k` largest logits of each row (ties at the boundary kept), -inf elsewhere.

    logits: (B, V) -> (B, V).
    """
    if top_k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]  # (B, 1): the k-th largest
    return logits.masked_fill(logits < kth, float("-inf"))


def filter_top_p(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Nucleus filtering (Holtzman et al. 2020): keep the smallest set of most likely tokens
    whose probabilities sum to at least `top_p`; the most likely token is always kept.

    logits: (B, V) -> (B, V).
    """
    if top_p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = torch.cumsum(probs, dim=-1) - probs  # probability of strictly better tokens
    drop_sorted = mass_before >= top_p  # the best token has mass_before = 0 and always stays
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))
