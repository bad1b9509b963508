"""The checks of a `GPTConfig`'s RoPE fields, run once as the config is built
(`GPTConfig.__post_init__`)."""

from __future__ import annotations

from qkv.positional import RopeScaling
from qkv.positional.rope_scaling_hf import rope_scaling_from_hf
from qkv.validation import check_positive_float

__all__ = ["check_rope_fields"]


def check_rope_fields(config) -> None:
    """A `GPTConfig` being built: rope_base, and rope_scaling resolved once (a dict of its
    fields or a Hugging Face dict becomes a `RopeScaling`) and checked against the position
    kind and head_dim."""
    check_positive_float("rope_base", config.rope_base)
    scaling = config.rope_scaling
    if isinstance(scaling, dict):  # frozen: resolve once
        if "kind" in scaling:  # RopeScaling's own fields (dataclasses.asdict)
            scaling = RopeScaling(**scaling)
        else:  # Hugging Face's rope_scaling object; rope_type "default" is plain RoPE: None
            _check_hf_theta(scaling, config.rope_base)
            scaling = rope_scaling_from_hf(scaling, max_positions=config.max_positions)
        object.__setattr__(config, "rope_scaling", scaling)
    if scaling is not None and not isinstance(scaling, RopeScaling):
        raise TypeError(
            f"rope_scaling: expected None, a qkv.positional.RopeScaling or a Hugging Face "
            f"rope_scaling dict, got {type(scaling).__name__} {scaling!r:.80}"
        )
    if scaling is not None and config.position != "rope":
        raise ValueError(
            f"rope_scaling: given ({scaling.kind!r}) but position={config.position!r}; "
            f"expected position='rope' or rope_scaling=None"
        )
    if config.position == "rope" and config.head_dim % 2:
        raise ValueError(
            f"embed_dim: head_dim = {config.embed_dim} // {config.num_heads} = {config.head_dim} "
            f"is odd; RoPE rotates pairs of coordinates, expected an even head_dim"
        )
    if scaling is not None:
        scaling.check_head_dim(config.head_dim)


def _check_hf_theta(rope_scaling: dict, rope_base: float) -> None:
    """The base is rope_base; a Hugging Face object's rope_theta must not say otherwise."""
    theta = rope_scaling.get("rope_theta")
    if theta is not None and theta != rope_base:
        raise ValueError(
            f"rope_scaling: rope_theta is {theta!r}, but rope_base={rope_base}; expected the "
            f"same base in both (set rope_base), or no rope_theta"
        )
