"""Rotary position embeddings, RoPE (Su et al. 2021, RoFormer, section 3.4).

RoPE splits each query/key head vector into D/2 pairs of coordinates and rotates pair i of the
vector at position m by the angle m * theta_i, theta_i = base^(-2i/D) (Su et al. 2021):

    f(x, m) = [[cos m.theta, -sin m.theta], [sin m.theta, cos m.theta]] @ [x_1, x_2]

A rotation by m.theta followed by the transposed rotation by n.theta is a rotation by
(m - n).theta, so q_m . k_n depends on the positions only through m - n.

Which coordinates form a pair is a layout choice that checkpoints disagree on:

- "half": pair i is (i, i + D/2) and the rotation is x * cos + rotate_half(x) * sin. Hugging
  Face's Llama (`rotate_half`, `apply_rotary_pos_emb`), GPT-NeoX.
- "interleaved": pair i is (2i, 2i + 1), i.e. complex multiplication of consecutive pairs by
  e^{i m theta} (q_m -> q_m e^{i m theta}). The RoFormer paper's equation (34) and Meta's
  original Llama code (`view_as_complex`).

The two differ only by a permutation of each head's coordinates, which can be folded into the
q/k projection weights once (qkv.positional.rope_layout, as Hugging Face's Llama conversion
script does), after which both give the same attention scores.
"""

from __future__ import annotations

import torch
from torch import nn

from qkv.positional._checks import (
    angle_dtype,
    check_base,
    check_even_dim,
    check_floating_dtype,
    check_positions,
)
from qkv.positional.rope_scaling import RopeScaling, scaled_inverse_frequencies

__all__ = [
    "LAYOUTS",
    "RotaryEmbedding",
    "apply_rope",
    "rope_cos_sin",
]

LAYOUTS = ("half", "interleaved")


