"""One attention call, checked once: the arguments of `qkv.attention` and the shapes they imply.

Every backend receives an `AttentionRequest` and never re-validates. Bad input fails here with a
ValueError/TypeError naming the argument, what was seen and what was expected.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from qkv.attention import masks


@dataclass(frozen=True)
class AttentionRequest:
    """Validated arguments of one `qkv.attention` call.

    q: (B, H, L_q, D); k: (B, H_kv, L_k, D); v: (B, H_kv, L_k, D_v), with H % H_kv == 0.
    mask: bool (True = may attend) or additive float, 2-D (L_q, L_k) or 4-D broadcastable to
    (B, H, L_q, L_k). bias: additive float, same shapes. window: (left, right) key counts.
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

    def structural_mask(self) -> torch.Tensor | None:
        """The bool (L_q, L_k) mask implied by `causal` and `window`, or None if neither is set."""
        device = self.q.device
        causal = masks.causal(self.query_len, self.key_len, device=device) if self.causal else None
        window = (
            masks.sliding_window(self.query_len, self.key_len, self.window, device=device)
            if self.window is not None
            else None
        )
        return masks.combine(causal, window)

    def allowed(self) -> torch.Tensor | None:
        """Every boolean constraint at once (causal, window, bool mask), broadcastable, or None."""
        return masks.combine(self.structural_mask(), self.mask if self.has_bool_mask else None)

    def additive(self) -> torch.Tensor | None:
        """The sum of the additive terms (bias and a float mask), or None if there are none."""
        return masks.combine(self.bias, self.mask if self.has_additive_mask else None)


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
) -> tuple | None:
    """Everything `make_request` checks, as a hashable key; None for a call it cannot describe.

    Two calls with one key pass or fail the checks alike and differ only in tensor values, so a
    choice made for one (`qkv.attention` memoises `auto`'s) holds for the other. The key has
    each tensor's shape, dtype and device, never its values, and each option with its exact
    type: True == 1 == 1.0 in Python, but not for the checks. Tensor subclasses and options of
    other types (a list window) give None: such calls are simply checked every time.
    """
    try:
        tensors = tuple(_tensor_key(t) for t in (q, k, v, mask, bias))
        options = tuple(_option_key(o) for o in (causal, scale, window, dropout_p, return_weights))
    except _NoKeyError:
        return None
    return tensors + options


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
    if any(size not in (1, want) for size, want in zip(tensor.shape, aligned, strict=True)):
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


def _check_dropout(dropout_p: float) -> float:
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)):
        raise TypeError(f"dropout_p: expected a float in [0, 1), got {dropout_p!r}")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p: expected a probability in [0, 1), got {dropout_p}")
    return float(dropout_p)


def check_lengths(lengths, batch: int, key_len: int) -> tuple[int, ...] | None:
    """Valid keys per batch row, (B,) integers in [0, L_k], as Python ints (one host sync)."""
    if lengths is None:
        return None
    if not isinstance(lengths, torch.Tensor) or lengths.shape != (batch,):
        raise ValueError(f"lengths: expected a tensor of shape ({batch},), got {lengths!r}")
    if lengths.is_floating_point() or lengths.dtype == torch.bool:
        raise TypeError(f"lengths: expected an integer tensor, got dtype {lengths.dtype}")
    values = tuple(int(n) for n in lengths.tolist())
    if any(n < 0 or n > key_len for n in values):
        raise ValueError(f"lengths: expected values in [0, L_k={key_len}], got {list(values)}")
    return values
