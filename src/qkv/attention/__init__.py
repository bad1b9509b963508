"""The functional core: masks, `attention()`, `explain()` and the backends behind them."""

from qkv.attention import flex as _flex_backend
from qkv.attention import masks
from qkv.attention.core import BACKENDS, attention, explain, register_backend, serving_backends
from qkv.attention.request import AttentionRequest
from qkv.attention.tiled import TraceStep, attention_weights, flash_attention
from qkv.attention.tiled import backend as _tiled_backend
from qkv.attention.triton import backend as _triton_backend
from qkv.attention.triton import triton_attention

register_backend(_tiled_backend, before="sdpa")  # auto prefers it only for large windows
register_backend(_triton_backend, before="tiled")  # auto: CUDA tensors it can serve
register_backend(_flex_backend, before="tiled")  # auto: patterns SDPA would need dense tensors for

__all__ = [
    "AttentionRequest",
    "BACKENDS",
    "TraceStep",
    "attention",
    "attention_weights",
    "explain",
    "flash_attention",
    "masks",
    "register_backend",
    "serving_backends",
    "triton_attention",
]