def rope_cos_sin(
    positions: torch.Tensor,
    head_dim: int,
    *,
    base: float = 10000.0,
    layout: str = "half",
    dtype: torch.dtype = torch.float32,
    scaling: RopeScaling | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos(m * theta) and sin(m * theta) for every position m, laid out for `apply_rope`.

    positions: a tensor of any shape, usually (L,) or (B, L); integer, or float for
    interpolated positions. theta_i = base^(-2i / head_dim) for i < head_dim / 2 (RoFormer
    section 3.4.2). Angles are computed in float32 (float64 when `dtype` is float64), then
    cast to `dtype`. scaling: a `RopeScaling` rule that changes theta_i (and, for YaRN and
    LongRoPE, scales cos and sin; for dynamic NTK and LongRoPE, depends on max(positions) + 1),
    or None for plain RoPE.

    Returns (cos, sin), each (*positions.shape, head_dim): frequency i sits at columns i and
    i + head_dim/2 for layout "half", at columns 2i and 2i + 1 for layout "interleaved".
    """
    check_positions(positions, integer=False)
    check_even_dim("head_dim", head_dim)
    base = check_base(base)
    _check_layout(layout)
    check_floating_dtype("dtype", dtype)
    _check_scaling(scaling)
    compute_dtype = angle_dtype(dtype)
    if scaling is None:
        # Written as Hugging Face writes it, 1 / base^(2i/D), so float32 results agree bit for bit.
        pair_index = torch.arange(0, head_dim, 2, dtype=compute_dtype, device=positions.device)
        inverse_frequencies = 1.0 / (base ** (pair_index / head_dim))  # (D/2,)
    else:
        inverse_frequencies = scaled_inverse_frequencies(
            head_dim, base, scaling, positions=positions, dtype=compute_dtype
        )  # (D/2,)
    angles = positions.to(compute_dtype).unsqueeze(-1) * inverse_frequencies  # (*P, D/2)
    if layout == "half":
        angles = torch.cat((angles, angles), dim=-1)  # (*P, D): frequency i at i and i + D/2
    else:
        angles = angles.repeat_interleave(2, dim=-1)  # (*P, D): frequency i at 2i and 2i + 1
    if scaling is not None and scaling.attention_scale() != 1.0:
        scale = scaling.attention_scale()
        return (angles.cos() * scale).to(dtype), (angles.sin() * scale).to(dtype)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, layout: str = "half"
) -> torch.Tensor:
    """Rotate the pairs of each head vector of x: x * cos + rotate(x) * sin (RoFormer eq. 34).

    x: (B, H, L, D) queries or keys. cos, sin: (L, D) or (B, L, D) from `rope_cos_sin` with
    the same layout; they are shared by all heads. The arithmetic runs in the promoted dtype
    of x and cos (float32 cos/sin keep bf16 inputs accurate) and the result is cast back:
    returns (B, H, L, D) in x's dtype.
    """
    _check_layout(layout)
    _check_cos_sin(x, cos, sin)
    return _rotate(x, cos, sin, layout)


class RotaryEmbedding(nn.Module):
    """Applies RoPE to queries and keys (RoFormer, Su et al. 2021, section 3.4).

    No parameters and no buffers: cos/sin are computed from the positions at every call (in
    float32, or float64 for float64 inputs), so casting the module cannot degrade them.

    forward(q, k, positions=None): q (B, H, L, D) and k (B, H_kv, L, D) may differ in head
    count (GQA/MQA). positions, (L,) or (B, L), gives the absolute position of each of the L
    tokens of both q and k (e.g. offset by the cache length when decoding); None means
    arange(L) and then q and k must have the same length. Returns (q_rotated, k_rotated),
    each `apply_rope` of its input at those positions.

    scaling: a `qkv.positional.RopeScaling` rule for contexts longer than the training one
    (position interpolation, dynamic NTK, YaRN, Llama 3, LongRoPE, proportional), or None for
    plain RoPE.
    """

    def __init__(
        self,
        head_dim: int,
        *,
        base: float = 10000.0,
        layout: str = "half",
        scaling: RopeScaling | None = None,
    ) -> None:
        super().__init__()
        self.head_dim = check_even_dim("head_dim", head_dim)
        self.base = check_base(base)
        self.layout = _check_layout(layout)
        self.scaling = _check_scaling(scaling)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        _check_heads("q", q, self.head_dim)
        _check_heads("k", k, self.head_dim)
        L_q, L_k = q.shape[2], k.shape[2]
        if positions is None and L_q != L_k:
            raise ValueError(
                f"positions: q has length L_q={L_q} and k has L_k={L_k}; without "
                f"positions both must have the same length, or pass positions (L,) or (B, L)"
            )
        if positions is not None:
            _check_rope_positions(positions, q, k)
        tables = self.tables(positions, L_q, q.device, _table_dtype(q, k))
        return self.rotate(q, tables), self.rotate(k, tables)

    def tables(
        self, positions: torch.Tensor | None, length: int, device, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """What `rotate` takes for these positions, computed once per forward for q and k:
        `rope_cos_sin` with this module's settings at `positions` (L,) or (B, L), or at
        arange(length) on `device` when None; (cos, sin), each (L, D) or (B, L, D) in `dtype`.
        An extension point: a subclass may prepare other tables, with its own `rotate`."""
        if positions is None:
            positions = torch.arange(length, device=device)  # (L,)
        return rope_cos_sin(
            positions,
            self.head_dim,
            base=self.base,
            layout=self.layout,
            dtype=dtype,
            scaling=self.scaling,
        )

    def rotate(self, x: torch.Tensor, tables: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """`apply_rope(x, cos, sin, layout=self.layout)` on checked arguments: x (B, heads, L, D)
        -> (B, heads, L, D), tables (cos, sin) from `tables`."""
        return _rotate(x, *tables, self.layout)

    def extra_repr(self) -> str:
        text = f"head_dim={self.head_dim}, base={self.base}, layout={self.layout!r}"
        return text if self.scaling is None else f"{text}, scaling={self.scaling}"


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layout: str) -> torch.Tensor:
    """`apply_rope` on checked arguments: x (B, H, L, D), cos/sin (L, D) or (B, L, D)."""
    if cos.dim() == 3:
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # (B, 1, L, D): broadcast over heads
    rotated = _rotate_half(x) if layout == "half" else _rotate_pairs(x)
    return (x * cos + rotated * sin).to(x.dtype)


def _table_dtype(q: torch.Tensor, k: torch.Tensor) -> torch.dtype:
    """The dtype of the cos/sin tables for q and k: float32, or float64 if either is float64."""
    return torch.promote_types(angle_dtype(q.dtype), angle_dtype(k.dtype))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(x_1, x_2) -> (-x_2, x_1) where x_1, x_2 are the first and second halves of the last axis."""
    first, second = x.chunk(2, dim=-1)  # each (..., D/2)
    return torch.cat((-second, first), dim=-1)  # (..., D)


def _rotate_pairs(x: torch.Tensor) -> torch.Tensor:
    """(x_2i, x_2i+1) -> (-x_2i+1, x_2i): multiplication by the imaginary unit, pair by pair."""
    pairs = x.unflatten(-1, (-1, 2))  # (..., D/2, 2)
    rotated = torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1)  # (..., D/2, 2)
    return rotated.flatten(-2)  # (..., D)


