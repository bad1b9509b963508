"""RoPE scaling: inverse frequencies that stretch a model's context past its training length.

RoPE rotates pair i of a head vector at position m by m * theta_i, theta_i = base^(-2i/D)
(Su et al. 2021). A model trained on L_orig positions has never seen the angles of longer
sequences; each rule below changes theta_i (and, for YaRN, the size of cos/sin) so that it has:

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

`RopeScaling` holds one rule's parameters; `from_hf` / `to_hf` read and write the `rope_scaling`
(or `rope_parameters`) object of a Hugging Face config.json.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["ROPE_SCALING_KINDS", "RopeScaling", "scaled_inverse_frequencies"]

ROPE_SCALING_KINDS = ("linear", "dynamic", "yarn", "llama3")

# Hugging Face keys each kind reads, besides rope_type (or the older `type`) and factor.
_HF_KEYS = {
    "linear": (),
    "dynamic": ("original_max_position_embeddings",),
    "yarn": (
        "original_max_position_embeddings", "beta_fast", "beta_slow", "attention_factor",
        "mscale", "mscale_all_dim", "truncate",
    ),
    "llama3": ("original_max_position_embeddings", "low_freq_factor", "high_freq_factor"),
}  # fmt: skip
_IGNORED_HF_KEYS = ("rope_theta", "rope_type", "type")  # the base is GPTConfig.rope_base


@dataclass(frozen=True, kw_only=True)
class RopeScaling:
    """One RoPE scaling rule (see the module docstring) and its parameters.

    kind: one of ROPE_SCALING_KINDS. factor: the context extension s (> 0). original_max_positions:
    L_orig, the training context ("dynamic", "yarn", "llama3"). low_freq_factor, high_freq_factor:
    "llama3" only. beta_fast, beta_slow (32, 1), attention_factor (None: inferred from factor, or
    from mscale / mscale_all_dim as DeepSeek-V2 configs give them) and truncate (round the ramp's
    ends to whole dimensions): "yarn" only.
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

    def __post_init__(self) -> None:
        if self.kind not in ROPE_SCALING_KINDS:
            raise ValueError(f"rope_scaling: kind {self.kind!r} is not one of {ROPE_SCALING_KINDS}")
        _positive("factor", self.factor)
        if self.kind != "linear":
            _positive_int("original_max_positions", self.original_max_positions)
        if self.kind == "llama3":
            _positive("low_freq_factor", self.low_freq_factor)
            _positive("high_freq_factor", self.high_freq_factor)
            if not self.high_freq_factor > self.low_freq_factor:
                raise ValueError(
                    f"rope_scaling: expected high_freq_factor > low_freq_factor, got "
                    f"{self.high_freq_factor} and {self.low_freq_factor}"
                )
        _positive("beta_fast", self.beta_fast)
        _positive("beta_slow", self.beta_slow)
        for name in ("attention_factor", "mscale", "mscale_all_dim"):
            if getattr(self, name) is not None:
                _positive(name, getattr(self, name))
        if not isinstance(self.truncate, bool):
            raise TypeError(f"rope_scaling: truncate: expected a bool, got {self.truncate!r}")

    def attention_scale(self) -> float:
        """The factor cos and sin are multiplied by: YaRN's attention temperature term
        sqrt(1/t) = 0.1 ln(s) + 1 (Peng et al. 2023), or the ratio of two such terms when mscale
        and mscale_all_dim are given; an explicit attention_factor wins. 1.0 for other kinds."""
        if self.kind != "yarn":
            return 1.0
        if self.attention_factor is not None:
            return self.attention_factor

        def temperature(weight: float) -> float:
            return 1.0 if self.factor <= 1 else 0.1 * weight * math.log(self.factor) + 1.0

        if self.mscale and self.mscale_all_dim:
            return temperature(self.mscale) / temperature(self.mscale_all_dim)
        return temperature(1.0)

    @classmethod
    def from_hf(cls, rope_scaling: dict, *, max_positions: int | None = None) -> RopeScaling:
        """A Hugging Face `rope_scaling` / `rope_parameters` object -> RopeScaling.

        max_positions (config.json's max_position_embeddings) stands in for a missing
        original_max_position_embeddings, and is the original length of "dynamic", as
        transformers reads them. Unknown types and keys raise ValueError naming rope_scaling.
        """
        if not isinstance(rope_scaling, dict):
            raise TypeError(f"rope_scaling: expected a dict, got {type(rope_scaling).__name__}")
        kind = rope_scaling.get("rope_type", rope_scaling.get("type"))
        if kind not in _HF_KEYS:
            raise ValueError(
                f"rope_scaling: rope_type {kind!r} is not supported; expected one of "
                f"{ROPE_SCALING_KINDS} (or 'default' for plain RoPE)"
            )
        allowed = {"factor", *_HF_KEYS[kind], *_IGNORED_HF_KEYS}
        unknown = sorted(set(rope_scaling) - allowed)
        if rope_scaling.get("partial_rotary_factor", 1.0) == 1.0:
            unknown = [key for key in unknown if key != "partial_rotary_factor"]
        if unknown or "factor" not in rope_scaling:
            raise ValueError(
                f"rope_scaling: rope_type {kind!r} takes 'factor' and some of "
                f"{list(_HF_KEYS[kind])}; got keys {sorted(rope_scaling)}"
            )
        values = {key: rope_scaling[key] for key in _HF_KEYS[kind] if key in rope_scaling}
        original = values.pop("original_max_position_embeddings", None)
        if kind == "dynamic" and max_positions is not None:
            original = max_positions  # transformers grows the base past max_position_embeddings
        if kind != "linear" and original is None:
            original = max_positions
        values = {key: value for key, value in values.items() if value is not None}  # null: default
        return cls(
            kind=kind,
            factor=rope_scaling["factor"],
            original_max_positions=None if kind == "linear" else original,
            **values,
        )

    def to_hf(self) -> dict:
        """The Hugging Face `rope_scaling` object (without rope_theta) for this rule. For "dynamic",
        transformers takes L_orig from max_position_embeddings, which the writer of the config
        must set to original_max_positions."""
        hf = {"rope_type": self.kind, "factor": self.factor}
        if self.kind in ("yarn", "llama3"):  # "dynamic" reads max_position_embeddings
            hf["original_max_position_embeddings"] = self.original_max_positions
        if self.kind == "llama3":
            hf.update(low_freq_factor=self.low_freq_factor, high_freq_factor=self.high_freq_factor)
        if self.kind == "yarn":
            hf.update(beta_fast=self.beta_fast, beta_slow=self.beta_slow, truncate=self.truncate)
            for key in ("attention_factor", "mscale", "mscale_all_dim"):
                if getattr(self, key) is not None:
                    hf[key] = getattr(self, key)
        return hf


