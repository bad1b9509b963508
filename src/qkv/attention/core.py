"""`qkv.attention`: one entry point, several backends, one set of conventions (explain.py says,
for `qkv.explain`, which backend a call gets and why).

A backend is a module (or any object) with:
    name: str, summary: str,
    why_not(request) -> str | None     None if it can serve the request, else the reason,
    why_not_auto(request) (optional)   why `auto` should pass it over although it could serve,
    notes(request) -> list[str]        how it will serve it, for `explain`,
    run(request) -> (output, weights or None).
`auto` takes the first backend in `BACKENDS` (ordered fastest first) that can serve the request;
`BACKENDS` changes through `register_backend`. A plain request (`AttentionRequest.plain`) goes
to SDPA without asking the others: PyTorch's fused kernels are the fastest there on every
device, and a decoding step does not walk the registry in every layer.
"""

from __future__ import annotations

import itertools
from types import ModuleType

import torch

from qkv.attention import reference, sdpa
from qkv.attention.request import AttentionRequest, takes_options

# Fastest first: `auto` walks this order. Later backends (tiled, triton) register themselves.
BACKENDS: dict[str, ModuleType] = {sdpa.name: sdpa, reference.name: reference}
# qkv's own backends, which `auto` puts ahead of SDPA and which pass a plain call over
_PASS_PLAIN_CALLS = {"flex", "tiled", "triton"}


def register_backend(backend, *, before: str | None = None) -> None:
    """Add a backend; `before` names the backend it should be preferred to by `auto`."""
    items = [(n, b) for n, b in BACKENDS.items() if n != backend.name]
    index = next((i for i, (n, _) in enumerate(items) if n == before), len(items))
    items.insert(index, (backend.name, backend))
    BACKENDS.clear()
    BACKENDS.update(items)


