"""What the options of an `AttentionRequest` (qkv.attention.request) mean as tensors, for the
backends that build them: the bool mask of what may be attended (causal, window and sinks, a
sparse pattern, per-row lengths, a bool mask), the sum of the additive terms (bias, a float
mask, ALiBi's -slope_h * |i' - j|, Press et al. 2022), ALiBi folded into a `score_mod` for
backends that compute scores where they need them, and the indices `score_mod` receives.

SDPA's plain calls (no mask, causal with L_q == L_k or one query) build none of them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from qkv.attention import masks
from qkv.attention.request import AttentionRequest
from qkv.attention.sparse import dense_mask
from qkv.attention.tiles import TilePlan

__all__ = [
    "additive",
    "alibi_bias",
    "allowed",
    "dense_additive",
    "score_indices",
    "score_mod_with_alibi",
    "structural_mask",
    "structural_visibility",
    "structure_key",
]


def structural_mask(request: AttentionRequest) -> torch.Tensor | None:
    """The bool (L_q, L_k) mask implied by `causal`, `window`, `sinks` and `pattern` ((B,
    1, L_q, L_k) with per-row lengths), or None. Shared between calls of one structure (do
    not modify it in place)."""
    key = structure_key(request)
    if key is not None:
        return structural_visibility(*key)
    sinks = request.sinks if request.window is not None else 0
    if request.lengths is not None or request.query_lengths is not None:
        return row_visibility(request)
    return _structure(
        request.query_len, request.key_len, request.causal, request.window, sinks,
        request.q.device, request.pattern,
    )  # fmt: skip


def structure_key(request: AttentionRequest) -> tuple | None:
    """(L_q, L_k, causal, window, sinks, device, pattern): what the structural mask depends
    on; None where it is not to be cached (traced lengths, over MAX_CACHED_SCORES, no
    structure)."""
    if torch.compiler.is_compiling():  # traced lengths are symbols, no key to cache under
        return None
    structured = request.causal or request.window is not None or request.pattern is not None
    per_row = request.lengths is not None or request.query_lengths is not None
    if not structured or per_row:
        return None
    if request.query_len * request.key_len > MAX_CACHED_SCORES:
        return None
    sinks = request.sinks if request.window is not None else 0
    return (
        request.query_len, request.key_len, request.causal, request.window, sinks,
        request.q.device, request.pattern,
    )  # fmt: skip


def row_visibility(request: AttentionRequest) -> torch.Tensor:
    """Bool (B, 1, L_q, L_k) of a call with per-row lengths: the tiled backend's rule
    (`TilePlan.visible`), row by row."""
    plan = TilePlan(
        query_len=request.query_len, key_len=request.key_len, block_q=1, block_k=1,
        causal=request.causal, window=request.window,
        sinks=request.sinks if request.window is not None else 0, lengths=request.lengths,
        has_dense_mask=False, pattern=request.pattern, query_lengths=request.query_lengths,
    )  # fmt: skip
    device = request.q.device
    visible = plan.visible(torch.arange(request.query_len, device=device),
                           torch.arange(request.key_len, device=device))  # fmt: skip
    return visible.expand(request.batch, 1, request.query_len, request.key_len)


def allowed(request: AttentionRequest) -> torch.Tensor | None:
    """Every boolean constraint at once (causal, window, bool mask), broadcastable, or None."""
    return masks.combine(structural_mask(request), request.mask if request.has_bool_mask else None)


def additive(request: AttentionRequest) -> torch.Tensor | None:
    """The sum of the additive terms (bias, a float mask, ALiBi), or None if there are none."""
    return masks.combine(dense_additive(request), alibi_bias(request))


def dense_additive(request: AttentionRequest) -> torch.Tensor | None:
    """The additive terms given as tensors (bias, a float mask), summed, or None: what a
    backend that applies ALiBi per score (`score_mod_with_alibi`) adds."""
    return masks.combine(request.bias, request.mask if request.has_additive_mask else None)


def alibi_bias(request: AttentionRequest) -> torch.Tensor | None:
    """ALiBi's -slope_h * |i' - j| from `alibi_slopes`, (1, H, L_q, L_k), or None; fp32
    (fp64 for fp64 slopes)."""
    if request.alibi_slopes is None:
        return None
    query_pos = torch.arange(request.query_len, device=request.q.device).view(-1, 1)
    key_pos = torch.arange(request.key_len, device=request.q.device).view(1, -1)
    distance = (query_pos + (request.key_len - request.query_len) - key_pos).abs()  # (L_q, L_k)
    dtype = torch.promote_types(request.alibi_slopes.dtype, torch.float32)
    slopes = request.alibi_slopes.to(dtype).view(1, -1, 1, 1)  # (1, H, 1, 1)
    return -slopes * distance


def score_mod_with_alibi(request: AttentionRequest) -> Callable | None:
    """`score_mod` with ALiBi folded in before it, for backends that compute scores where
    they need them (tiles, FlexAttention) rather than adding a dense (L_q, L_k) bias."""
    if request.alibi_slopes is None:
        return request.score_mod
    slopes, after = request.alibi_slopes, request.score_mod
    aligned = request.key_len == request.query_len  # then i' = i: one add per score less
    # a tensor, not an int: a compiled kernel would be specialised to every value of an int
    offset = request.key_len - request.query_len
    shift = None if aligned else torch.tensor(offset, device=request.q.device)

    def distance(q_idx, k_idx):  # i' - j
        return q_idx - k_idx if aligned else q_idx + shift - k_idx

    if request.causal:  # every visible key lies at or before the query: no abs() needed

        def alibi(score, batch, head, q_idx, k_idx):
            score = score - slopes[head] * distance(q_idx, k_idx)
            return score if after is None else after(score, batch, head, q_idx, k_idx)

    else:

        def alibi(score, batch, head, q_idx, k_idx):
            score = score - slopes[head] * distance(q_idx, k_idx).abs()
            return score if after is None else after(score, batch, head, q_idx, k_idx)

    return alibi


def score_indices(request: AttentionRequest) -> tuple[torch.Tensor, ...]:
    """(batch, head, query, key) indices shaped to broadcast over (B, H, L_q, L_k): what
    `score_mod` receives on the backends that apply it to the whole score matrix."""
    device = request.q.device
    return (
        torch.arange(request.batch, device=device).view(-1, 1, 1, 1),
        torch.arange(request.num_heads, device=device).view(1, -1, 1, 1),
        torch.arange(request.query_len, device=device).view(1, 1, -1, 1),
        torch.arange(request.key_len, device=device).view(1, 1, 1, -1),
    )


# A model asks for the same causal/window mask in every layer and decoding step: masks up to
# this many scores (16 MiB of bool) are built once, a few of them kept.
MAX_CACHED_SCORES = 2**24


@functools.lru_cache(maxsize=8)
def structural_visibility(
    L_q, L_k, causal, window, sinks, device, pattern=None
) -> torch.Tensor | None:
    """`AttentionRequest.structural_mask` for one structure, kept for the next call."""
    return _structure(L_q, L_k, causal, window, sinks, device, pattern)


def _structure(L_q, L_k, causal, window, sinks, device, pattern=None) -> torch.Tensor | None:
    causal_mask = masks.causal(L_q, L_k, device=device) if causal else None
    window_mask = (
        masks.sliding_window(L_q, L_k, window, sinks=sinks, device=device)
        if window is not None
        else None
    )
    sparse_mask = None if pattern is None else dense_mask(pattern, L_q, L_k, device=device)
    return masks.combine(causal_mask, window_mask, sparse_mask)
