"""Crossing the border to PyTorch's own modules: weights in, weights out, never guessed.

`nn.MultiheadAttention` stores Q, K and V in one `in_proj_weight` of shape (3E, E), stacked in the
order Q, K, V along dim 0, unless kdim/vdim differ from E, in which case it keeps three separate
`q_proj_weight`, `k_proj_weight`, `v_proj_weight`. qkv keeps the three projections as separate
`nn.Linear`s (`q_proj`, `k_proj`, `v_proj`) so that GQA/MQA, where K and V are narrower than Q, read
the same way as MHA.

These functions work on any module with qkv's parameter names; the layers' `from_torch` and
`to_torch` methods call them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "activation_name",
    "copy_weight_and_bias",
    "load_mha_from_torch",
    "mha_config_from_torch",
    "mha_to_torch",
]


def mha_config_from_torch(module: nn.MultiheadAttention) -> dict:
    """The `MultiHeadAttention` constructor arguments that reproduce `module`.

    Raises ValueError for what qkv does not model: `add_bias_kv` (a learned extra key/value
    appended to every sequence), `add_zero_attn` (an extra all-zero key/value) and kdim != vdim.
    """
    if not isinstance(module, nn.MultiheadAttention):
        raise TypeError(f"module: expected nn.MultiheadAttention, got {type(module).__name__}")
    if module.bias_k is not None or module.bias_v is not None:
        raise ValueError(
            "module: add_bias_kv=True is not supported (it appends a learned key/value to every "
            "sequence, which qkv's MultiHeadAttention does not model); expected add_bias_kv=False"
        )
    if module.add_zero_attn:
        raise ValueError(
            "module: add_zero_attn=True is not supported (it appends an all-zero key/value); "
            "expected add_zero_attn=False"
        )
    if module.kdim != module.vdim:
        raise ValueError(
            f"module: kdim={module.kdim} and vdim={module.vdim} differ; qkv's MultiHeadAttention "
            f"reads keys and values from one context of width context_dim, expected kdim == vdim"
        )
    out_weight = module.out_proj.weight
    return {
        "embed_dim": module.embed_dim,
        "num_heads": module.num_heads,
        "context_dim": None if module._qkv_same_embed_dim else module.kdim,
        "bias": module.in_proj_bias is not None,
        "dropout": float(module.dropout),
        "device": out_weight.device,
        "dtype": out_weight.dtype,
    }


def load_mha_from_torch(layer: nn.Module, module: nn.MultiheadAttention) -> None:
    """Copy `module`'s weights into `layer` (q_proj, k_proj, v_proj, out_proj), Q/K/V in order."""
    if module._qkv_same_embed_dim:
        q_weight, k_weight, v_weight = module.in_proj_weight.chunk(3, dim=0)  # 3 x (E, E)
    else:
        q_weight, k_weight, v_weight = (
            module.q_proj_weight,  # (E, E)
            module.k_proj_weight,  # (E, kdim)
            module.v_proj_weight,  # (E, vdim)
        )
    biases = (None, None, None)
    if module.in_proj_bias is not None:
        biases = module.in_proj_bias.chunk(3, dim=0)  # 3 x (E,)
    projections = (layer.q_proj, layer.k_proj, layer.v_proj)
    for target, weight, bias in zip(
        projections, (q_weight, k_weight, v_weight), biases, strict=True
    ):
        _copy(target.weight, weight)
        if bias is not None:
            _copy(target.bias, bias)
    copy_weight_and_bias(layer.out_proj, module.out_proj)


def mha_to_torch(layer: nn.Module) -> nn.MultiheadAttention:
    """A batch-first `nn.MultiheadAttention` with `layer`'s weights (plain MHA only)."""
    reasons = []
    if layer.num_kv_heads != layer.num_heads:
        reasons.append(
            f"num_kv_heads={layer.num_kv_heads} != num_heads={layer.num_heads} "
            f"(nn.MultiheadAttention has no GQA/MQA)"
        )
    if layer.rope is not None:
        reasons.append("rope is set (nn.MultiheadAttention has no rotary embedding)")
    if layer.alibi:
        reasons.append("alibi=True (nn.MultiheadAttention has no ALiBi bias)")
    if reasons:
        raise ValueError("to_torch: expected plain multi-head attention, but " + "; ".join(reasons))
    weight = layer.out_proj.weight
    module = nn.MultiheadAttention(
        layer.embed_dim,
        layer.num_heads,
        dropout=layer.dropout,
        bias=layer.out_proj.bias is not None,
        kdim=layer.context_dim,
        vdim=layer.context_dim,
        batch_first=True,
        device=weight.device,
        dtype=weight.dtype,
    )
    with torch.no_grad():
        if module._qkv_same_embed_dim:
            weights = (layer.q_proj.weight, layer.k_proj.weight, layer.v_proj.weight)
            module.in_proj_weight.copy_(torch.cat(weights, dim=0))  # (3E, E), Q then K then V
        else:
            module.q_proj_weight.copy_(layer.q_proj.weight)
            module.k_proj_weight.copy_(layer.k_proj.weight)
            module.v_proj_weight.copy_(layer.v_proj.weight)
        if module.in_proj_bias is not None:
            biases = (layer.q_proj.bias, layer.k_proj.bias, layer.v_proj.bias)
            module.in_proj_bias.copy_(torch.cat(biases, dim=0))  # (3E,)
    copy_weight_and_bias(module.out_proj, layer.out_proj)
    return module


def activation_name(activation: Callable | nn.Module) -> str:
    """The qkv activation name of a PyTorch layer's `activation` (function or module)."""
    if activation is F.relu or isinstance(activation, nn.ReLU):
        return "relu"
    if activation is F.gelu:
        return "gelu"
    if isinstance(activation, nn.GELU):
        return "gelu_tanh" if activation.approximate == "tanh" else "gelu"
    raise ValueError(
        f"activation: expected F.relu, F.gelu, nn.ReLU or nn.GELU, got {activation!r}; "
        f"qkv's FeedForward supports 'relu', 'gelu' and 'gelu_tanh'"
    )


def copy_weight_and_bias(target: nn.Module, source: nn.Module) -> None:
    """Copy `weight` and the optional `bias` between modules of one shape (Linear, LayerNorm)."""
    _copy(target.weight, source.weight)
    if (target.bias is None) != (source.bias is None):
        raise ValueError(
            f"bias: target has bias={target.bias is not None}, source has "
            f"bias={source.bias is not None}; expected both or neither"
        )
    if source.bias is not None:
        _copy(target.bias, source.bias)


def _copy(target: torch.Tensor, source: torch.Tensor) -> None:
    if target.shape != source.shape:
        raise ValueError(
            f"weights: shape {tuple(source.shape)} cannot be copied into a parameter of shape "
            f"{tuple(target.shape)}"
        )
    with torch.no_grad():
        target.copy_(source)
