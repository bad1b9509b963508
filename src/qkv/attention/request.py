"""One attention call, checked once: `AttentionRequest`, the options of `qkv.attention` and the
shapes they imply.

Its fields are the one list of the options. `qkv.attention`, `qkv.explain`, `qkv.flash_attention`
and `qkv.triton_attention` take them as keyword arguments and make one request of them
(`takes_options` spells them out in their signatures); the request checks them when it is made
(`qkv.attention.checks`, `qkv.attention.option_checks`), and no backend checks them again.
What the options mean as masks and biases, for the backends that build them, is
qkv.attention.score_terms.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass
from typing import TypeVar

import torch

from qkv.attention import masks
from qkv.attention.checks import check_scale, check_tensors
from qkv.attention.option_checks import (
    check_callable,
    check_dropout,
    check_pattern,
    check_row_lengths,
    check_score_shaped,
    check_sinks,
    check_slopes,
    check_softcap,
)
from qkv.attention.sparse import SparsePattern


# Not frozen: setting its 17 fields through object.__setattr__ would cost each call about as
# much as all of its checks. It is made once per call and read, never changed, by the backends.
@dataclass(eq=False)
class AttentionRequest:
    """The arguments of one `qkv.attention` call, checked: `AttentionRequest(q, k, v, **options)`.

    q: (B, H, L_q, D); k: (B, H_kv, L_k, D); v: (B, H_kv, L_k, D_v), with H % H_kv == 0.
    mask: bool (True = may attend) or additive float, 2-D (L_q, L_k) or 4-D broadcastable to
    (B, H, L_q, L_k). bias: additive float, same shapes. window: W or (left, right) key counts,
    kept as (left, right). sinks: first keys visible on top of the window. alibi_slopes: (H,)
    float, kept detached on q's device. softcap: > 0. score_mod: f(score, batch, head, q_idx,
    k_idx) -> score. pattern: a sparse pattern (qkv.attention.sparse), intersected with the
    rest; L_q <= L_k. lengths: real keys per batch row (the rest is padding); query_lengths:
    real queries per row, whose presence aligns each row on its own: i' = i + lengths[b] -
    query_lengths[b] (both (B,) integer tensors, kept as tuples of ints). scale: default
    1/sqrt(D), kept as a float. dropout_p: in [0, 1). return_weights: whether the weights are
    returned too.

    The score of query i and key j, in this order (every backend computes this):
        s = scale * q_i . k_j                            (fp32 at least)
        s = softcap * tanh(s / softcap)                  (Gemma 2), if softcap
        s = s + bias + float mask - slope_h * |i' - j|   (ALiBi), each if given
        s = score_mod(s, b, h, i, j)                     (FlexAttention's signature), if given
        s = -inf where causal, window (with sinks), a pattern, a bool mask or padding hides j
    with i' = i + L_k - L_q, the query aligned bottom-right (per row with query_lengths);
    score_mod gets the raw index i.
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    _: KW_ONLY
    mask: torch.Tensor | None = None
    causal: bool = False
    scale: float | None = None
    bias: torch.Tensor | None = None
    window: int | tuple[int, int] | None = None
    sinks: int = 0
    alibi_slopes: torch.Tensor | None = None
    softcap: float | None = None
    score_mod: Callable | None = None
    pattern: SparsePattern | None = None
    lengths: torch.Tensor | tuple[int, ...] | None = None
    query_lengths: torch.Tensor | tuple[int, ...] | None = None
    dropout_p: float = 0.0
    return_weights: bool = False

    def __post_init__(self) -> None:
        check_tensors(self.q, self.k, self.v)
        for name, value in _checked_options(self).items():
            setattr(self, name, value)  # the checked form replaces the given one

    @property
    def batch(self) -> int:
        return self.q.shape[0]

    @property
    def num_heads(self) -> int:
        return self.q.shape[1]

    @property
    def num_kv_heads(self) -> int:
        return self.k.shape[1]

    @property
    def query_len(self) -> int:
        return self.q.shape[2]

    @property
    def key_len(self) -> int:
        return self.k.shape[2]

    @property
    def group_size(self) -> int:
        """Query heads per key/value head: 1 for MHA, H for MQA, in between for GQA."""
        return self.num_heads // self.num_kv_heads

    @property
    def has_bool_mask(self) -> bool:
        return self.mask is not None and self.mask.dtype == torch.bool

    @property
    def has_additive_mask(self) -> bool:
        return self.mask is not None and self.mask.dtype != torch.bool

    @property
    def modifies_scores(self) -> bool:
        """Whether scores pass through a soft-cap or a score_mod (no fused SDPA kernel can)."""
        return self.softcap is not None or self.score_mod is not None

    @property
    def plain(self) -> bool:
        """Nothing for a tiled, Triton or Flex kernel to skip or fuse (no window, sparse
        pattern, ALiBi slopes, soft-cap or score_mod): SDPA's fused kernels (FlashAttention-2 on
        CUDA, Dao 2023) are the strongest there, and `auto` takes them at once."""
        return (
            self.window is None
            and self.pattern is None
            and self.alibi_slopes is None
            and not self.modifies_scores
        )


def _checked_options(request: AttentionRequest) -> dict[str, object]:
    """Check every option of `request` against its (checked) q, k, v. Returns the options kept
    in another form than given: scale as a float (1/sqrt(D) for None), window as (left,
    right), dropout_p as a float, the slopes detached on q's device, lengths as tuples."""
    q, k = request.q, request.k
    if request.mask is not None or request.bias is not None:
        target = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])  # (B, H, L_q, L_k)
        if request.mask is not None:
            check_score_shaped("mask", request.mask, target, q.device, allow_bool=True)
        if request.bias is not None:
            check_score_shaped("bias", request.bias, target, q.device, allow_bool=False)
    for name, flag in (("causal", request.causal), ("return_weights", request.return_weights)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name}: expected a bool, got {type(flag).__name__} {flag!r}")
    kept = {"scale": check_scale(request.scale, q.shape[-1])}
    # dropout_p and sinks: their defaults (0.0, 0) go through without a call
    if request.dropout_p != 0.0 or type(request.dropout_p) is not float:
        kept["dropout_p"] = check_dropout(request.dropout_p)
    if request.window is not None:
        kept["window"] = masks._window_extent(request.window)
    if request.sinks != 0 or type(request.sinks) is not int:
        check_sinks(request.sinks)
    if request.alibi_slopes is not None:
        kept["alibi_slopes"] = check_slopes(request.alibi_slopes, q.shape[1], q.device)
    if request.softcap is not None:
        kept["softcap"] = check_softcap(request.softcap)
    if request.score_mod is not None:
        check_callable("score_mod", request.score_mod)
    if request.pattern is not None:
        check_pattern(request.pattern, q.shape[2], k.shape[2])
    if request.lengths is not None or request.query_lengths is not None:
        kept.update(
            check_row_lengths(
                request.lengths, request.query_lengths, q, k, request.pattern, request.alibi_slopes
            )
        )
    return kept


FunctionT = TypeVar("FunctionT", bound=Callable)


def takes_options(function: FunctionT) -> FunctionT:
    """Give `function(q, k, v, *, ..., **options)`, which makes an `AttentionRequest` of its
    **options, the signature it accepts: the request's options spelled out between q, k, v and
    the function's own keyword arguments, for help() and editors."""
    own = inspect.signature(function)
    fixed = [p for p in own.parameters.values() if p.kind is not p.VAR_KEYWORD]
    options = [
        p
        for p in inspect.signature(AttentionRequest).parameters.values()
        if p.kind is p.KEYWORD_ONLY
    ]
    leading = [p for p in fixed if p.kind is not p.KEYWORD_ONLY]
    trailing = [p for p in fixed if p.kind is p.KEYWORD_ONLY]
    function.__signature__ = own.replace(parameters=[*leading, *options, *trailing])
    return function


make_request = AttentionRequest  # the functional spelling: make_request(q, k, v, **options)
