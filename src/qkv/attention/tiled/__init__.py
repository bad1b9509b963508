"""FlashAttention as tiled PyTorch: online softmax, recomputation, O(L) memory, any mask."""

from qkv.attention.tiled.function import flash_attention
from qkv.attention.tiled.kernels import TraceStep
from qkv.attention.tiled.weights import attention_weights
from qkv.attention.tiles import Tile

__all__ = ["Tile", "TraceStep", "attention_weights", "flash_attention"]
