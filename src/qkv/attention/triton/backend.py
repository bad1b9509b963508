"""Backend `triton`: qkv's FlashAttention-2 Triton kernels serving `qkv.attention` calls.

Layer 3 of 3. Knows when the kernels apply without importing Triton, so `import qkv` never
needs it. `auto` picks it on CUDA tensors it can serve once the kernels have passed their
self-check on that device (`selfcheck`: a few small calls against SDPA, once per process);
on CPU it runs only when named and TRITON_INTERPRET=1 is set (the interpreter is for testing,
far slower than any other backend).
"""

from __future__ import annotations

import importlib.util
import os

import torch

from qkv.attention.offset_bias import OffsetBias
from qkv.attention.request import AttentionRequest
from qkv.attention.triton.function import kernel_attention, refusal
from qkv.attention.triton.selfcheck import self_check, verdicts

name = "triton"
summary = "qkv's FlashAttention-2 Triton kernels (GPU): fused, O(L) memory, hidden blocks skipped"


# TRITON_INTERPRET=1 runs the kernels in Triton's interpreter; read once, as Triton reads it
# once, when it is imported.
_INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"


def why_not(request: AttentionRequest) -> str | None:
    if request.q.device.type != "cuda" and not _INTERPRETING:
        return "it needs CUDA tensors (or TRITON_INTERPRET=1, for tests)"
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    return refusal(request)


def why_not_auto(request: AttentionRequest) -> str | None:
    if request.q.device.type != "cuda":
        return "CPU tensors: the Triton interpreter is for tests, far slower than SDPA"
    if request.plain:
        return "a plain call (no window, pattern, ALiBi, soft-cap or score_mod): SDPA's own"
    failed = self_check(request.q.device)
    if failed is not None:
        return f"its self-check against SDPA on {request.q.device} did not pass: {failed}"
    return None


def notes(request: AttentionRequest) -> list[str]:
    out = ["one program per (query block, head); K/V streamed through SRAM; exp2 online softmax"]
    if verdicts().get(str(request.q.device), "") is None:
        out.append(f"passed its self-check against SDPA on {request.q.device} (selfcheck.CASES)")
    if request.causal or request.window is not None:
        out.append("key blocks hidden by the causal/window structure are never loaded")
    if request.pattern is not None:
        out.append("sparse pattern: only the listed blocks it leaves visible are loaded")
    if request.group_size > 1:
        out.append(f"GQA/MQA: each query head reads K/V head h // {request.group_size}, no copy")
    if isinstance(request.score_mod, OffsetBias):
        out.append("relative positions: the offset bias is read per tile from its O(L) values")
    return out


def run(request: AttentionRequest) -> tuple[torch.Tensor, None]:
    return kernel_attention(request), None
