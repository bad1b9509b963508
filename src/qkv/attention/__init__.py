"""The functional core: masks, sparse patterns, `attention()`, `explain()`, the backends behind
them, and linear (kernelised) attention."""

from qkv.attention import flex as _flex_backend
from qkv.attention import masks, sparse
from qkv.attention.core import BACKENDS, attention, register_backend, serving_backends
from qkv.attention.explain import explain
from qkv.attention.linear import (
    FavorFeatureMap,
    LinearAttention,
    LinearAttentionState,
    elu_feature_map,
    linear_attention,
    linear_attention_state,
    linear_attention_step,
    orthogonal_random_features,
)
from qkv.attention.lsh import LSHAttentionCost, lsh_attention, lsh_attention_cost, lsh_hash
from qkv.attention.offset_bias import OffsetBias
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
    "FavorFeatureMap",
    "LSHAttentionCost",
    "LinearAttention",
    "LinearAttentionState",
    "OffsetBias",
    "TraceStep",
    "attention",
    "attention_weights",
    "elu_feature_map",
    "explain",
    "flash_attention",
    "linear_attention",
    "linear_attention_state",
    "linear_attention_step",
    "lsh_attention",
    "lsh_attention_cost",
    "lsh_hash",
    "masks",
    "orthogonal_random_features",
    "register_backend",
    "serving_backends",
    "sparse",
    "triton_attention",
]
