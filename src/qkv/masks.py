"""`qkv.masks`: the mask builders and converters of `qkv.attention.masks`, at the top level.

One convention everywhere: a boolean mask is True where a query MAY attend; a float mask is an
additive bias. See `qkv.attention.masks` for the implementations.
"""

from qkv.attention.masks import (
    causal,
    combine,
    from_additive,
    from_torch_attn_mask,
    from_torch_key_padding_mask,
    padding,
    sliding_window,
    to_additive,
    to_torch_attn_mask,
    to_torch_key_padding_mask,
)

__all__ = [
    "causal",
    "combine",
    "from_additive",
    "from_torch_attn_mask",
    "from_torch_key_padding_mask",
    "padding",
    "sliding_window",
    "to_additive",
    "to_torch_attn_mask",
    "to_torch_key_padding_mask",
]
