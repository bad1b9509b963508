"""qkv: attention and the Transformer, readable, proved against PyTorch, measured.

import qkv
out = qkv.attention(q, k, v, causal=True)          # (B, H, L, D) tensors
print(qkv.explain(q, k, v, causal=True))           # which backend runs, and why
"""

from qkv import masks
from qkv.attention import attention, explain

__version__ = "0.1.0"
__all__ = ["attention", "explain", "masks", "__version__"]
