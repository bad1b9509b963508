"""Multi-head attention as a module: projections around `qkv.attention`.

    MultiHead(Q, K, V) = Concat(head_1, ..., head_H) W_o,
    head_h = Attention(Q W_q^(h), K W_k^(h), V W_v^(h))         (Vaswani et al. 2017, s3.2.2)

The H per-head projections are stored as one matrix each (`q_proj`: E -> H * D), and the heads
are split by a reshape. Keys and values may have fewer heads than the queries: H_kv = H is MHA,
1 < H_kv < H grouped-query attention (GQA, Ainslie et al. 2023), H_kv = 1 multi-query attention
(MQA, Shazeer 2019). The attention itself is `qkv.attention`, never re-implemented here: masks,
causal alignment, windows, backends and the NaN guard for fully masked rows all come from there.

Self-attention reads queries, keys and values from `x`; cross-attention reads keys and values
from a `context` (the encoder's memory in a decoder; Vaswani et al. 2017, s3.2.3).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from qkv.attention import attention
from qkv.attention.sparse import SparsePattern
from qkv.layers import torch_interop
from qkv.layers.attention_checks import check_heads, check_rope, check_sizes
from qkv.layers.kv_cache import CrossAttentionCache, LayerCache
from qkv.positional import RotaryEmbedding, alibi_bias
from qkv.validation import check_probability

__all__ = ["MultiHeadAttention", "check_heads", "check_rope"]  # the checks: attention_checks.py


class MultiHeadAttention(nn.Module):
    """Multi-head (MHA), grouped-query (GQA) or multi-query (MQA) attention; self or cross.

    Args:
        embed_dim: E, the width of the input and of the output.
        num_heads: H query heads; head_dim D = E // H.
        num_kv_heads: H_kv key/value heads, dividing H (default H: plain MHA).
        context_dim: width of the cross-attention context (default E).
        bias: biases on the four projections.
        dropout: dropout probability on the attention weights, in training mode only.
        rope: a `qkv.positional.RotaryEmbedding` applied to q and k (self-attention only).
        alibi: add the ALiBi bias -slope_h * |i - j| to the scores (Press et al. 2022;
            self-attention only).
        backend: the `qkv.attention` backend ("auto" picks the fastest that serves the call).
        attention: a callable with `qkv.attention`'s signature, called in its place (default
            None: `qkv.attention`), e.g. a `LinearAttention` from `qkv.attention`; an `nn.Module`
            is registered as a submodule (its buffers move with `.to()`, join the state dict).

    Parameters: q_proj (E -> H * D), k_proj and v_proj (context_dim -> H_kv * D),
    out_proj (H * D -> E), ordinary submodules that an accelerator may swap
    (`qkv.acceleration.packed_linears` does). `register_attention_hook` sees what each call
    attends with (what `qkv.analysis.record_attention` reads its exact maps from).
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        num_kv_heads: int | None = None,
        *,
        context_dim: int | None = None,
        bias: bool = True,
        dropout: float = 0.0,
        rope: RotaryEmbedding | None = None,
        alibi: bool = False,
        backend: str = "auto",
        attention: Callable[..., torch.Tensor | tuple[torch.Tensor, torch.Tensor]] | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        check_sizes(embed_dim, num_heads, num_kv_heads, context_dim)
        self.embed_dim, self.num_heads, self.num_kv_heads = embed_dim, num_heads, num_kv_heads
        self.head_dim = embed_dim // num_heads
        self.context_dim = context_dim
        self.dropout = check_probability("dropout", dropout)
        self.rope = check_rope(rope, self.head_dim)
        if not isinstance(alibi, bool):
            raise TypeError(f"alibi: expected a bool, got {type(alibi).__name__} {alibi!r}")
        self.alibi = alibi
        if not isinstance(backend, str):
            raise TypeError(f"backend: expected a str, got {type(backend).__name__} {backend!r}")
        self.backend = backend
        if attention is not None and not callable(attention):
            raise TypeError(
                f"attention: expected a callable with qkv.attention's signature, or None, "
                f"got {type(attention).__name__}"
            )
        self.attention = attention  # an nn.Module is registered as a submodule
        factory = {"bias": bias, "device": device, "dtype": dtype}
        kv_in = embed_dim if context_dim is None else context_dim
        self.q_proj = nn.Linear(embed_dim, num_heads * self.head_dim, **factory)
        self.k_proj = nn.Linear(kv_in, num_kv_heads * self.head_dim, **factory)
        self.v_proj = nn.Linear(kv_in, num_kv_heads * self.head_dim, **factory)
        self.out_proj = nn.Linear(num_heads * self.head_dim, embed_dim, **factory)
        # register_attention_hook's hooks, by handle id (an OrderedDict: the handle holds a
        # weak reference to it, as nn.Module's own hooks do); empty: one truth test per call
        self._attention_hooks: OrderedDict[int, Callable[..., None]] = OrderedDict()

    def register_attention_hook(self, hook: Callable[..., None]) -> RemovableHandle:
        """Call `hook(module, q, k, *, mask, causal, window, bias, cross, pattern)` before each
        attention this layer computes, as `nn.Module.register_forward_hook` does around its
        forward: q (B, H, L_q, D) and k (B, H_kv, L_k, D) as attention receives them (after
        RoPE, over the whole cache when decoding), the mask, causal and window of the call, the
        score bias (ALiBi's plus the call's, or None), whether it is cross-attention, and the
        call's sparse pattern (or None). Returns a handle whose `remove()` unregisters the hook."""
        if not callable(hook):
            raise TypeError(f"hook: expected a callable, got {type(hook).__name__}")
        handle = RemovableHandle(self._attention_hooks)
        self._attention_hooks[handle.id] = hook
        return handle

    def forward(
        self,
        x: torch.Tensor,
        context: torch.Tensor | None = None,
        *,
        mask: torch.Tensor | None = None,
        causal: bool = False,
        window: int | tuple[int, int] | None = None,
        positions: torch.Tensor | None = None,
        return_weights: bool = False,
        cache: LayerCache | CrossAttentionCache | None = None,
        pattern: SparsePattern | None = None,
        bias: torch.Tensor | Callable[[int, int], torch.Tensor] | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Attend from `x` (B, L_q, E) to itself, or to `context` (B, L_k, context_dim).

        mask, causal and window mean what they mean in `qkv.attention`: a bool mask is True
        where a query MAY attend (a float mask is additive), of shape (L_q, L_k) or
        (B|1, H|1, L_q|1, L_k), e.g. `qkv.masks.padding(lengths, L_k)` -> (B, 1, 1, L_k).
        positions: token positions for `rope`, (L,) or (B, L); default 0 .. L - 1.
        cache: for decoding (`qkv.layers.kv_cache`): self-attention writes the new keys and
        values into a `LayerCache` and attends over everything cached (x holds only the new
        tokens); cross-attention computes the context's keys and values once into a
        `CrossAttentionCache`.
        pattern: a sparse pattern (`qkv.sparse`), e.g. `Packed` for sequences packed along L.
        bias: an additive score bias broadcast to (B, H, L_q, L_k), over every key attended to
            (the cached ones too), or a callable (L_q, L_k) -> such a bias, called once the
            cache has set L_k: e.g. T5's relative bias, `qkv.positional.T5RelativeBias`, whose
            offsets align the queries with the last keys. Added to ALiBi's when both are on.

        Returns the output (B, L_q, E), or (output, weights (B, H, L_q, L_k)) if return_weights;
        the weights are computed only then (`qkv.attention` then picks a backend that has them).
        """
        self._check_call(x, context, positions)
        B, L_q, _ = x.shape
        source = x if context is None else context
        L_k = source.shape[1]
        H, H_kv, D = self.num_heads, self.num_kv_heads, self.head_dim
        q = self.q_proj(x).view(B, L_q, H, D).transpose(1, 2)  # (B, H, L_q, D)

        def project_keys_values() -> tuple[torch.Tensor, torch.Tensor]:
            k, v = self.k_proj(source), self.v_proj(source)  # each (B, L_k, H_kv * D)
            k = k.view(B, L_k, H_kv, D).transpose(1, 2)  # (B, H_kv, L_k, D)
            v = v.view(B, L_k, H_kv, D).transpose(1, 2)  # (B, H_kv, L_k, D)
            return k, v

        if isinstance(cache, CrossAttentionCache):
            k, v = cache.keys_values(project_keys_values)  # the memory's, computed once
        elif cache is not None:
            q, k, v = cache.attend_inputs(q, *project_keys_values(), self.rope, positions)
            q = q if q.dtype == k.dtype else q.to(k.dtype)  # a cache in another dtype (kv_dtype)
        else:
            k, v = project_keys_values()
            if self.rope is not None:
                q, k = self.rope(q, k, positions=positions)
        L_k = k.shape[2]
        if callable(bias):
            bias = bias(L_q, L_k)
        bias = _sum_biases(self._alibi_bias(L_q, L_k, q), bias)
        if self._attention_hooks:  # they see the post-RoPE q and k of every call, cached or not
            cross = context is not None
            for hook in list(self._attention_hooks.values()):
                hook(self, q, k, mask=mask, causal=causal, window=window, bias=bias, cross=cross,
                     pattern=pattern)  # fmt: skip
        attend = attention if self.attention is None else self.attention
        result = attend(
            q,
            k,
            v,
            mask=mask,
            causal=causal,
            window=window,
            bias=bias,
            dropout_p=self.dropout if self.training else 0.0,
            return_weights=return_weights,
            backend=self.backend,
            **({} if pattern is None else {"pattern": pattern}),
        )
        output, weights = result if return_weights else (result, None)
        output = output.transpose(1, 2).reshape(B, L_q, H * D)  # (B, L_q, H * D): concat heads
        if output.dtype != x.dtype:  # attention ran in the cache's dtype
            output = output.to(x.dtype)
        output = self.out_proj(output)  # (B, L_q, E)
        return (output, weights) if return_weights else output

    @classmethod
    def from_torch(cls, module: nn.MultiheadAttention) -> MultiHeadAttention:
        """The same attention as PyTorch's `nn.MultiheadAttention`, with its weights copied.

        `in_proj_weight` (3E, E) is split in Q, K, V order, or the separate `q/k/v_proj_weight` are
        taken when kdim/vdim differ from E; biases, out_proj and the dropout probability follow. The
        result is batch-first whatever `module.batch_first` says (the weights do not depend on it).
        add_bias_kv, add_zero_attn and kdim != vdim raise ValueError: qkv does not model them.
        """
        layer = cls(**torch_interop.mha_config_from_torch(module))
        torch_interop.load_mha_from_torch(layer, module)
        return layer

    def to_torch(self) -> nn.MultiheadAttention:
        """A batch-first `nn.MultiheadAttention` computing the same function (plain MHA only:
        ValueError for GQA/MQA, rope or alibi)."""
        return torch_interop.mha_to_torch(self)

    def extra_repr(self) -> str:
        return (
            f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, "
            f"num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
            f"context_dim={self.context_dim}, dropout={self.dropout}, alibi={self.alibi}, "
            f"backend={self.backend!r}"
        )

    def _alibi_bias(self, L_q: int, L_k: int, q: torch.Tensor) -> torch.Tensor | None:
        """(1, H, L_q, L_k) ALiBi scores, or None; fp32 at least, like the softmax statistics."""
        if not self.alibi:
            return None
        dtype = torch.promote_types(q.dtype, torch.float32)
        return alibi_bias(self.num_heads, L_q, L_k, device=q.device, dtype=dtype)

    def _check_call(
        self, x: torch.Tensor, context: torch.Tensor | None, positions: torch.Tensor | None
    ) -> None:
        _check_sequence("x", x, self.embed_dim)
        if context is not None:
            width = self.embed_dim if self.context_dim is None else self.context_dim
            _check_sequence("context", context, width)
            if context.shape[0] != x.shape[0]:
                raise ValueError(
                    f"context: expected batch size {x.shape[0]} (that of x), got {context.shape[0]}"
                )
            if self.rope is not None or self.alibi:
                raise ValueError(
                    "context: cross-attention with rope or alibi is not supported; both encode "
                    "the distance between positions of one sequence, and queries and keys come "
                    "from different sequences here; expected context=None (self-attention)"
                )
        if positions is not None and self.rope is None:
            raise ValueError(
                "positions: given, but this layer has no rope to use them; expected "
                "positions=None, or a layer built with rope=RotaryEmbedding(...)"
            )


def _sum_biases(alibi: torch.Tensor | None, bias: torch.Tensor | None) -> torch.Tensor | None:
    if alibi is None or bias is None:
        return bias if alibi is None else alibi
    return alibi + bias


def _check_sequence(name: str, tensor: torch.Tensor, width: int) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dim() != 3 or tensor.shape[-1] != width:
        raise ValueError(f"{name}: expected shape (B, L, {width}), got {tuple(tensor.shape)}")
