"""Sparse attention patterns: which keys each query may see, at the token and at the block level.

Attention over L tokens costs O(L^2); the sparse Transformers keep a pattern of O(L) visible
(query, key) pairs instead:

- `Window(left, right)`: the local band (Beltagy et al. 2020, Longformer s3.1);
- `Dilated(left, right, dilation)`: a band with gaps, every `dilation`-th key (Longformer s3.1);
- `Strided(stride)`: keys a multiple of `stride` away (with causal, every stride-th key back),
  and `SameBlock(size)` / `Summary(stride, width)`: the "fixed" pattern's block and summary
  columns (Child et al. 2019, Sparse Transformer s4.2);
- `GlobalTokens(positions)`: tokens that attend everywhere and are attended by all (Longformer's
  global attention; BigBird's ITC, Zaheer et al. 2020 s2);
- `RandomBlocks(per_row, block, seed)`: each query block sees `per_row` random key blocks,
  seeded (BigBird's random attention, Zaheer et al. 2020 s2);
- `a | b`: the union (`bigbird(...)` = window | global | random);
- `Packed(query_offsets, key_offsets, causal, window)`: several sequences packed one after the
  other without padding (FlashAttention's variable-length layout, `cu_seqlens`): a query sees
  only keys of its own sequence, causal and windows aligned to that sequence's own lengths.

A pattern answers two questions, both on positions with queries aligned bottom-right (query i
sits at position i + L_k - L_q, as causal and windows align):

- `visible(query_pos, key_pos, key_len)`: a bool tensor, token by token (the dense mask the
  reference backend and SDPA read, and the mask of a partly visible tile); `rule(key_len,
  device)` is the same test with its lookup tables built once, for FlexAttention's mask_mod;
- `tiles(q_lo, q_hi, k_lo, k_hi, key_len)`: for blocks of positions given by their inclusive
  bounds (broadcastable integer tensors), whether *any* pair is visible (exact: a tile without
  one is skipped, so that time scales with the computed blocks) and whether *all* are (a tile
  that needs no mask; this answer may err only towards False).

`qkv.attention(..., pattern=p)` intersects the pattern with everything else the call asks for
(causal, window, masks, padding); `layout` gives the block occupancy that the tiled backend walks.
"""

from qkv.attention.sparse.base import SparsePattern, Union, dense_mask, layout
from qkv.attention.sparse.local import Dilated, SameBlock, Strided, Summary, Window
from qkv.attention.sparse.packed import Packed
from qkv.attention.sparse.tokens import GlobalTokens, RandomBlocks, bigbird

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