@takes_options
def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, backend: str = "auto", **options
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Scaled dot-product attention, softmax(Q K^T * scale + bias) V (Vaswani et al. 2017, s3.2.1).

    The options (mask to return_weights) make one `AttentionRequest`, which checks them once.

    Args:
        q: (B, H, L_q, D). k: (B, H_kv, L_k, D). v: (B, H_kv, L_k, D_v). H % H_kv == 0: H_kv < H
            is grouped-query attention, H_kv == 1 multi-query (Shazeer 2019; Ainslie et al. 2023).
        mask: bool, True where a query MAY attend, or a float additive mask; (L_q, L_k) or
            4-D broadcastable to (B, H, L_q, L_k). Build one with `qkv.masks`.
        causal: each query sees keys at or before its position, aligned bottom-right when
            L_q != L_k (see `qkv.masks.causal`).
        scale: multiplies Q K^T; default 1/sqrt(D).
        bias: additive float scores, e.g. ALiBi (`qkv.positional.alibi_bias`); same shapes as mask.
        window: int W (each query sees itself and the W - 1 keys before it) or (left, right).
        sinks: the first `sinks` keys stay visible on top of the window (attention sinks,
            StreamingLLM: Xiao et al. 2024); never further ahead than causal or the window allow.
        alibi_slopes: (H,) slopes m_h of ALiBi (Press et al. 2022), adding -m_h * |i' - j|
            without a dense bias (`qkv.positional.alibi_slopes`); constants, no gradient.
        softcap: scores -> softcap * tanh(scores / softcap) before any bias (Gemma 2).
        score_mod: f(score, batch, head, q_idx, k_idx) -> score, FlexAttention's signature
            (Dong et al. 2024): applied after the biases, before the masks, with raw (not
            aligned) query indices; written with torch ops, it receives broadcastable index
            tensors on some backends and scalars on others.
        pattern: a sparse pattern of visible (query, key) pairs (`qkv.attention.sparse`:
            windows, dilated and strided heads, global tokens, BigBird's random blocks, and
            their unions), intersected with everything else; the tiled backend computes only
            the blocks it leaves visible. Needs L_q <= L_k.
        lengths: (B,) integers, the real keys of each batch row (keys past them are padding):
            padding without a mask tensor.
        query_lengths: (B,) integers, the real queries of each row (later ones are padding
            and get output 0). Given, causal and windows align each row on its own, its last
            real query with its last real key (FlashAttention's varlen rule); without it, they
            align the padded L_q with the padded L_k.
        dropout_p: dropout on the attention weights, applied whenever > 0: modules pass 0 in
            eval mode (as with `F.scaled_dot_product_attention`).
        return_weights: also return the weights (B, H, L_q, L_k) that multiplied V.
        backend: "auto" (the fastest that serves the request; see `qkv.explain`) or a name
            in `qkv.BACKENDS`.

    Returns:
        output (B, H, L_q, D_v) in q's dtype, or (output, weights) if return_weights.
        A query with no visible key gets output 0 (and weights 0), with finite gradients.
        A NaN in a float mask or bias at a visible position makes its query's output NaN on
        every backend (the NaN rule of `qkv.attention.masks`).

    Raises:
        TypeError/ValueError naming the argument: wrong types, shapes or dtypes, a head dim
        of 0, a mask or bias on another device than q.
    """
    request = AttentionRequest(q, k, v, **options)
    chosen = _choose(request, backend)
    if request.key_len == 0:  # nothing to attend to: every row is empty
        output, weights = _empty_keys(request)
    else:
        output, weights = chosen.run(request)
    return (output, weights) if request.return_weights else output


@takes_options
def serving_backends(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **options) -> list[str]:
    """Names of the backends that can serve `attention(q, k, v, **options)`, fastest first."""
    request = AttentionRequest(q, k, v, **options)
    return [name for name, backend in BACKENDS.items() if backend.why_not(request) is None]


def _choose(request: AttentionRequest, backend: str):
    if not isinstance(backend, str):
        raise TypeError(f"backend: expected a str, got {type(backend).__name__}")
    if backend == "auto":
        if _takes_sdpa_at_once(request):
            return sdpa
        for candidate in BACKENDS.values():
            if _why_not_auto(candidate, request) is None:
                return candidate
        raise RuntimeError("no attention backend can serve this request")  # reference serves all
    if backend not in BACKENDS:
        raise ValueError(
            f"backend: unknown backend {backend!r}; expected 'auto' or one of {list(BACKENDS)}"
        )
    chosen = BACKENDS[backend]
    reason = chosen.why_not(request)
    if reason is not None:
        raise ValueError(
            f"backend: {backend!r} cannot serve this request: {reason}; use backend='auto' "
            f"or one that can (see qkv.explain)"
        )
    return chosen


def _takes_sdpa_at_once(request: AttentionRequest) -> bool:
    """A plain call SDPA serves, with no backend of a user's ahead of it in `BACKENDS`."""
    if not request.plain or _why_not_auto(sdpa, request) is not None:
        return False
    ahead = itertools.takewhile(lambda name: name != sdpa.name, BACKENDS)
    return all(name in _PASS_PLAIN_CALLS for name in ahead)


def _why_not_auto(backend, request: AttentionRequest) -> str | None:
    """Why `auto` skips a backend: it cannot serve the call, or it can but another is faster."""
    reason = backend.why_not(request)
    if reason is None and hasattr(backend, "why_not_auto"):
        reason = backend.why_not_auto(request)
    return reason


def _empty_keys(request: AttentionRequest) -> tuple[torch.Tensor, torch.Tensor | None]:
    """L_k == 0: every query row is fully masked, so the output is 0 (kernels reject L_k = 0)."""
    B, H, L_q, _ = request.q.shape
    output = request.q.new_zeros(B, H, L_q, request.v.shape[-1])
    weights = request.q.new_zeros(B, H, L_q, 0) if request.return_weights else None
    return output, weights
