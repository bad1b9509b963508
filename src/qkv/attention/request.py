"""One attention call, checked once: the arguments of `qkv.attention` and the shapes they imply.

Every backend receives an `AttentionRequest` and never re-validates. Bad input fails here with a
ValueError/TypeError naming the argument, what was seen and what was expected.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from qkv.attention import masks
from qkv.attention.sparse import SparsePattern, dense_mask
from qkv.attention.tiles import TilePlan


@dataclass(frozen=True)
class AttentionRequest:
    """Validated arguments of one `qkv.attention` call.

    q: (B, H, L_q, D); k: (B, H_kv, L_k, D); v: (B, H_kv, L_k, D_v), with H % H_kv == 0.
    mask: bool (True = may attend) or additive float, 2-D (L_q, L_k) or 4-D broadcastable to
    (B, H, L_q, L_k). bias: additive float, same shapes. window: (left, right) key counts.
    sinks: first keys visible on top of the window. alibi_slopes: (H,) float. softcap: > 0.
    score_mod: f(score, batch, head, q_idx, k_idx) -> score. pattern: a sparse pattern
    (qkv.attention.sparse), intersected with the rest; L_q <= L_k. lengths: real keys per batch
    row (the rest is padding); query_lengths: real queries per row, whose presence aligns each
    row on its own: i' = i + lengths[b] - query_lengths[b] (both tuples of ints).

    The score of query i and key j, in this order (every backend computes this):
        s = scale * q_i . k_j                            (fp32 at least)
        s = softcap * tanh(s / softcap)                  (Gemma 2), if softcap
        s = s + bias + float mask - slope_h * |i' - j|   (ALiBi), each if given
        s = score_mod(s, b, h, i, j)                     (FlexAttention's signature), if given
        s = -inf where causal, window (with sinks), a pattern, a bool mask or padding hides j
    with i' = i + L_k - L_q, the query aligned bottom-right (per row with query_lengths);
    score_mod gets the raw index i.
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    mask: torch.Tensor | None
    causal: bool
    scale: float
    bias: torch.Tensor | None
    window: tuple[int, int] | None
    dropout_p: float
    return_weights: bool
    sinks: int = 0
    alibi_slopes: torch.Tensor | None = None
    softcap: float | None = None
    score_mod: Callable | None = None
    pattern: SparsePattern | None = None
    lengths: tuple[int, ...] | None = None
    query_lengths: tuple[int, ...] | None = None

    @property
    def batch(self) -> int:
        return self.q.shape[0]

    @property
    def num_heads(self) -> int:
        return self.q.shape[1]

    @property
    def num_kv_heads(self) -> int:
        return self.k.shape[1]

    @property
    def query_len(self) -> int:
        return self.q.shape[2]

    @property
    def key_len(self) -> int:
        return self.k.shape[2]

    @property
    def group_size(self) -> int:
        """Query heads per key/value head: 1 for MHA, H for MQA, in between for GQA."""
        return self.num_heads // self.num_kv_heads

    @property
    def has_bool_mask(self) -> bool:
        return self.mask is not None and self.mask.dtype == torch.bool

    @property
    def has_additive_mask(self) -> bool:
        return self.mask is not None and self.mask.dtype != torch.bool

    @property
    def modifies_scores(self) -> bool:
        """Whether scores pass through a soft-cap or a score_mod (no fused SDPA kernel can)."""
        return self.softcap is not None or self.score_mod is not None

    def structural_mask(self) -> torch.Tensor | None:
        """The bool (L_q, L_k) mask implied by `causal`, `window`, `sinks` and `pattern` ((B,
        1, L_q, L_k) with per-row lengths), or None. Shared between calls of one structure (do
        not modify it in place)."""
        key = self.structure_key()
        if key is not None:
            return structural_visibility(*key)
        sinks = self.sinks if self.window is not None else 0
        if self.lengths is not None or self.query_lengths is not None:
            return self.row_visibility()
        return _structure(
            self.query_len, self.key_len, self.causal, self.window, sinks, self.q.device,
            self.pattern,
        )  # fmt: skip

    def structure_key(self) -> tuple | None:
        """(L_q, L_k, causal, window, sinks, device, pattern): what the structural mask depends
        on; None where it is not to be cached (traced lengths, over MAX_CACHED_SCORES, no
        structure)."""
        structured = self.causal or self.window is not None or self.pattern is not None
        per_row = self.lengths is not None or self.query_lengths is not None
        if torch.compiler.is_compiling() or not structured or per_row:
            return None
        if self.query_len * self.key_len > MAX_CACHED_SCORES:
            return None
        sinks = self.sinks if self.window is not None else 0
        return (
            self.query_len, self.key_len, self.causal, self.window, sinks, self.q.device,
            self.pattern,
        )  # fmt: skip

    def row_visibility(self) -> torch.Tensor:
        """Bool (B, 1, L_q, L_k) of a call with per-row lengths: the tiled backend's rule
        (`TilePlan.visible`), row by row."""
        plan = TilePlan(
            query_len=self.query_len, key_len=self.key_len, block_q=1, block_k=1,
            causal=self.causal, window=self.window,
            sinks=self.sinks if self.window is not None else 0, lengths=self.lengths,
            has_dense_mask=False, pattern=self.pattern, query_lengths=self.query_lengths,
        )  # fmt: skip
        device = self.q.device
        visible = plan.visible(torch.arange(self.query_len, device=device),
                               torch.arange(self.key_len, device=device))  # fmt: skip
        return visible.expand(self.batch, 1, self.query_len, self.key_len)

    def allowed(self) -> torch.Tensor | None:
        """Every boolean constraint at once (causal, window, bool mask), broadcastable, or None."""
        return masks.combine(self.structural_mask(), self.mask if self.has_bool_mask else None)

    def additive(self) -> torch.Tensor | None:
        """The sum of the additive terms (bias, a float mask, ALiBi), or None if there are none."""
        return masks.combine(
            self.bias, self.mask if self.has_additive_mask else None, self.alibi_bias()
        )

    def alibi_bias(self) -> torch.Tensor | None:
        """ALiBi's -slope_h * |i' - j| from `alibi_slopes`, (1, H, L_q, L_k), or None; fp32
        (fp64 for fp64 slopes)."""
        if self.alibi_slopes is None:
            return None
        query_pos = torch.arange(self.query_len, device=self.q.device).view(-1, 1)
        key_pos = torch.arange(self.key_len, device=self.q.device).view(1, -1)
        distance = (query_pos + (self.key_len - self.query_len) - key_pos).abs()  # (L_q, L_k)
        dtype = torch.promote_types(self.alibi_slopes.dtype, torch.float32)
        slopes = self.alibi_slopes.to(dtype).view(1, -1, 1, 1)  # (1, H, 1, 1)
        return -slopes * distance

    def score_mod_with_alibi(self) -> Callable | None:
        """`score_mod` with ALiBi folded in before it, for backends that compute scores where
        they need them (tiles, FlexAttention) rather than adding a dense (L_q, L_k) bias."""
        if self.alibi_slopes is None:
            return self.score_mod
        slopes, after = self.alibi_slopes, self.score_mod
        aligned = self.key_len == self.query_len  # then i' = i: one add per score less
        # a tensor, not an int: a compiled kernel would be specialised to every value of an int
        shift = (
            None if aligned else torch.tensor(self.key_len - self.query_len, device=self.q.device)
        )

        def distance(q_idx, k_idx):  # i' - j
            return q_idx - k_idx if aligned else q_idx + shift - k_idx

        if self.causal:  # every visible key lies at or before the query: no abs() needed

            def alibi(score, batch, head, q_idx, k_idx):
                score = score - slopes[head] * distance(q_idx, k_idx)
                return score if after is None else after(score, batch, head, q_idx, k_idx)

        else:

            def alibi(score, batch, head, q_idx, k_idx):
                score = score - slopes[head] * distance(q_idx, k_idx).abs()
                return score if after is None else after(score, batch, head, q_idx, k_idx)

        return alibi

    def score_indices(self) -> tuple[torch.Tensor, ...]:
        """(batch, head, query, key) indices shaped to broadcast over (B, H, L_q, L_k): what
        `score_mod` receives on the backends that apply it to the whole score matrix."""
        device = self.q.device
        return (
            torch.arange(self.batch, device=device).view(-1, 1, 1, 1),
            torch.arange(self.num_heads, device=device).view(1, -1, 1, 1),
            torch.arange(self.query_len, device=device).view(1, 1, -1, 1),
            torch.arange(self.key_len, device=device).view(1, 1, 1, -1),
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


def make_request(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    mask: torch.Tensor | None,
    causal: bool,
    scale: float | None,
    bias: torch.Tensor | None,
    window: int | tuple[int, int] | None,
    dropout_p: float,
    return_weights: bool,
    sinks: int = 0,
    alibi_slopes: torch.Tensor | None = None,
    softcap: float | None = None,
    score_mod: Callable | None = None,
    pattern: SparsePattern | None = None,
    lengths: torch.Tensor | None = None,
    query_lengths: torch.Tensor | None = None,
) -> AttentionRequest:
    """Check every argument of `qkv.attention` and bundle them into an `AttentionRequest`."""
    _check_qkv(q, k, v)
    target = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])  # (B, H, L_q, L_k)
    if mask is not None:
        _check_score_shaped("mask", mask, target, q.device, allow_bool=True)
    if bias is not None:
        _check_score_shaped("bias", bias, target, q.device, allow_bool=False)
    if not isinstance(causal, bool):
        raise TypeError(f"causal: expected a bool, got {type(causal).__name__} {causal!r}")
    if not isinstance(return_weights, bool):
        raise TypeError(f"return_weights: expected a bool, got {return_weights!r}")
    return AttentionRequest(
        q=q,
        k=k,
        v=v,
        mask=mask,
        causal=causal,
        scale=_check_scale(scale, q.shape[-1]),
        bias=bias,
        window=None if window is None else masks._window_extent(window),
        dropout_p=_check_dropout(dropout_p),
        return_weights=return_weights,
        sinks=_check_sinks(sinks),
        alibi_slopes=_check_slopes(alibi_slopes, q.shape[1], q.device),
        softcap=check_softcap(softcap),
        score_mod=check_callable("score_mod", score_mod),
        pattern=check_pattern(pattern, q.shape[2], k.shape[2]),
        **check_row_lengths(lengths, query_lengths, q, k, pattern, alibi_slopes),
    )


