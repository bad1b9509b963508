"""qkv: attention and the Transformer, readable, proved against PyTorch, measured.

    import qkv
    out = qkv.attention(q, k, v, causal=True)          # (B, H, L, D) tensors
    print(qkv.explain(q, k, v, causal=True))           # which backend runs, and why

`qkv.attention` is the function; its subpackage (masks, backends) stays importable with
`from qkv.attention import ...`, and the backend registry is `qkv.BACKENDS`.
"""

from qkv import masks, positional
from qkv.attention import BACKENDS, attention, explain, register_backend

__version__ = "0.1.0"
__all__ = [
    "BACKENDS",
    "attention",
    "explain",
    "masks",
    "positional",
    "register_backend",
    "__version__",
]
