"""The checks of the options an attention call sets (masks, dropout, window sinks, ALiBi slopes,
soft-cap, score_mod, sparse patterns, per-row lengths), each against the call's q, k and v
(checked by qkv.attention.checks).

`AttentionRequest` runs the check of an option only where the call sets it, once, when it is
made; no backend checks again. A bad input fails with a TypeError (a value of the wrong type)
or a ValueError (the right type, out of range) that names the argument, what was seen and what
was expected.
"""

from __future__ import annotations

import math

import torch

from qkv.attention.sparse import SparsePattern


def check_score_shaped(
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
            else "floating point (additive)"
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


def check_dropout(dropout_p: float) -> float:
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)):
        raise TypeError(f"dropout_p: expected a float in [0, 1), got {dropout_p!r}")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p: expected a probability in [0, 1), got {dropout_p}")
    return float(dropout_p)


def check_sinks(sinks: int) -> None:
    if isinstance(sinks, bool) or not isinstance(sinks, int) or sinks < 0:
        raise ValueError(
            f"sinks: expected an int >= 0, got {sinks!r} (the first keys, visible on top of a "
            f"window)"
        )


def check_slopes(slopes, num_heads: int, device: torch.device) -> torch.Tensor:
    """ALiBi slopes: a floating (H,) tensor (`qkv.positional.alibi_slopes`), moved to q's
    device (H numbers: a model keeps them as a buffer on its own device)."""
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
    return slopes.detach().to(device)  # fixed, as in the paper: every backend reads constants


def check_softcap(softcap: float) -> float:
    """Soft-capping's cap: a finite number > 0."""
    if (
        isinstance(softcap, bool)
        or not isinstance(softcap, (int, float))
        or not 0 < softcap < math.inf
    ):
        raise ValueError(f"softcap: expected a positive finite number or None, got {softcap!r}")
    return float(softcap)


def check_callable(name: str, value: object) -> None:
    if value is not None and not callable(value):
        raise TypeError(f"{name}: expected a callable or None, got {type(value).__name__}")


def check_pattern(pattern: SparsePattern, L_q: int, L_k: int) -> None:
    """A sparse pattern (qkv.attention.sparse), for queries aligned within the keys."""
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


def check_row_lengths(
    lengths, query_lengths, q: torch.Tensor, k: torch.Tensor, pattern, alibi_slopes
) -> dict[str, tuple[int, ...] | None]:
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
    B, _, L_q, _ = q.shape
    return {
        "lengths": check_lengths(lengths, B, k.shape[2]),
        "query_lengths": check_lengths(query_lengths, B, L_q, "query_lengths", "L_q"),
    }


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
