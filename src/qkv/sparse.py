"""`qkv.sparse`: the sparse attention patterns of `qkv.attention.sparse`, at the top level.

    from qkv.sparse import bigbird, Window
    pattern = bigbird(window=64, global_tokens=2, random_blocks=3)
    out = qkv.attention(q, k, v, pattern=pattern)     # only the visible blocks computed

Windows and dilated bands (Beltagy et al. 2020), strided and fixed heads (Child et al. 2019),
global tokens and random blocks (Zaheer et al. 2020), and sequences packed along L (`Packed`).
See `qkv.attention.sparse` for what a pattern answers and how the backends use it.
"""

from qkv.attention.sparse import (
    Dilated,
    GlobalTokens,
    Packed,
    RandomBlocks,
    SameBlock,
    SparsePattern,
    Strided,
    Summary,
    Union,
    Window,
    bigbird,
    dense_mask,
    layout,
)

__all__ = [
    "Dilated",
    "GlobalTokens",
    "Packed",
    "RandomBlocks",
    "SameBlock",
    "SparsePattern",
    "Strided",
    "Summary",
    "Union",
    "Window",
    "bigbird",
    "dense_mask",
    "layout",
]
