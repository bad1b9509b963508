"""RoPE scaling in a Hugging Face config.json: its `rope_scaling` (or `rope_parameters`) object
read into a `qkv.positional.RopeScaling` and written back, as transformers 5 reads it
(transformers.modeling_rope_utils: standardize_rope_params, the `_compute_*_parameters`
functions and the `_validate_*_rope_parameters` checks). Keys a rule does not read are ignored
with a warning, and what transformers accepts with a warning is accepted with one; what it
refuses, or what would divide by zero, raises naming rope_scaling and the key.
"""

from __future__ import annotations

import logging

from qkv.positional.rope_scaling import ROPE_SCALING_KINDS, RopeScaling

__all__ = ["rope_scaling_from_hf", "scaling_from_hf", "scaling_to_hf"]

logger = logging.getLogger(__name__)

# Hugging Face keys each kind reads, besides rope_type (or the older `type`), rope_theta (the
# base is GPTConfig.rope_base) and partial_rotary_factor (1.0 unless "proportional").
_HF_KEYS = {
    "linear": ("factor",),
    "dynamic": ("factor", "original_max_position_embeddings"),
    "yarn": (
        "factor", "original_max_position_embeddings", "beta_fast", "beta_slow",
        "attention_factor", "mscale", "mscale_all_dim", "truncate",
    ),
    "llama3": (
        "factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor",
    ),
    "longrope": (
        "factor", "original_max_position_embeddings", "short_factor", "long_factor",
        "attention_factor",
    ),
    "proportional": ("factor", "partial_rotary_factor"),
}  # fmt: skip
# Keys transformers refuses to go without (KeyError in _check_received_keys).
_HF_REQUIRED = {
    "linear": ("factor",),
    "dynamic": ("factor",),
    "yarn": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor"),
    "longrope": ("short_factor", "long_factor"),
    "proportional": (),
}
_HF_COMMON_KEYS = ("rope_type", "type", "rope_theta", "partial_rotary_factor")
# Hugging Face key -> RopeScaling field, where they differ.
_FIELD_NAMES = {
    "original_max_position_embeddings": "original_max_positions",
    "partial_rotary_factor": "rotary_fraction",
}


def rope_scaling_from_hf(
    parameters: dict, *, max_positions: int | None = None
) -> RopeScaling | None:
    """A Hugging Face `rope_scaling` / `rope_parameters` object -> RopeScaling, or None for
    rope_type "default" (also when rope_type and the older `type` are both absent, as
    transformers reads it: plain RoPE, whose other keys are ignored with a warning)."""
    kind = _hf_kind(parameters)
    if kind != "default":
        return scaling_from_hf(parameters, max_positions=max_positions)
    unread = sorted(set(parameters) - set(_HF_COMMON_KEYS))
    if unread:
        logger.warning(
            "rope_scaling: rope_type 'default' (plain RoPE) does not read %s; ignored, as "
            "transformers ignores them", unread,
        )  # fmt: skip
    return None


def _hf_kind(rope_scaling: object) -> str:
    """The rope_type of a Hugging Face object: `rope_type`, else `type`, else "default"."""
    if not isinstance(rope_scaling, dict):
        raise TypeError(f"rope_scaling: expected a dict, got {type(rope_scaling).__name__}")
    kind = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
    if kind != "default" and kind not in _HF_KEYS:
        raise ValueError(
            f"rope_scaling: rope_type {kind!r} is not supported; expected one of "
            f"{ROPE_SCALING_KINDS} (or 'default' for plain RoPE)"
        )
    return kind


def _check_hf_keys(kind: str, rope_scaling: dict) -> None:
    """Required keys must be there; keys the rule does not read are ignored with a warning;
    a partial rotation is refused except by "proportional" (transformers' Llama fails on it)."""
    missing = [key for key in _HF_REQUIRED[kind] if key not in rope_scaling]
    if missing:
        raise ValueError(
            f"rope_scaling: rope_type {kind!r} requires {list(_HF_REQUIRED[kind])} and reads "
            f"some of {list(_HF_KEYS[kind])}; got keys {sorted(rope_scaling)}, missing {missing}"
        )
    fraction = rope_scaling.get("partial_rotary_factor")
    if kind != "proportional" and fraction not in (None, 1, 1.0):
        raise ValueError(
            f"rope_scaling: partial_rotary_factor: rope_type {kind!r} rotates whole heads in "
            f"qkv (transformers' Llama fails on a partial one); expected 1.0, got {fraction!r}"
        )
    unread = sorted(set(rope_scaling) - set(_HF_KEYS[kind]) - set(_HF_COMMON_KEYS))
    if unread:
        logger.warning(
            "rope_scaling: rope_type %r does not read %s; ignored, as transformers ignores them",
            kind, unread,
        )  # fmt: skip


def _hf_original(kind: str, values: dict, max_positions: int | None) -> int | None:
    """L_orig as transformers takes it: the object's original_max_position_embeddings (even
    null, which then fails), else max_position_embeddings; for "dynamic" always the latter."""
    given = values.get("original_max_positions", max_positions)
    if kind == "dynamic":
        if max_positions is not None and given != max_positions:
            logger.warning(
                "rope_scaling: 'dynamic' starts at max_position_embeddings %s, as in "
                "transformers; original_max_position_embeddings %s is ignored",
                max_positions, given,
            )  # fmt: skip
        return max_positions if max_positions is not None else given
    known = isinstance(given, int) and max_positions is not None
    if kind == "llama3" and known and given >= max_positions:
        logger.warning(
            "rope_scaling: original_max_position_embeddings %s is not below "
            "max_position_embeddings %s (transformers expects it below)", given, max_positions,
        )  # fmt: skip
    return None if kind in ("linear", "proportional") else given


