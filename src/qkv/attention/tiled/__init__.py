"""FlashAttention as tiled PyTorch: online softmax, recomputation, O(L) memory, any mask."""

from qkv.attention.tiled.function import flash_attention
from qkv.attention.tiled.kernels import TraceStep
from qkv.attention.tiled.traffic import TileTraffic, count_tile_traffic
from qkv.attention.tiled.weights import attention_weights
from qkv.attention.tiles import Tile

__all__ = [
    "Tile",
    "TileTraffic",
    "TraceStep",
    "attention_weights",
    "count_tile_traffic",
    "flash_attention",
]
