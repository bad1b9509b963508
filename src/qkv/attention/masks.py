"""Attention masks under one convention: a boolean mask is True where a query MAY attend.

A floating-point mask is an additive bias on the scores (0 = keep, -inf = blocked). Masks are
2-D `(L_q, L_k)` or 4-D `(B|1, H|1, L_q, L_k)`; a 3-D mask is refused by `qkv.attention`
because `(B, L_q, L_k)` would silently broadcast B against the head axis.

NaN, the one rule of every backend (reference, sdpa, tiled, flex): masking never hides a NaN. A NaN
or +inf that a float mask or a bias adds to a score its query may see makes that query's
output NaN, even where the rest of its row is -inf; a position that a bool mask, `causal` or
`window` blocks is removed, NaN and all. Only a row whose every score is -inf is empty (output
0). Masks are not searched for NaN: that would cost a pass over the mask and a host sync on
every call. The same holds for NaN in q or k: a NaN in a query row, or in a key the row may
see, makes the row NaN, and a key the row cannot see is removed, NaN and all. PyTorch's fused
kernels break this (0 for a row of only NaN scores; a masked NaN key still NaN), and `sdpa` and
`flex` correct them (`qkv.attention.nan_rows`). A NaN in v reaches the rows that weight it,
and on some backends rows that weight it 0 as well: v is not searched.

PyTorch uses both polarities: `F.scaled_dot_product_attention` takes True = attend, while
`nn.MultiheadAttention`'s `attn_mask` and `key_padding_mask` take True = blocked. The converters at
the bottom of this file cross that border explicitly.
"""

from __future__ import annotations

import functools

import torch

from qkv.validation import describe

__all__ = [
    "causal",
    "padding",
    "sliding_window",
    "combine",
    "to_additive",
    "from_additive",
    "from_torch_attn_mask",
    "to_torch_attn_mask",
    "from_torch_key_padding_mask",
    "to_torch_key_padding_mask",
]


