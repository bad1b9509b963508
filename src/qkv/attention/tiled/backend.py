"""Backend `tiled`: `qkv.flash_attention` serving `qkv.attention` calls.

`auto` prefers it to SDPA only where SDPA would have to be handed a dense (L_q, L_k) mask that
qkv builds for it (a sliding window) and the tiles that the window hides are many: there the
tiled loop skips them, while SDPA computes every score and reads the mask.
"""

from __future__ import annotations

import torch

from qkv.attention.request import AttentionRequest
from qkv.attention.tiled.function import DEFAULT_BLOCK_K, DEFAULT_BLOCK_Q, flash_backend_call

name = "tiled"
summary = "FlashAttention in PyTorch: online softmax over tiles, O(L) memory, skips hidden tiles"

# On the CPU (benchmarks/flash.py, fp32, causal) tiled costs more than SDPA per computed score,
# and below 2048^2 scores SDPA with a dense mask is faster.
MIN_SCORES_FOR_WINDOW = 2048 * 2048
MAX_VISIBLE_FRACTION = 0.6  # the window must hide at least 40% of the scores


def why_not(request: AttentionRequest) -> str | None:
    if request.return_weights:
        return (
            "it returns no weights (recompute them exactly with qkv.attention_weights from the "
            "log-sum-exp of qkv.flash_attention(..., return_lse=True))"
        )
    return None


def why_not_auto(request: AttentionRequest) -> str | None:
    """Why `auto` passes over a request this backend could serve: SDPA is faster there."""
    if request.window is None:
        return "SDPA needs no dense mask for this call, and its fused kernel is faster"
    if request.mask is not None or request.bias is not None:
        return "the call brings its own dense mask or bias, which SDPA reads as well as tiles do"
    scores = request.query_len * request.key_len
    if scores < MIN_SCORES_FOR_WINDOW:
        if torch.compiler.is_compiling():  # printing symbolic lengths would specialise the
            # graph on their values: a recompilation at every decoding step
            return f"L_q * L_k < {MIN_SCORES_FOR_WINDOW}: SDPA with a dense mask is faster"
        return f"L_q * L_k = {scores} < {MIN_SCORES_FOR_WINDOW}: SDPA with a dense mask is faster"
    visible = min(1.0, (request.window[0] + request.window[1] + 1) / request.key_len)
    if visible > MAX_VISIBLE_FRACTION:
        return (
            f"the window leaves ~{visible:.0%} of the scores visible: SDPA computing all of them "
            f"is still faster"
        )
    return None


def notes(request: AttentionRequest) -> list[str]:
    mask_bytes = request.query_len * request.key_len * request.batch
    return [
        f"tiles of {DEFAULT_BLOCK_Q} queries x {DEFAULT_BLOCK_K} keys; tiles hidden by the "
        f"causal/window structure are skipped",
        f"no dense mask: SDPA would need one of {mask_bytes / 2**20:.1f} MiB (bool) and "
        f"would compute every hidden score",
        "saves only O and the log-sum-exp; the backward recomputes each tile",
    ]


def run(request: AttentionRequest) -> tuple[torch.Tensor, None]:
    return flash_backend_call(request), None
