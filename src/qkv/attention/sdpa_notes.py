"""What `qkv.explain` says of the `sdpa` backend: how `sdpa.run` will serve a request (which
mask it builds, which rows it fixes, which dtype it computes in), read from sdpa.py's own rules."""

from __future__ import annotations

from qkv.attention import sdpa
from qkv.attention.request import AttentionRequest

__all__ = ["notes"]


def notes(request: AttentionRequest) -> list[str]:
    """One line per choice `sdpa.run` makes for `request`."""
    out = []
    if request.causal and sdpa._needs_mask(request):
        out.append("causal: folded into the one attn_mask, aligned bottom-right")
    elif request.causal and sdpa._plain_causal(request):
        out.append("causal with L_q == L_k: passed as is_causal=True, no mask tensor")
    elif request.causal and sdpa._sees_every_key(request) and request.window is None:
        out.append("causal with one query (a decoding step): it sees every key, no mask")
    elif request.causal:
        out.append(
            f"causal with L_q={request.query_len} != L_k={request.key_len}: an explicit "
            f"bottom-right mask (SDPA's is_causal aligns top-left)"
        )
    if request.window is not None:
        sinks = f" and {request.sinks} sink keys" if request.sinks else ""
        out.append(f"window {request.window}{sinks}: an explicit (L_q, L_k) mask")
    if request.alibi_slopes is not None:
        out.append("ALiBi: a dense (1, H, L_q, L_k) bias built from the slopes")
    if sdpa.repads(request):
        out.append(
            "packed sequences: gathered into a padded batch of sequences for the kernel, "
            "scattered back (no score across sequences is computed)"
        )
    elif request.pattern is not None:
        out.append("sparse pattern: an explicit (L_q, L_k) mask; every score is computed")
    if request.lengths is not None or request.query_lengths is not None:
        out.append("per-row lengths: an explicit (B, 1, L_q, L_k) mask")
    if sdpa._needs_mask(request):
        out.append(
            "rows with no visible key are unmasked for the kernel and their output zeroed "
            "(one extra pass over the mask)"
        )
    if sdpa._compute_dtype(request) != request.q.dtype:
        out.append(
            f"one {request.q.dtype} query on the CPU: computed in fp32 and cast back (PyTorch's "
            f"CPU kernel is several times slower for a single low-precision query)"
        )
    if request.group_size > 1:
        heads = f"GQA/MQA ({request.num_heads} query heads over {request.num_kv_heads} K/V heads)"
        if sdpa._stacks_group(request):
            how = "each group's queries stacked as its K/V head's rows, each K/V head read once"
        elif sdpa._HAS_ENABLE_GQA:
            how = "enable_gqa=True, K/V not repeated"
        else:
            how = "K/V repeated (torch < 2.5 has no enable_gqa)"
        out.append(f"{heads}: {how}")
    return out