def request_key(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    mask: torch.Tensor | None,
    causal: bool,
    scale: float | None,
    bias: torch.Tensor | None,
    window: int | tuple[int, int] | None,
    dropout_p: float,
    return_weights: bool,
    sinks: int = 0,
    alibi_slopes: torch.Tensor | None = None,
    softcap: float | None = None,
    score_mod: Callable | None = None,
    pattern: SparsePattern | None = None,
    lengths: torch.Tensor | None = None,
    query_lengths: torch.Tensor | None = None,
) -> tuple | None:
    """Everything `make_request` checks, as a hashable key; None for a call it cannot describe.

    Two calls with one key pass or fail the checks alike and differ only in tensor values, so a
    choice made for one (`qkv.attention` memoises `auto`'s) holds for the other. The key has
    each tensor's shape, dtype and device, never its values, and each option with its exact
    type: True == 1 == 1.0 in Python, but not for the checks. Tensor subclasses and options of
    other types (a list window) give None: such calls are simply checked every time. A score_mod
    counts by its presence (backends ask only whether there is one), and so does the need for
    gradients (FlexAttention has no backward on the CPU).
    """
    try:
        tensors = tuple(
            _tensor_key(t) for t in (q, k, v, mask, bias, alibi_slopes, lengths, query_lengths)
        )
        options = tuple(
            _option_key(o)
            for o in (causal, scale, window, dropout_p, return_weights, sinks, softcap)
        )
    except _NoKeyError:
        return None
    if score_mod is not None and not callable(score_mod):
        return None
    if pattern is not None and not isinstance(pattern, SparsePattern):
        return None
    needs_grad = torch.is_grad_enabled() and any(
        t is not None and t.is_floating_point() and t.requires_grad for t in (q, k, v, mask, bias)
    )
    return tensors + options + (score_mod is not None, needs_grad, pattern)