def _check_layout(layout: object) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"layout: expected one of {LAYOUTS}, got {layout!r}")
    return layout


def _check_scaling(scaling: object) -> RopeScaling | None:
    if scaling is not None and not isinstance(scaling, RopeScaling):
        raise TypeError(
            f"scaling: expected a qkv.positional.RopeScaling or None, got {type(scaling).__name__}"
        )
    return scaling


def _check_heads(name: str, x: object, head_dim: int | None) -> None:
    """x must be a floating (B, heads, L, D) tensor, with D == head_dim if given, else even."""
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        got = f"dtype {x.dtype}" if isinstance(x, torch.Tensor) else type(x).__name__
        raise TypeError(f"{name}: expected a floating-point tensor, got {got}")
    expected = "an even head_dim" if head_dim is None else f"head_dim={head_dim}"
    if x.dim() != 4 or (x.shape[-1] % 2 if head_dim is None else x.shape[-1] != head_dim):
        raise ValueError(
            f"{name}: expected shape (B, heads, L, D) with {expected}, got {tuple(x.shape)}"
        )


def _check_cos_sin(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    _check_heads("x", x, None)
    B, _, L, D = x.shape
    for name, table in (("cos", cos), ("sin", sin)):
        if not isinstance(table, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(table).__name__}")
        batch_ok = table.dim() == 2 or (table.dim() == 3 and table.shape[0] in (1, B))
        if not batch_ok or tuple(table.shape[-2:]) != (L, D):
            raise ValueError(
                f"{name}: expected shape (L, D) = ({L}, {D}) or (B, L, D) = ({B}, {L}, {D}) to "
                f"match x of shape {tuple(x.shape)}, got {tuple(table.shape)}"
            )


def _check_rope_positions(positions: object, q: torch.Tensor, k: torch.Tensor) -> None:
    """positions (L,) or (B, L) must give one position per token of both q and k."""
    check_positions(positions, integer=False)
    (B_q, _, L_q, _), (B_k, _, L_k, _) = q.shape, k.shape
    length_ok = positions.dim() in (1, 2) and positions.shape[-1] == L_q == L_k
    batch_ok = positions.dim() == 1 or positions.shape[0] in {1, B_q} & {1, B_k}
    if not (length_ok and batch_ok):
        raise ValueError(
            f"positions: expected shape (L,) or (B, L) with L equal to both L_q={L_q} and "
            f"L_k={L_k} and B in ({B_q}, 1), got {tuple(positions.shape)}"
        )
