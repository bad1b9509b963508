"""RoPE scaling: inverse frequencies that stretch a model's context past its training length.

RoPE rotates pair i of a head vector at position m by m * theta_i, theta_i = base^(-2i/D)
(Su et al. 2021). A model trained on L_orig positions has never seen the angles of longer
sequences; each rule below changes theta_i (and, for YaRN and LongRoPE, the size of cos/sin) so
that it has:

- "linear", position interpolation (Chen et al. 2023, "Extending Context Window of Large
  Language Models via Positional Interpolation"): positions m -> m / factor, i.e.
  theta_i -> theta_i / factor for every i.
- "dynamic", dynamic NTK-aware scaling (Peng et al. 2023, "YaRN: Efficient Context Window
  Extension of Large Language Models", "Dynamic NTK" interpolation): for a sequence of
  L > L_orig positions the base grows to base * (factor * L / L_orig - (factor - 1))^(D / (D - 2)),
  so the lowest frequency is interpolated and the highest kept; L <= L_orig keeps plain RoPE.
  L is the largest position + 1 of each call, so a decoding step rotates its new token with
  the base of the length so far while cached keys keep theirs (as transformers decodes; unlike
  transformers, a later shorter call past L_orig uses its own L, not the largest seen).
- "yarn", "NTK-by-parts" interpolation plus attention temperature (Peng et al. 2023): dimensions
  that turn more than beta_fast times over L_orig keep theta_i, those that turn fewer than
  beta_slow times use theta_i / factor, a linear ramp blends the ones between; cos and sin are
  multiplied by sqrt(1/t) = 0.1 * ln(factor) + 1 (the attention temperature).
- "llama3", the rule of Llama 3.1 (Dubey et al. 2024, "The Llama 3 Herd of Models"; Meta's
  reference code calls it `apply_scaling`): wavelengths 2 pi / theta_i longer than
  L_orig / low_freq_factor are divided by factor, those shorter than L_orig / high_freq_factor
  are kept, and those between blend the two with weight
  s = (L_orig / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor).
- "longrope", LongRoPE (Ding et al. 2024, "LongRoPE: Extending LLM Context Window Beyond 2
  Million Tokens", s3; Phi-3): theta_i -> theta_i / lambda_i with one searched rescale factor
  lambda_i per pair, `short_factor` while the sequence fits in L_orig and `long_factor` past it
  (L = the largest position + 1 of each call, as for "dynamic"); cos and sin are multiplied by
  sqrt(1 + ln(factor) / ln(L_orig)), factor = the extended length / L_orig.
- "proportional", partial RoPE that keeps the frequencies of the whole head (transformers'
  "proportional", Gemma 4): the first rotary_fraction * D / 2 pairs turn with theta_i =
  base^(-2i/D) / factor, i counted over the whole head D, and the other pairs do not turn.

`RopeScaling` holds one rule's parameters; `qkv.positional.rope_scaling_hf` reads and writes
the `rope_scaling` (or `rope_parameters`) object of a Hugging Face config.json.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

__all__ = [
    "ROPE_SCALING_KINDS",
    "RopeScaling",
    "scaled_inverse_frequencies",
]

logger = logging.getLogger(__name__)

ROPE_SCALING_KINDS = ("linear", "dynamic", "yarn", "llama3", "longrope", "proportional")


@dataclass(frozen=True, kw_only=True)
class RopeScaling:
    """One RoPE scaling rule (see the module docstring) and its parameters.

    kind: one of ROPE_SCALING_KINDS. factor: the context extension s (> 0; for "proportional"
    the divisor of its frequencies, 1.0 for none). original_max_positions: L_orig, the training
    context ("dynamic", "yarn", "llama3", "longrope"). low_freq_factor, high_freq_factor:
    "llama3" only. beta_fast, beta_slow (32, 1), mscale, mscale_all_dim (DeepSeek-V2's form of
    the temperature) and truncate (round the ramp's ends to whole dimensions): "yarn" only.
    attention_factor: "yarn" and "longrope", the factor cos and sin are multiplied by (None:
    inferred from factor). short_factor, long_factor: "longrope" only, one rescale factor per
    pair (D/2 of them). rotary_fraction: "proportional" only, the share of the head that turns
    (Hugging Face's partial_rotary_factor).
    """

    kind: str
    factor: float
    original_max_positions: int | None = None
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True
    short_factor: tuple[float, ...] | None = None
    long_factor: tuple[float, ...] | None = None
    rotary_fraction: float = 1.0

    def __post_init__(self) -> None:
        if self.kind not in ROPE_SCALING_KINDS:
            raise ValueError(f"rope_scaling: kind {self.kind!r} is not one of {ROPE_SCALING_KINDS}")
        _positive("factor", self.factor)
        if self.kind not in ("linear", "proportional"):
            _positive_int("original_max_positions", self.original_max_positions)
        if self.kind == "llama3":
            _check_llama3(self)
        if self.kind == "longrope":
            _check_longrope(self)
        if self.kind == "proportional":
            _check_fraction(self.rotary_fraction)
        _positive("beta_fast", self.beta_fast)
        _positive("beta_slow", self.beta_slow)
        for name in ("attention_factor", "mscale", "mscale_all_dim"):
            if getattr(self, name) is not None:
                _positive(name, getattr(self, name))
        if not isinstance(self.truncate, bool):
            raise TypeError(f"rope_scaling: truncate: expected a bool, got {self.truncate!r}")

    def attention_scale(self) -> float:
        """The factor cos and sin are multiplied by; an explicit attention_factor wins. "yarn":
        the attention temperature term sqrt(1/t) = 0.1 ln(s) + 1 (Peng et al. 2023), or the
        ratio of two such terms when mscale and mscale_all_dim are given. "longrope":
        sqrt(1 + ln(s) / ln(L_orig)) (Phi-3's LongRoPE). 1.0 for other kinds, and for s <= 1."""
        if self.kind not in ("yarn", "longrope"):
            return 1.0
        if self.attention_factor is not None:
            return self.attention_factor
        if self.kind == "longrope":
            if self.factor <= 1:
                return 1.0
            return math.sqrt(1 + math.log(self.factor) / math.log(self.original_max_positions))

        def temperature(weight: float) -> float:
            return 1.0 if self.factor <= 1 else 0.1 * weight * math.log(self.factor) + 1.0

        if self.mscale and self.mscale_all_dim:
            return temperature(self.mscale) / temperature(self.mscale_all_dim)
        return temperature(1.0)

    def check_head_dim(self, head_dim: int) -> None:
        """Raise ValueError unless "longrope"'s factor lists fit heads of head_dim: D/2 entries
        each (one entry is broadcast over the pairs, as transformers does, with a warning)."""
        if self.kind != "longrope":
            return
        _check_factor_lengths(head_dim, self)
        for name in ("short_factor", "long_factor"):
            if len(getattr(self, name)) == 1 and head_dim > 2:
                logger.warning(
                    "rope_scaling: %s has 1 number, not head_dim / 2 = %d; it applies to every "
                    "pair, as transformers applies it", name, head_dim // 2,
                )  # fmt: skip


def scaled_inverse_frequencies(
    head_dim: int,
    base: float,
    scaling: RopeScaling,
    *,
    positions: torch.Tensor,
    dtype: torch.dtype,
) -> torch.Tensor:
    """theta_i for i < head_dim / 2 under `scaling`, in `dtype` on positions' device: (D/2,).

    positions: the positions the angles are for (any shape); only "dynamic" and "longrope" read
    them, for their length L = max(positions) + 1.
    """
    pair_index = torch.arange(0, head_dim, 2, dtype=dtype, device=positions.device)  # (D/2,)
    if scaling.kind == "dynamic":
        return 1.0 / (
            _dynamic_base(head_dim, base, scaling, positions, dtype) ** (pair_index / head_dim)
        )
    if scaling.kind == "longrope":
        rescale = _longrope_factors(head_dim, scaling, positions, dtype)  # (D/2,)
        return 1.0 / (rescale * base ** (pair_index / head_dim))
    inverse_frequencies = 1.0 / (base ** (pair_index / head_dim))  # (D/2,)
    if scaling.kind == "linear":
        return inverse_frequencies / scaling.factor
    if scaling.kind == "yarn":
        return _yarn(inverse_frequencies, head_dim, base, scaling)
    if scaling.kind == "llama3":
        return _llama3(inverse_frequencies, scaling)
    return _proportional(inverse_frequencies, head_dim, scaling)


def _sequence_length(positions: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """L = max(positions) + 1 as a () tensor (reading it needs no host synchronisation)."""
    return (positions.max() + 1).to(dtype)


def _dynamic_base(
    head_dim: int, base: float, scaling: RopeScaling, positions: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """The NTK-aware base for L = max(positions) + 1: unchanged while L <= L_orig."""
    original = scaling.original_max_positions
    if positions.numel() == 0:
        return torch.tensor(base, dtype=dtype, device=positions.device)
    length = _sequence_length(positions, dtype).clamp(min=original)  # () tensor
    grown = base * (scaling.factor * length / original - (scaling.factor - 1)) ** (
        head_dim / (head_dim - 2)
    )
    return torch.where(length > original, grown, torch.full_like(grown, base))


def _longrope_factors(
    head_dim: int, scaling: RopeScaling, positions: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """LongRoPE's rescale factors lambda_i (Ding et al. 2024, s3): long_factor when
    L = max(positions) + 1 > L_orig, else short_factor. (D/2,) or (1,) when one is given."""
    _check_factor_lengths(head_dim, scaling)
    short = torch.tensor(scaling.short_factor, dtype=dtype, device=positions.device)
    if positions.numel() == 0:
        return short
    long = torch.tensor(scaling.long_factor, dtype=dtype, device=positions.device)
    past = _sequence_length(positions, dtype) > scaling.original_max_positions  # () bool
    return torch.where(past, long, short)


def _yarn(inverse_frequencies: torch.Tensor, head_dim: int, base: float, scaling: RopeScaling):
    """NTK-by-parts (Peng et al. 2023): blend theta_i (many turns over L_orig) and
    theta_i / factor (few turns) along a ramp over the pair index i."""

    def pair_turning(turns: float) -> float:
        """The (fractional) pair index whose frequency turns `turns` times over L_orig."""
        wavelengths = scaling.original_max_positions / (turns * 2 * math.pi)
        return head_dim * math.log(wavelengths) / (2 * math.log(base))

    low, high = pair_turning(scaling.beta_fast), pair_turning(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if high == low:
        high += 1e-3  # a step, not a division by zero
    pairs = torch.arange(
        head_dim // 2, dtype=inverse_frequencies.dtype, device=inverse_frequencies.device
    )
    interpolated = ((pairs - low) / (high - low)).clamp(0, 1)  # (D/2,): 0 keep, 1 divide
    return (
        inverse_frequencies * (1 - interpolated)
        + inverse_frequencies / scaling.factor * interpolated
    )


def _llama3(inverse_frequencies: torch.Tensor, scaling: RopeScaling) -> torch.Tensor:
    """Llama 3.1: divide long wavelengths by factor, keep short ones, blend those between.

    Wavelengths past L_orig / low_freq_factor are divided first, so with high_freq_factor <=
    low_freq_factor (no band between) the rule is a step at L_orig / low_freq_factor, as in
    transformers; a wavelength on that step with equal factors would blend by 0 / 0 (NaN there),
    which is refused."""
    original, low, high = (
        scaling.original_max_positions,
        scaling.low_freq_factor,
        scaling.high_freq_factor,
    )
    wavelengths = 2 * math.pi / inverse_frequencies  # (D/2,)
    divided = wavelengths > original / low
    between = ~divided & ~(wavelengths < original / high)  # (D/2,): the band of the blend
    scaled = inverse_frequencies / scaling.factor
    if high == low:
        if bool(between.any()):
            raise ValueError(
                f"rope_scaling: high_freq_factor: equal to low_freq_factor ({low}) with a "
                f"wavelength exactly L_orig / low_freq_factor = {original / low}, whose blend "
                f"weight is 0 / 0; expected high_freq_factor != low_freq_factor"
            )
        return torch.where(divided, scaled, inverse_frequencies)
    blend = ((original / wavelengths - low) / (high - low)).clamp(0, 1)  # (D/2,): 1 keep
    mixed = (1 - blend) * scaled + blend * inverse_frequencies
    return torch.where(divided, scaled, torch.where(between, mixed, inverse_frequencies))


def _proportional(
    inverse_frequencies: torch.Tensor, head_dim: int, scaling: RopeScaling
) -> torch.Tensor:
    """The first int(rotary_fraction * D // 2) pairs keep theta_i / factor (exponents over the
    whole head D); the other pairs get frequency 0: cos 1, sin 0, no rotation."""
    rotated = int(scaling.rotary_fraction * head_dim // 2)
    pairs = torch.arange(head_dim // 2, device=inverse_frequencies.device)  # (D/2,)
    kept = torch.where(pairs < rotated, inverse_frequencies, 0.0)
    return kept / scaling.factor


def _check_factor_lengths(head_dim: int, scaling: RopeScaling) -> None:
    for name in ("short_factor", "long_factor"):
        if len(getattr(scaling, name)) not in (1, head_dim // 2):
            raise ValueError(
                f"rope_scaling: {name}: expected head_dim / 2 = {head_dim // 2} numbers, one per "
                f"rotated pair, got {len(getattr(scaling, name))}"
            )


def _check_llama3(scaling: RopeScaling) -> None:
    _positive("low_freq_factor", scaling.low_freq_factor)
    _positive("high_freq_factor", scaling.high_freq_factor)
    if not scaling.high_freq_factor > scaling.low_freq_factor:
        logger.warning(
            "rope_scaling: high_freq_factor %s is not above low_freq_factor %s: no band is "
            "blended, wavelengths past L_orig / low_freq_factor are divided by factor and the "
            "others kept (transformers warns the same and computes this step)",
            scaling.high_freq_factor, scaling.low_freq_factor,
        )  # fmt: skip


def _check_longrope(scaling: RopeScaling) -> None:
    """short_factor and long_factor: non-empty lists of numbers > 0, held as tuples (frozen);
    the inferred attention factor divides by ln(L_orig), so L_orig = 1 needs an explicit one."""
    for name in ("short_factor", "long_factor"):
        values = getattr(scaling, name)
        if not isinstance(values, (list, tuple)) or not values:
            raise TypeError(
                f"rope_scaling: {name}: expected a non-empty list of numbers, one per rotated "
                f"pair, got {values!r:.80}"
            )
        for value in values:
            _positive(name, value)
        object.__setattr__(scaling, name, tuple(float(value) for value in values))
    inferred = scaling.attention_factor is None and scaling.factor > 1
    if inferred and scaling.original_max_positions == 1:
        raise ValueError(
            "rope_scaling: original_max_positions: 1, and the inferred attention factor "
            "sqrt(1 + ln(factor) / ln(L_orig)) divides by ln(1) = 0; expected L_orig > 1 or an "
            "attention_factor"
        )


def _check_fraction(value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"rope_scaling: rotary_fraction: expected a number, got {value!r}")
    if not 0 <= value <= 1:
        raise ValueError(
            f"rope_scaling: rotary_fraction (partial_rotary_factor): expected a number in "
            f"[0, 1], the share of each head that turns, got {value}"
        )


def _positive(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"rope_scaling: {name}: expected a number, got {value!r}")
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"rope_scaling: {name}: expected a finite number > 0, got {value}")


def _positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"rope_scaling: {name}: expected an int, got {value!r}")
    if value < 1:
        raise ValueError(f"rope_scaling: {name}: expected an int >= 1, got {value}")