class _NoKeyError(Exception):
    """A value `request_key` does not describe."""


def _tensor_key(tensor: torch.Tensor | None) -> tuple | None:
    if tensor is None:
        return None
    if type(tensor) is not torch.Tensor:
        raise _NoKeyError
    return tensor.shape, tensor.dtype, tensor.device


def _option_key(value: object) -> tuple:
    kind = type(value)
    if kind in (bool, int, float, type(None)):
        return kind, value
    if kind is tuple:
        return kind, tuple(_option_key(item) for item in value)
    raise _NoKeyError


def _check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(
                f"{name}: expected 4 dimensions (B, H, L, D), got shape {tuple(t.shape)}"
            )
        if not t.is_floating_point():
            raise TypeError(f"{name}: expected a floating-point tensor, got dtype {t.dtype}")
    if not q.dtype == k.dtype == v.dtype:
        raise TypeError(f"q, k, v: expected one dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}")
    if not q.device == k.device == v.device:
        raise ValueError(
            f"q, k, v: expected one device, got q {q.device}, k {k.device}, v {v.device}"
        )
    if not q.shape[0] == k.shape[0] == v.shape[0]:
        raise ValueError(
            f"q, k, v: batch sizes differ: q {q.shape[0]}, k {k.shape[0]}, v {v.shape[0]}"
        )
    if k.shape[1] != v.shape[1] or k.shape[2] != v.shape[2]:
        raise ValueError(
            f"k, v: expected the same (H_kv, L_k), got k {tuple(k.shape[1:3])}, "
            f"v {tuple(v.shape[1:3])}"
        )
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q, k: head dims differ: q has D={q.shape[-1]}, k has D={k.shape[-1]}")
    # D = 0 leaves every score 0 (uniform weights over noise) and D_v = 0 an empty output:
    # no model means either, and the tiled kernels cannot even lay such rows out.
    if q.shape[-1] == 0 or v.shape[-1] == 0:
        raise ValueError(
            f"q, k, v: expected head dims D >= 1 and D_v >= 1, got D={q.shape[-1]}, "
            f"D_v={v.shape[-1]}"
        )
    H, H_kv = q.shape[1], k.shape[1]
    if H_kv == 0 or H % H_kv:
        raise ValueError(
            f"k: its {H_kv} key/value heads must divide the {H} query heads of q "
            f"(MHA: equal, GQA: a divisor, MQA: 1)"
        )


