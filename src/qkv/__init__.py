"""qkv: attention and the Transformer, readable, proved against PyTorch, measured.

    import qkv
    out = qkv.attention(q, k, v, causal=True)          # (B, H, L, D) tensors
    print(qkv.explain(q, k, v, causal=True))           # which backend runs, and why
    out, lse = qkv.flash_attention(q, k, v, window=1024, return_lse=True)
    maps = qkv.attention_weights(q, k, lse, window=1024, heads=[0], rows=[5, 6])
    tokens = qkv.generate(model, input_ids, max_new_tokens=32)   # KV-cached decoding
    pattern = qkv.sparse.bigbird(window=64, global_tokens=2, random_blocks=3)
    out = qkv.attention(q, k, v, pattern=pattern)      # only the visible blocks computed

`qkv.attention` is the function; its subpackage (masks, backends) stays importable with
`from qkv.attention import ...`, and the backend registry is `qkv.BACKENDS`.
"""

from qkv import acceleration, masks, positional, sparse
from qkv.attention import (
    BACKENDS,
    attention,
    attention_weights,
    explain,
    flash_attention,
    register_backend,
    triton_attention,
)
from qkv.generation import generate
from qkv.version import __version__

__all__ = [
    "BACKENDS",
    "acceleration",
    "attention",
    "attention_weights",
    "explain",
    "flash_attention",
    "generate",
    "masks",
    "positional",
    "register_backend",
    "sparse",
    "triton_attention",
    "__version__",
]
