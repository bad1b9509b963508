"""`qkv.masks`: the mask builders and converters of `qkv.attention.masks`, at the top level.

One convention everywhere: a boolean mask is True where a query MAY attend; a float mask is an
additive bias. See `qkv.attention.masks` for the implementations; `from_pattern` builds the
dense mask of a sparse pattern (`qkv.attention.sparse`: windows, dilated and strided heads, global
tokens, BigBird's random blocks), what the reference backend and SDPA read.
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
from qkv.attention.sparse import dense_mask as from_pattern

__all__ = [
    "causal",
    "combine",
    "from_additive",
    "from_pattern",
    "from_torch_attn_mask",
    "from_torch_key_padding_mask",
    "padding",
    "sliding_window",
    "to_additive",
    "to_torch_attn_mask",
    "to_torch_key_padding_mask",
]
