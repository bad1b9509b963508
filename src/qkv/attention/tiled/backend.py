"""Backend `tiled`: `qkv.flash_attention` serving `qkv.attention` calls.

`auto` prefers it to SDPA only where SDPA would have to be handed a dense (L_q, L_k) mask or
bias that qkv builds for it (a sliding window, ALiBi) and the tiles that causal and the window
hide are many: there the tiled loop skips them, while SDPA computes every score and reads the
mask. Where SDPA cannot serve (soft-capping, a score_mod) it is preferred to the reference math
for all but small calls. FlexAttention (`flex`), where it runs, comes before it.
"""

from __future__ import annotations

import torch

from qkv.attention import sdpa
from qkv.attention.request import AttentionRequest
from qkv.attention.tiled.function import (
    DEFAULT_BLOCK_K,
    DEFAULT_BLOCK_Q,
    PATTERN_BLOCK,
    refusal,
    tiled_attention,
)
from qkv.attention.tiles import TilePlan

name = "tiled"
summary = "FlashAttention in PyTorch: online softmax over tiles, O(L) memory, skips hidden tiles"

# On the CPU tiled costs more than SDPA per computed score (benchmarks/flash.py, patterns.py):
# it wins where the structure hides enough scores that SDPA, handed a dense mask, computes in
# vain, and the call is long enough: from 1024^2 scores in fp32 (forward + backward 0.88x
# SDPA's time at L = 1024 with a 1024-key causal window), 2048^2 in bf16 (1.14x at 1024).
MIN_SCORES_FOR_WINDOW = {torch.float32: 1024 * 1024, torch.float64: 1024 * 1024}
MIN_SCORES_LOW_PRECISION = 2048 * 2048
# ALiBi: SDPA needs a (H, L_q, L_k) bias, which qkv builds at every call (forward + backward,
# bf16, L = 1024: tiled 38 ms, qkv's SDPA call 54 ms, raw SDPA with a ready bias 30 ms).
MIN_SCORES_ALIBI = 1024 * 1024
MAX_VISIBLE_FRACTION = 0.6  # the structure must hide at least 40% of the scores
# Soft-capping or a score_mod, which SDPA cannot apply: tiled against the reference math,
# 0.27x its time (forward + backward, fp32, L = 1024); small calls stay with the reference.
MIN_SCORES_MODIFIED = 512 * 512


def why_not(request: AttentionRequest) -> str | None:
    return refusal(request)


def why_not_auto(request: AttentionRequest) -> str | None:
    """Why `auto` passes over a request this backend could serve: another is faster there."""
    if torch.compiler.is_compiling():  # its tile loops would specialise a graph on the lengths
        return "inside a compiled graph SDPA or the reference math is traced and fused instead"
    scores = request.query_len * request.key_len
    if request.modifies_scores:  # SDPA cannot serve it: tiled or the reference math
        if scores < MIN_SCORES_MODIFIED:
            return f"L_q * L_k = {scores} < {MIN_SCORES_MODIFIED}: the reference math is faster"
        return None
    if request.pattern is not None:
        return _why_not_pattern(request, scores)
    if request.window is None and request.alibi_slopes is None:
        return "no window whose hidden tiles it could skip: SDPA's fused kernel is faster"
    if request.mask is not None or request.bias is not None:
        return "the call brings its own dense mask or bias, which SDPA reads as well as tiles do"
    least = MIN_SCORES_FOR_WINDOW.get(request.q.dtype, MIN_SCORES_LOW_PRECISION)
    if request.alibi_slopes is not None:  # SDPA's (H, L_q, L_k) bias is built at every call
        least = min(least, MIN_SCORES_ALIBI)
    if scores < least:
        return f"L_q * L_k = {scores} < {least}: SDPA with a dense mask is faster"
    visible = visible_fraction(request)
    if visible > MAX_VISIBLE_FRACTION:
        return (
            f"causal/window leave ~{visible:.0%} of the scores visible: SDPA computing all of "
            f"them is still faster"
        )
    return None


def _why_not_pattern(request: AttentionRequest, scores: int) -> str | None:
    """A sparse pattern: tiled skips the blocks it hides, where SDPA reads a dense mask."""
    if sdpa.repads(request):
        return "packed sequences: SDPA runs them as a padded batch, faster than tiles"
    least = MIN_SCORES_FOR_WINDOW.get(request.q.dtype, MIN_SCORES_LOW_PRECISION)
    if scores < least:
        return f"L_q * L_k = {scores} < {least}: SDPA with the pattern's dense mask is faster"
    computed, total = computed_tiles(request)
    if computed > MAX_VISIBLE_FRACTION * total:
        return (
            f"the pattern leaves {computed} of {total} tiles to compute: SDPA computing every "
            f"score is still faster"
        )
    return None


def computed_tiles(request: AttentionRequest) -> tuple[int, int]:
    """(tiles computed, tiles in all) at the tile size of pattern calls, for causal, window
    and pattern together."""
    plan = TilePlan(
        query_len=request.query_len, key_len=request.key_len, block_q=PATTERN_BLOCK,
        block_k=PATTERN_BLOCK, causal=request.causal, window=request.window,
        sinks=request.sinks, lengths=None, has_dense_mask=False, pattern=request.pattern,
    )  # fmt: skip
    computed = sum(len(row) for row in plan.tiles())
    return computed, len(plan.query_blocks()) * len(plan.key_blocks())


def visible_fraction(request: AttentionRequest) -> float:
    """The share of the L_q x L_k scores that causal and the window leave visible."""
    left, right = request.window if request.window is not None else (request.key_len,) * 2
    right = 0 if request.causal else right
    position = torch.arange(request.query_len) + (request.key_len - request.query_len)
    first = (position - left).clamp(min=0)
    last = (position + right).clamp(max=request.key_len - 1)
    seen = (last - first + 1).clamp(min=0).sum().item()
    return seen / (request.query_len * request.key_len)


def notes(request: AttentionRequest) -> list[str]:
    mask_bytes = request.query_len * request.key_len * request.batch
    block_q, block_k = DEFAULT_BLOCK_Q, DEFAULT_BLOCK_K
    if request.pattern is not None:
        block_q = block_k = PATTERN_BLOCK
    out = [
        f"tiles of {block_q} queries x {block_k} keys; tiles hidden by the "
        f"causal/window structure or the sparse pattern are skipped",
        f"no dense mask: SDPA would need one of {mask_bytes / 2**20:.1f} MiB (bool) and "
        f"would compute every hidden score",
        "saves only O and the log-sum-exp; the backward recomputes each tile",
    ]
    if request.pattern is not None:
        computed, total = computed_tiles(request)
        out.append(f"sparse pattern: {computed} of {total} tiles computed ({computed / total:.1%})")
    return out


def run(request: AttentionRequest) -> tuple[torch.Tensor, None]:
    block = PATTERN_BLOCK if request.pattern is not None else None
    output = tiled_attention(
        request, block_q=block or DEFAULT_BLOCK_Q, block_k=block or DEFAULT_BLOCK_K
    )
    return output, None