def _check_score_shaped(
    name: str,
    tensor: torch.Tensor,
    target: tuple[int, int, int, int],
    device: torch.device,
    *,
    allow_bool: bool,
) -> None:
    """A mask or bias must be 2-D (L_q, L_k) or 4-D, broadcast to (B, H, L_q, L_k), and live
    on q's device (the kernels would fail mid-call with a device mismatch of their own)."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.device != device:
        raise ValueError(
            f"{name}: on device {tensor.device}, expected q's device {device}; move it with "
            f"{name}.to(q.device)"
        )
    if not tensor.is_floating_point() and not (allow_bool and tensor.dtype == torch.bool):
        expected = (
            "bool (True = may attend) or floating point (additive)"
            if allow_bool
            else ("floating point (additive)")
        )
        raise TypeError(f"{name}: expected dtype {expected}, got {tensor.dtype}")
    if tensor.dim() not in (2, 4):
        raise ValueError(
            f"{name}: expected shape (L_q, L_k) or (B|1, H|1, L_q|1, L_k), got "
            f"{tuple(tensor.shape)}; a 3-D (B, L_q, L_k) mask needs .unsqueeze(1) so that B "
            f"does not broadcast against the head axis"
        )
    aligned = target[-tensor.dim() :]
    # `size != 1 and size != want`, not `size not in (1, want)`: under torch.compile, a symbolic
    # `want` (a batch size) made the tuple test fail for a size of 1
    if any(size != 1 and size != want for size, want in zip(tensor.shape, aligned, strict=True)):
        raise ValueError(
            f"{name}: shape {tuple(tensor.shape)} does not broadcast to (B, H, L_q, L_k) = {target}"
        )


def _check_scale(scale: float | None, head_dim: int) -> float:
    if scale is None:
        return 1.0 / math.sqrt(head_dim) if head_dim else 1.0
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale: expected a float or None, got {type(scale).__name__} {scale!r}")
    if not math.isfinite(scale):
        raise ValueError(f"scale: expected a finite number, got {scale}")
    return float(scale)


def _check_sinks(sinks: int) -> int:
    if isinstance(sinks, bool) or not isinstance(sinks, int) or sinks < 0:
        raise ValueError(
            f"sinks: expected an int >= 0, got {sinks!r} (the first keys, visible on top of a "
            f"window)"
        )
    return sinks


def _check_slopes(slopes, num_heads: int, device: torch.device) -> torch.Tensor | None:
    """ALiBi slopes: a floating (H,) tensor on q's device (`qkv.positional.alibi_slopes`)."""
    if slopes is None:
        return None
    if not isinstance(slopes, torch.Tensor):
        raise TypeError(
            f"alibi_slopes: expected a torch.Tensor of shape ({num_heads},), got "
            f"{type(slopes).__name__}"
        )
    if not slopes.is_floating_point():
        raise TypeError(f"alibi_slopes: expected a floating-point tensor, got dtype {slopes.dtype}")
    if slopes.shape != (num_heads,):
        raise ValueError(
            f"alibi_slopes: expected shape ({num_heads},), one slope per query head, got "
            f"{tuple(slopes.shape)}"
        )
    if slopes.device != device:
        raise ValueError(f"alibi_slopes: on device {slopes.device}, expected q's device {device}")
    return slopes.detach()  # fixed, as in the paper: every backend treats them as constants


