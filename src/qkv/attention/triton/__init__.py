"""FlashAttention-2 as Triton GPU kernels (imported lazily: `import qkv` never needs Triton).

kernels.py (the @triton.jit kernels) -> launch.py (grids, autotuning) -> function.py (the
autograd.Function and `triton_attention`) -> backend.py (backend `triton` of qkv.attention).
"""

from qkv.attention.triton.function import triton_attention

__all__ = ["triton_attention"]
