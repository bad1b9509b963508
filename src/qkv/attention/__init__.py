"""The functional core: masks, `attention()`, `explain()` and the backends behind them."""

from qkv.attention import masks
from qkv.attention.core import BACKENDS, attention, explain, register_backend
from qkv.attention.request import AttentionRequest

__all__ = ["AttentionRequest", "BACKENDS", "attention", "explain", "masks", "register_backend"]
