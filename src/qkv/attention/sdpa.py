"""Backend `sdpa`: PyTorch's fused `F.scaled_dot_product_attention`, with qkv's conventions.

What this wrapper adds to the raw call, and nothing more:
- causal with L_q != L_k is aligned bottom-right (SDPA's `is_causal` aligns top-left), through
  an explicit mask; with L_q == L_k, `is_causal=True` is passed through untouched;
- windows (with sinks), bool masks, additive biases and ALiBi become one SDPA `attn_mask`
  (soft-capping and score_mod it cannot serve);
- a query row with no visible key gives output 0 and finite gradients, by unmasking that row
  for the kernel and zeroing its output afterwards (PyTorch's own behaviour here differs across
  versions and kernels: NaN on some, uniform weights on others);
- a row with a NaN query or a NaN key in view gives NaN, where the kernel would return 0
  (`qkv.attention.nan_rows`);
- GQA/MQA via `enable_gqa` (torch >= 2.5), so K/V are not repeated where the kernel allows it;
  a decoding step's queries stacked as the rows of their K/V head, so that each K/V head is read
  once (`_stacked_group_attention`);
- one bf16/fp16 query row on the CPU (a decoding step without GQA) runs in fp32, where
  PyTorch's CPU kernel is several times faster (see `_compute_dtype`);
- sequences packed along L (`qkv.sparse.Packed`, causal or not, nothing else masked) are
  gathered into a padded batch of sequences for the kernel and scattered back
  (qkv.attention.sdpa_packed): the kernel's work is that of a padded batch, not of the whole
  packed length squared.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from qkv.attention import score_terms, sdpa_packed
from qkv.attention.nan_rows import (
    fill_nan_rows,
    known_clean,
    nan_keys,
    nan_rows,
    without_nan_keys,
)
from qkv.attention.request import AttentionRequest
from qkv.attention.sparse import Packed

name = "sdpa"
summary = "PyTorch's fused scaled_dot_product_attention (flash / memory-efficient / math kernels)"

_HAS_ENABLE_GQA = tuple(int(p) for p in torch.__version__.split(".")[:2]) >= (2, 5)


def why_not(request: AttentionRequest) -> str | None:
    if request.return_weights:
        return "the fused kernel does not return the attention weights"
    if request.modifies_scores:
        return "the fused kernel cannot soft-cap or score_mod the scores"
    return None


def why_not_auto(request: AttentionRequest) -> str | None:
    """Why `auto` passes over a request this backend could serve: dropout on the CPU (but for
    packed sequences, which the reference math would attend over the whole packed length)."""
    if request.dropout_p > 0.0 and request.q.device.type == "cpu" and not repads(request):
        return (
            "dropout on the CPU: PyTorch's kernel falls back to its math path and draws the "
            "mask with bernoulli_; the reference backend runs the same math with qkv's cheaper "
            "dropout mask"
        )
    return None


def notes(request: AttentionRequest) -> list[str]:
    """How this backend serves `request`, in words, for `qkv.explain` (sdpa_notes.py)."""
    from qkv.attention import sdpa_notes  # it reads this module's own rules

    return sdpa_notes.notes(request)


def run(request: AttentionRequest) -> tuple[torch.Tensor, None]:
    """Returns (output (B, H, L_q, D_v), None), in q's dtype."""
    if repads(request):
        return sdpa_packed.repadded(request, enable_gqa=_HAS_ENABLE_GQA), None
    q, k, v = request.q, request.k, request.v
    dtype = _compute_dtype(request)
    if dtype != q.dtype:
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    stacked = _stacks_group(request)  # else enable_gqa (or K/V repeated) for GQA/MQA
    gqa = {}
    if request.group_size > 1 and not stacked:
        if _HAS_ENABLE_GQA:
            gqa = {"enable_gqa": True}
        else:
            k = k.repeat_interleave(request.group_size, dim=1)  # (B, H, L_k, D)
            v = v.repeat_interleave(request.group_size, dim=1)  # (B, H, L_k, D_v)
    if not _needs_mask(request):
        if stacked:
            output = _stacked_group_attention(q, k, v, request.scale)
        else:
            output = F.scaled_dot_product_attention(
                q, k, v, dropout_p=request.dropout_p,
                is_causal=request.causal and _plain_causal(request), scale=request.scale, **gqa,
            )  # fmt: skip
        # Every row sees key 0 here, and the kernel already gives NaN to a row with some of its
        # keys NaN: a row comes back 0 only when all its keys are NaN, key 0 among them. So
        # key 0 stands for the whole K cache, and a decoding step reads D values, not L_k x D.
        output = fill_nan_rows(output, nan_rows(q, k[:, :, :1], None))
        return _cast_back(output, request), None
    attn_mask, row_visible, eager = _kernel_mask(request, dtype)
    nan_key = nan_keys(k)  # (B, H_kv, L_k)
    if eager and known_clean(nan_key):  # no NaN key: nothing to hide from the kernel or find
        kernel_k, visible = k, None
    else:  # the rows with no visible key see every key in attn_mask: zeroed below anyway
        kernel_k = without_nan_keys(k, nan_key)
        visible = attn_mask if attn_mask.dtype == torch.bool else ~torch.isneginf(attn_mask)
    if stacked:
        output = _stacked_group_attention(q, kernel_k, v, request.scale, attn_mask)
    else:
        output = F.scaled_dot_product_attention(
            q, kernel_k, v, attn_mask=attn_mask, dropout_p=request.dropout_p,
            scale=request.scale, **gqa,
        )  # fmt: skip
    output = fill_nan_rows(output, nan_rows(q, k, visible, nan_key))
    if row_visible is not None:
        output = torch.where(row_visible, output, 0.0)  # rows with no visible key -> 0
    return _cast_back(output, request), None


