"""Choosing the next token from logits: greedy, temperature, top-k and top-p (nucleus).

Everything stays on the device: no `.item()` per token, so decoding does not wait on the host
between steps. Filters set what they drop to -inf; sampling draws from a `torch.Generator` so a
seed reproduces the same tokens.
"""

from __future__ import annotations

import torch


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


def next_token(
    logits: torch.Tensor,
    *,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """The next token of each row, (B, V) logits -> (B,) int64.

    temperature 0 is greedy (argmax); otherwise logits / temperature, then top-k, then top-p,
    then one draw from the softmax.
    """
    if temperature == 0.0:
        return logits.argmax(dim=-1)
    scaled = logits.float() / temperature
    if top_k is not None:
        scaled = filter_top_k(scaled, top_k)
    if top_p is not None:
        scaled = filter_top_p(scaled, top_p)
    probs = torch.softmax(scaled, dim=-1)
    return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(-1)


def check_sampling(
    temperature: float, top_k: int | None, top_p: float | None, vocab_size: int
) -> None:
    """Clear errors for sampling arguments, naming each."""
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        raise TypeError(f"temperature: expected a number >= 0, got {temperature!r}")
    if not 0 <= temperature < float("inf"):  # also refuses NaN
        raise ValueError(
            f"temperature: expected a finite number >= 0 (0 = greedy), got {temperature}"
        )
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"top_k: expected an int >= 1 or None, got {top_k!r}")
    if top_p is not None and (
        isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0 < top_p <= 1
    ):
        raise ValueError(f"top_p: expected a probability in (0, 1] or None, got {top_p!r}")
    if top_k is not None and top_k > vocab_size:
        raise ValueError(f"top_k: {top_k} exceeds the vocabulary size {vocab_size}")