def _positions(
    L_q: int, L_k: int, device: torch.device | str | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Query positions aligned to the keys' bottom-right corner, and key positions.

    Query i sits at key position i + (L_k - L_q): the last query lines up with the last key, as
    in FlashAttention >= 2.1 and in decoding with a KV cache (the new queries are the newest keys).
    """
    _check_length("L_q", L_q)
    _check_length("L_k", L_k)
    query_pos = torch.arange(L_q, device=device).unsqueeze(1) + (L_k - L_q)  # (L_q, 1)
    key_pos = torch.arange(L_k, device=device).unsqueeze(0)  # (1, L_k)
    return query_pos, key_pos


def causal(L_q: int, L_k: int | None = None, *, device=None) -> torch.Tensor:
    """The look-ahead mask (Vaswani et al. 2017, s3.2.3): query i may attend keys j <= i.

    For L_q != L_k the mask is aligned bottom-right, as FlashAttention >= 2.1 does: the last
    query sees every key, query i sees keys j <= i + (L_k - L_q). With L_q > L_k the first
    L_q - L_k queries see nothing (fully masked rows, which `qkv.attention` turns into 0).
    Note that `F.scaled_dot_product_attention(is_causal=True)` aligns top-left instead.

    Returns a bool tensor of shape (L_q, L_k).
    """
    L_k = L_q if L_k is None else L_k
    query_pos, key_pos = _positions(L_q, L_k, device)
    return key_pos <= query_pos


def sliding_window(
    L_q: int, L_k: int, window: int | tuple[int, int], *, sinks: int = 0, device=None
) -> torch.Tensor:
    """Local attention, aligned bottom-right like `causal`.

    - `window=W` (an int, as in Mistral): each query sees itself and the W - 1 keys before it,
      i.e. keys j with i - W < j <= i. This is causal by construction.
    - `window=(left, right)` (FlashAttention's `window_size`): keys j with
      i - left <= j <= i + right; a two-sided window for bidirectional encoders.
    - `sinks=n`: the first n keys stay visible on top of the window, never further ahead than
      its right edge (attention sinks: StreamingLLM, Xiao et al. 2024).

    Returns a bool tensor of shape (L_q, L_k).
    """
    left, right = _window_extent(window)
    if isinstance(sinks, bool) or not isinstance(sinks, int) or sinks < 0:
        raise ValueError(f"sinks: expected an int >= 0, got {sinks!r}")
    query_pos, key_pos = _positions(L_q, L_k, device)
    offset = key_pos - query_pos  # (L_q, L_k): how far key j lies ahead of query i
    visible = (offset >= -left) & (offset <= right)
    if sinks:
        visible |= (key_pos < sinks) & (offset <= right)
    return visible


def padding(lengths: torch.Tensor, max_len: int | None = None) -> torch.Tensor:
    """Key padding mask from sequence lengths: True on real tokens.

    lengths: (B,) integer tensor. Returns bool (B, 1, 1, max_len), ready to broadcast over heads
    and queries, so it can be passed to `qkv.attention` or `combine`d with `causal` directly.
    """
    if not isinstance(lengths, torch.Tensor) or lengths.dim() != 1:
        raise ValueError(f"lengths: expected a 1-D tensor of shape (B,), got {describe(lengths)}")
    if lengths.is_floating_point() or lengths.dtype == torch.bool:
        raise TypeError(f"lengths: expected an integer tensor, got dtype {lengths.dtype}")
    if lengths.numel() and int(lengths.min()) < 0:
        raise ValueError(f"lengths: expected non-negative lengths, got {lengths.tolist()}")
    longest = int(lengths.max()) if lengths.numel() else 0
    if max_len is None:
        max_len = longest
    _check_length("max_len", max_len)
    if longest > max_len:
        raise ValueError(f"max_len: {max_len} is shorter than the longest length {longest}")
    valid = torch.arange(max_len, device=lengths.device) < lengths.unsqueeze(1)  # (B, max_len)
    return valid[:, None, None, :]  # (B, 1, 1, max_len)


def combine(*masks: torch.Tensor | None) -> torch.Tensor | None:
    """Combine masks by broadcasting: a key is visible only where every mask allows it.

    Boolean masks are AND-ed; if any mask is additive (floating point), the result is additive:
    the float masks are summed and the boolean ones contribute 0 or -inf. `None`s are skipped;
    combining nothing gives None.
    """
    present = [m for m in masks if m is not None]
    for index, mask in enumerate(present):
        _check_mask_dtype(f"masks[{index}]", mask)
    if len(present) <= 1:
        return present[0] if present else None
    if all(m.dtype == torch.bool for m in present):
        result = present[0]
        for mask in present[1:]:
            result = result & mask
        return result
    dtype = functools.reduce(
        torch.promote_types, [m.dtype for m in present if m.is_floating_point()], torch.float32
    )
    result = torch.zeros((), dtype=dtype, device=present[0].device)
    for mask in present:
        result = result + (to_additive(mask, dtype) if mask.dtype == torch.bool else mask)
    return result


def to_additive(mask: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Boolean mask (True = attend) -> additive mask: 0 where allowed, -inf where blocked."""
    _check_mask_dtype("mask", mask)
    if mask.dtype != torch.bool:
        return mask.to(dtype)
    zeros = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
    return zeros.masked_fill(~mask, float("-inf"))


def from_additive(mask: torch.Tensor, *, blocked_at_or_below: float = -1e4) -> torch.Tensor:
    """Additive mask -> boolean mask (True = attend).

    Values at or below `blocked_at_or_below` count as blocked. The default catches -inf,
    `torch.finfo(dtype).min`, the -1e9 sentinel of older code and BERT's original -10000.0.
    """
    if not mask.is_floating_point():
        raise TypeError(f"mask: expected a floating-point additive mask, got dtype {mask.dtype}")
    return mask > blocked_at_or_below


def from_torch_attn_mask(attn_mask: torch.Tensor, num_heads: int | None = None) -> torch.Tensor:
    """`nn.MultiheadAttention`'s `attn_mask` -> a qkv mask.

    A boolean `attn_mask` there means True = blocked, so it is inverted; a float one is already
    additive and kept. Shape (L_q, L_k) stays 2-D; (B * num_heads, L_q, L_k) becomes
    (B, num_heads, L_q, L_k), which needs `num_heads`.
    """
    _check_mask_dtype("attn_mask", attn_mask)
    mask = ~attn_mask if attn_mask.dtype == torch.bool else attn_mask
    if mask.dim() == 2:
        return mask
    if mask.dim() != 3:
        raise ValueError(
            f"attn_mask: expected shape (L_q, L_k) or (B * num_heads, L_q, L_k), "
            f"got {tuple(mask.shape)}"
        )
    if num_heads is None or num_heads <= 0 or mask.shape[0] % num_heads:
        raise ValueError(
            f"num_heads: a 3-D attn_mask of shape {tuple(mask.shape)} needs num_heads that "
            f"divides {mask.shape[0]}, got {num_heads}"
        )
    return mask.view(-1, num_heads, *mask.shape[1:])  # (B, H, L_q, L_k)


def to_torch_attn_mask(mask: torch.Tensor) -> torch.Tensor:
    """A qkv mask -> `nn.MultiheadAttention`'s `attn_mask` (bool True = blocked, or additive).

    2-D stays (L_q, L_k); 4-D (B, H, L_q, L_k) is flattened to (B * H, L_q, L_k), as
    nn.MultiheadAttention expects (expand size-1 batch/head axes before converting).
    """
    _check_mask_dtype("mask", mask)
    converted = ~mask if mask.dtype == torch.bool else mask
    if converted.dim() == 2:
        return converted
    if converted.dim() != 4:
        raise ValueError(
            f"mask: expected shape (L_q, L_k) or (B, H, L_q, L_k), got {tuple(mask.shape)}"
        )
    return converted.reshape(-1, *converted.shape[2:])  # (B * H, L_q, L_k)


def from_torch_key_padding_mask(key_padding_mask: torch.Tensor) -> torch.Tensor:
    """`key_padding_mask` of nn.MultiheadAttention, (B, L_k) with True = padding, -> qkv mask.

    Returns bool (B, 1, 1, L_k) with True on real tokens (a float mask is kept additive).
    """
    _check_mask_dtype("key_padding_mask", key_padding_mask)
    if key_padding_mask.dim() != 2:
        raise ValueError(
            f"key_padding_mask: expected shape (B, L_k), got {tuple(key_padding_mask.shape)}"
        )
    mask = ~key_padding_mask if key_padding_mask.dtype == torch.bool else key_padding_mask
    return mask[:, None, None, :]  # (B, 1, 1, L_k)


def to_torch_key_padding_mask(mask: torch.Tensor) -> torch.Tensor:
    """A qkv key mask, (B, 1, 1, L_k) or (B, L_k) with True = real token, -> (B, L_k) True = pad."""
    if mask.dtype != torch.bool:
        raise TypeError(f"mask: expected a boolean key mask, got dtype {mask.dtype}")
    if mask.dim() == 4 and mask.shape[1] == mask.shape[2] == 1:
        mask = mask[:, 0, 0, :]
    if mask.dim() != 2:
        raise ValueError(
            f"mask: expected shape (B, 1, 1, L_k) or (B, L_k), got {tuple(mask.shape)}"
        )
    return ~mask


def _window_extent(window: int | tuple[int, int]) -> tuple[int, int]:
    """Normalise `window` to (left, right): how many keys before and after a query are visible."""
    if isinstance(window, bool):
        raise TypeError(f"window: expected an int or a (left, right) tuple, got {window!r}")
    if isinstance(window, int):
        if window < 1:
            raise ValueError(f"window: expected a positive number of keys, got {window}")
        return window - 1, 0
    if (
        isinstance(window, tuple)
        and len(window) == 2
        and all(isinstance(w, int) and not isinstance(w, bool) and w >= 0 for w in window)
    ):
        return window
    raise ValueError(
        f"window: expected an int >= 1 or a (left, right) tuple of ints >= 0, got {window!r}"
    )


def _check_length(name: str, value: int) -> None:
    """A length: an int >= 0, or a symbolic one (a torch.SymInt, while torch.export traces)."""
    if isinstance(value, bool) or not isinstance(value, int | torch.SymInt):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__} {value!r}")
    if value < 0:
        raise ValueError(f"{name}: expected a non-negative length, got {value}")


def _check_mask_dtype(name: str, mask: torch.Tensor) -> None:
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(mask).__name__}")
    if mask.dtype != torch.bool and not mask.is_floating_point():
        raise TypeError(
            f"{name}: expected a bool mask (True = may attend) or a floating-point additive mask, "
            f"got dtype {mask.dtype}; convert 0/1 integer masks with `mask.bool()`"
        )