def check_softcap(softcap: float | None) -> float | None:
    """Soft-capping's cap: a finite number > 0, or None."""
    if softcap is None:
        return None
    if (
        isinstance(softcap, bool)
        or not isinstance(softcap, (int, float))
        or not 0 < softcap < math.inf
    ):
        raise ValueError(f"softcap: expected a positive finite number or None, got {softcap!r}")
    return float(softcap)


def check_pattern(pattern, L_q: int, L_k: int) -> SparsePattern | None:
    """A sparse pattern (qkv.attention.sparse), for queries aligned within the keys."""
    if pattern is None:
        return None
    if not isinstance(pattern, SparsePattern):
        raise TypeError(
            f"pattern: expected a qkv.attention.sparse pattern (Window, GlobalTokens, ... or "
            f"their union with |), got {type(pattern).__name__}"
        )
    if L_q > L_k:
        raise ValueError(
            f"pattern: expected L_q <= L_k (queries aligned bottom-right within the keys), got "
            f"L_q={L_q}, L_k={L_k}"
        )
    pattern.check(L_q, L_k)
    return pattern


def check_callable(name: str, value):
    if value is not None and not callable(value):
        raise TypeError(f"{name}: expected a callable or None, got {type(value).__name__}")
    return value


def _check_dropout(dropout_p: float) -> float:
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)):
        raise TypeError(f"dropout_p: expected a float in [0, 1), got {dropout_p!r}")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p: expected a probability in [0, 1), got {dropout_p}")
    return float(dropout_p)


def check_lengths(
    lengths, batch: int, key_len: int, name: str = "lengths", axis: str = "L_k"
) -> tuple[int, ...] | None:
    """Valid keys (or queries) per batch row, (B,) integers in [0, L_k], as Python ints (one
    host sync); a tuple of ints (already on the host) is taken as it is, once checked."""
    if lengths is None:
        return None
    if isinstance(lengths, tuple) and all(type(n) is int for n in lengths):
        values = lengths
    else:
        if not isinstance(lengths, torch.Tensor) or lengths.shape != (batch,):
            raise ValueError(f"{name}: expected a tensor of shape ({batch},), got {lengths!r}")
        if lengths.is_floating_point() or lengths.dtype == torch.bool:
            raise TypeError(f"{name}: expected an integer tensor, got dtype {lengths.dtype}")
        values = tuple(int(n) for n in lengths.tolist())
    if len(values) != batch:
        raise ValueError(f"{name}: expected {batch} values, one per batch row, got {values}")
    if any(n < 0 or n > key_len for n in values):
        raise ValueError(f"{name}: expected values in [0, {axis}={key_len}], got {list(values)}")
    return values


def check_row_lengths(lengths, query_lengths, q, k, pattern, alibi_slopes=None) -> dict:
    """{"lengths": ..., "query_lengths": ...} as tuples of ints, checked."""
    if query_lengths is not None and alibi_slopes is not None:
        raise ValueError(
            "query_lengths: not supported with alibi_slopes (ALiBi's distances would need the "
            "per-row alignment too); expected one of them"
        )
    if query_lengths is not None and pattern is not None:
        raise ValueError(
            "query_lengths: not supported with a pattern (which aligns the whole call); for "
            "sequences of their own lengths use pattern=qkv.sparse.Packed.from_lengths(...)"
        )
    return {
        "lengths": check_lengths(lengths, q.shape[0], k.shape[2]),
        "query_lengths": check_lengths(
            query_lengths, q.shape[0], q.shape[2], "query_lengths", "L_q"
        ),  # fmt: skip
    }