def scaled_inverse_frequencies(
    head_dim: int,
    base: float,
    scaling: RopeScaling,
    *,
    positions: torch.Tensor,
    dtype: torch.dtype,
) -> torch.Tensor:
    """theta_i for i < head_dim / 2 under `scaling`, in `dtype` on positions' device: (D/2,).

    positions: the positions the angles are for (any shape); only "dynamic" reads them, for
    its length L = max(positions) + 1.
    """
    pair_index = torch.arange(0, head_dim, 2, dtype=dtype, device=positions.device)  # (D/2,)
    if scaling.kind == "dynamic":
        return 1.0 / (
            _dynamic_base(head_dim, base, scaling, positions, dtype) ** (pair_index / head_dim)
        )
    inverse_frequencies = 1.0 / (base ** (pair_index / head_dim))  # (D/2,)
    if scaling.kind == "linear":
        return inverse_frequencies / scaling.factor
    if scaling.kind == "yarn":
        return _yarn(inverse_frequencies, head_dim, base, scaling)
    return _llama3(inverse_frequencies, scaling)


def _dynamic_base(
    head_dim: int, base: float, scaling: RopeScaling, positions: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """The NTK-aware base for L = max(positions) + 1: unchanged while L <= L_orig. A tensor, so
    that reading L needs no host synchronisation."""
    original = scaling.original_max_positions
    if positions.numel() == 0:
        return torch.tensor(base, dtype=dtype, device=positions.device)
    length = (positions.max() + 1).to(dtype).clamp(min=original)  # () tensor
    grown = base * (scaling.factor * length / original - (scaling.factor - 1)) ** (
        head_dim / (head_dim - 2)
    )
    return torch.where(length > original, grown, torch.full_like(grown, base))


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
    """Llama 3.1: divide long wavelengths by factor, keep short ones, blend those between."""
    original = scaling.original_max_positions
    wavelengths = 2 * math.pi / inverse_frequencies  # (D/2,)
    blend = (original / wavelengths - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )  # (D/2,): 1 at the short end of the band, 0 at the long end
    blend = blend.clamp(0, 1)
    scaled = inverse_frequencies / scaling.factor
    kept = wavelengths < original / scaling.high_freq_factor
    divided = wavelengths > original / scaling.low_freq_factor
    mixed = (1 - blend) * scaled + blend * inverse_frequencies
    return torch.where(kept, inverse_frequencies, torch.where(divided, scaled, mixed))


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
