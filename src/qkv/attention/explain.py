"""`qkv.explain`: which backend `qkv.attention` would run for a call, and why, in words (the
choice is core.py's, made the same way; each backend's `notes` say how it serves the call)."""

from __future__ import annotations

import torch

from qkv.attention import core
from qkv.attention.request import AttentionRequest, takes_options

__all__ = ["explain"]


@takes_options
def explain(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, backend: str = "auto", **options
) -> str:
    """Which backend `attention` would run for these arguments, and why, in words."""
    request = AttentionRequest(q, k, v, **options)
    chosen = core._choose(request, backend)
    how = "named explicitly" if backend != "auto" else "the fastest backend that serves this call"
    lines = [
        f"backend {chosen.name!r}: {how}.",
        f"  {chosen.name}: {chosen.summary}",
        f"  call: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, {q.dtype}, "
        f"{q.device}",
    ]
    lines += [f"  - {note}" for note in chosen.notes(request)]
    if backend == "auto" and core._takes_sdpa_at_once(request):
        lines.append(
            "  taken without asking the others: a plain call (no window, sparse pattern, ALiBi "
            "slopes, soft-cap or score_mod), where PyTorch's fused kernels are the fastest"
        )
    elif backend == "auto":
        for name, other in core.BACKENDS.items():
            if name == chosen.name:
                break
            lines.append(f"  passed over {name!r}: {core._why_not_auto(other, request)}")
    return "\n".join(lines)