def _stacks_group(request: AttentionRequest) -> bool:
    """A decoding step's one query per head, with GQA/MQA and no dropout: the queries of a K/V
    head's group can be one call's query rows (a mask or bias per head folds with them)."""
    return request.query_len == 1 and request.group_size > 1 and request.dropout_p == 0.0


def _stacked_group_attention(q, k, v, scale: float | None, attn_mask=None) -> torch.Tensor:
    """(B, H, 1, D) queries over (B, H_kv, L_k, D) keys as (B, H_kv, group, D): each K/V head's
    group of queries stacked as its rows (head h is row h % group of K/V head h // group, as
    `enable_gqa` pairs them), so that the kernel reads each K/V head once, where with
    `enable_gqa` PyTorch's CPU kernel reads it once per query head: a group shares its K/V
    head (Ainslie et al. 2023), and so one read of it. SmolLM2's decoding step (9 query
    heads, 3 K/V heads, 30 layers) over 3600 cached keys: ~14 ms of attention against ~18
    (Intel AVX-512, 2 threads). attn_mask: broadcastable to (B, H, 1, L_k); a head dimension
    of H is folded as the queries are. -> (B, H, 1, D_v)."""
    B, H, _, D = q.shape
    H_kv = k.shape[1]
    stacked = q.reshape(B, H_kv, H // H_kv, D)
    if attn_mask is not None and attn_mask.dim() >= 3 and attn_mask.shape[-3] == H > 1:
        attn_mask = attn_mask.reshape(*attn_mask.shape[:-3], H_kv, H // H_kv, attn_mask.shape[-1])
    output = F.scaled_dot_product_attention(stacked, k, v, attn_mask=attn_mask, scale=scale)
    return output.reshape(B, H, 1, v.shape[-1])  # from (B, H_kv, group, D_v)


def repads(request: AttentionRequest) -> bool:
    """Whether the call is packed self-attention sequences and nothing else, which
    qkv.attention.sdpa_packed runs as a padded batch."""
    pattern = request.pattern
    return (
        isinstance(pattern, Packed)
        and pattern.window is None
        and pattern.query_offsets == pattern.key_offsets
        and request.window is None
        and request.mask is None
        and request.bias is None
        and request.alibi_slopes is None
        and request.lengths is None
        and request.query_lengths is None
    )


def _cast_back(output: torch.Tensor, request: AttentionRequest) -> torch.Tensor:
    """The output in q's dtype (a call of `.to` costs a dispatch even when it has nothing to
    do)."""
    return output if output.dtype == request.q.dtype else output.to(request.q.dtype)


def _compute_dtype(request: AttentionRequest) -> torch.dtype:
    """fp32 for one bf16/fp16 query per K/V head on the CPU (a decoding step), else q's dtype.

    PyTorch's CPU kernel serves a single low-precision query row several times slower per key
    than an fp32 one, so the fp32 call, three small casts included, is faster, increasingly so
    as the key length grows (see benchmarks/decode.py), and its softmax statistics are fp32
    either way. Several rows keep the kernel's own dtype: a longer L_q, and a GQA/MQA group
    stacked on its K/V head (`_stacks_group`), whose low-precision call took 0.43-0.86x the
    time of the fp32 one, casts included (groups of 2 to 8 over 512 and 3600 keys, bf16 and
    fp16; Intel AVX-512 and held to AVX2, 2 threads).
    """
    low_precision = request.q.dtype in (torch.bfloat16, torch.float16)
    one_row = request.query_len == 1 and not _stacks_group(request)
    if low_precision and one_row and request.q.device.type == "cpu":
        return torch.float32
    return request.q.dtype


def _plain_causal(request: AttentionRequest) -> bool:
    """Causal that SDPA's is_causal serves as is: L_q == L_k (its top-left alignment is then
    bottom-right too). One query is never plain causal (unless L_k == 1, where causal hides
    nothing): checked first, so that a compiled decoding step, whose key length is symbolic,
    answers with a plain bool."""
    if request.query_len == 1:
        return False
    return request.query_len == request.key_len


def _sees_every_key(request: AttentionRequest) -> bool:
    """One query aligned bottom-right sees every key: causal needs no mask at all (a decoding
    step with a KV cache), where SDPA's top-left is_causal would show it only key 0."""
    return request.query_len == 1


def _needs_mask(request: AttentionRequest) -> bool:
    """False when the kernel can run maskless (no mask, bias, window, or only aligned causal)."""
    structural_only = (
        request.mask is None
        and request.bias is None
        and request.window is None
        and request.alibi_slopes is None
        and request.pattern is None
        and request.lengths is None
        and request.query_lengths is None
    )
    causal_free = not request.causal or _plain_causal(request) or _sees_every_key(request)
    return not (structural_only and causal_free)


def _kernel_mask(
    request: AttentionRequest, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor | None, bool]:
    """One SDPA attn_mask with no empty rows, which rows had any visible key, and whether the
    call is known to run eagerly (its structure was cached: `score_terms.structure_key` makes
    no key in a traced graph).

    Returns (attn_mask broadcastable to (B, H, L_q, L_k), bool or `dtype`; row_visible
    (..., L_q, 1) bool, or None where every row sees a key; eager).
    """
    if request.mask is None and request.bias is None and request.alibi_slopes is None:
        key = score_terms.structure_key(request)  # None where it is not to be cached
        if key is not None:
            return *_structural_kernel_mask(*key), True
    allowed = score_terms.allowed(request)
    additive = score_terms.additive(request)
    if additive is None:
        row_visible = allowed.any(dim=-1, keepdim=True)
        return allowed | ~row_visible, row_visible, False
    additive = additive.to(dtype)
    if allowed is not None:
        additive = additive.masked_fill(~allowed, float("-inf"))
    # A row is empty only where every score is -inf: a NaN counts as visible, so that it
    # reaches the output (qkv.attention's NaN rule) instead of being zeroed with the row.
    row_visible = ~torch.isneginf(additive).all(dim=-1, keepdim=True)
    return additive.masked_fill(~row_visible, 0.0), row_visible, False


@functools.lru_cache(maxsize=8)
def _structural_kernel_mask(*key) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`_kernel_mask` of a call with causal/window/sinks only: the same in every layer and
    step of a model, so built once (within `structure_key`'s size bound), with one host sync
    to learn whether any row is empty (causal alone, L_q <= L_k, has none: a chunk of a
    prompt over a filled KV cache)."""
    allowed = score_terms.structural_visibility(*key)
    row_visible = allowed.any(dim=-1, keepdim=True)
    if bool(row_visible.all()):
        return allowed, None
    return allowed | ~row_visible, row_visible