def _hf_factor(kind: str, values: dict, max_positions: int | None) -> object:
    """factor as transformers takes it: "proportional" defaults to 1.0, a null "yarn" or
    "longrope" factor is max_position_embeddings / L_orig; a factor below 1 is warned about."""
    factor = values.get("factor", 1.0 if kind == "proportional" else None)
    original = values["original_max_positions"]
    if factor is None and kind in ("yarn", "longrope"):
        if max_positions is None or not isinstance(original, int) or original < 1:
            raise ValueError(
                f"rope_scaling: factor: null, which transformers reads as "
                f"max_position_embeddings / original_max_position_embeddings; expected a "
                f"number, or both of those lengths (got {max_positions} and {original})"
            )
        factor = max_positions / original
        logger.warning(
            "rope_scaling: %r factor is null; using max_position_embeddings / "
            "original_max_position_embeddings = %s / %s = %s, as transformers does",
            kind, max_positions, original, factor,
        )  # fmt: skip
    elif kind != "proportional" and isinstance(factor, (int, float)) and factor < 1:
        logger.warning("rope_scaling: factor %s is below 1 (transformers expects >= 1)", factor)
    return factor


def _hf_fraction(fraction: object) -> object:
    """The partial_rotary_factor of "proportional"; absent or null: 1.0, with a warning (as
    transformers warns)."""
    if fraction is None:
        logger.warning(
            "rope_scaling: 'proportional' without partial_rotary_factor turns the whole head, "
            "as plain RoPE with frequencies / factor (transformers warns the same)"
        )
        return 1.0
    return fraction


def _hf_yarn_defaults(values: dict, max_positions: int | None) -> None:
    """transformers' YaRN reads `beta_fast or 32`, `beta_slow or 1` and a null truncate as
    false; it warns when factor is not max_position_embeddings / L_orig (and that is not 1)."""
    values["beta_fast"] = values.get("beta_fast") or 32.0
    values["beta_slow"] = values.get("beta_slow") or 1.0
    if "truncate" in values and values["truncate"] is None:
        values["truncate"] = False
    original = values["original_max_positions"]
    if max_positions is not None and isinstance(original, int) and original > 0:
        implicit = max_positions / original
        if implicit not in (1, values["factor"]):
            logger.warning(
                "rope_scaling: yarn factor %s differs from max_position_embeddings / "
                "original_max_position_embeddings = %s; the factor is used, as in transformers",
                values["factor"], implicit,
            )  # fmt: skip


def scaling_from_hf(rope_scaling: dict, *, max_positions: int | None = None) -> RopeScaling:
    """A Hugging Face `rope_scaling` / `rope_parameters` object -> RopeScaling, read as
    transformers 5 reads it (modeling_rope_utils: standardize_rope_params, the
    `_compute_*_parameters` functions and the `_validate_*_rope_parameters` checks).

    max_positions (config.json's max_position_embeddings) stands in for a missing
    original_max_position_embeddings, is the original length of "dynamic", and gives a
    null factor of "yarn" or "longrope" as max_positions / original_max_position_embeddings.
    A rope_type qkv does not know, a missing required key, a wrong type, and what would
    divide by zero raise ValueError or TypeError naming rope_scaling and the key; keys the
    rule does not read, and values transformers warns about, are logged as warnings.
    """
    kind = _hf_kind(rope_scaling)
    if kind == "default":
        raise ValueError(
            f"rope_scaling: rope_type 'default' is plain RoPE, which no RopeScaling "
            f"describes; expected one of {ROPE_SCALING_KINDS} (rope_scaling_from_hf gives "
            f"None for 'default')"
        )
    _check_hf_keys(kind, rope_scaling)
    values = {
        _FIELD_NAMES.get(key, key): rope_scaling[key]
        for key in _HF_KEYS[kind]
        if key in rope_scaling
    }
    values["original_max_positions"] = _hf_original(kind, values, max_positions)
    values["factor"] = _hf_factor(kind, values, max_positions)
    if kind == "yarn":
        _hf_yarn_defaults(values, max_positions)
    if kind == "proportional":
        values["rotary_fraction"] = _hf_fraction(values.get("rotary_fraction"))
    kept = {key: value for key, value in values.items() if value is not None or key == "factor"}
    return RopeScaling(kind=kind, **kept)


def scaling_to_hf(scaling: RopeScaling) -> dict:
    """The Hugging Face `rope_scaling` object (without rope_theta) for this rule. For "dynamic",
    transformers takes L_orig from max_position_embeddings, which the writer of the config
    must set to original_max_positions."""
    hf = {"rope_type": scaling.kind, "factor": scaling.factor}
    if scaling.kind in ("yarn", "llama3", "longrope"):  # "dynamic" reads max_position_embeddings
        hf["original_max_position_embeddings"] = scaling.original_max_positions
    if scaling.kind == "llama3":
        hf.update(
            low_freq_factor=scaling.low_freq_factor, high_freq_factor=scaling.high_freq_factor
        )
    if scaling.kind == "yarn":
        hf.update(
            beta_fast=scaling.beta_fast, beta_slow=scaling.beta_slow, truncate=scaling.truncate
        )
        for key in ("mscale", "mscale_all_dim"):
            if getattr(scaling, key) is not None:
                hf[key] = getattr(scaling, key)
    if scaling.kind == "longrope":
        hf.update(short_factor=list(scaling.short_factor), long_factor=list(scaling.long_factor))
    if scaling.kind in ("yarn", "longrope") and scaling.attention_factor is not None:
        hf["attention_factor"] = scaling.attention_factor
    if scaling.kind == "proportional":
        hf["partial_rotary_factor"] = scaling.rotary_fraction
        if scaling.factor == 1.0:  # transformers reads it, but warns that it does not know it
            del hf["factor"]
    return hf
