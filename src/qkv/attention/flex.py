"""Backend `flex`: PyTorch's FlexAttention (Dong et al. 2024), compiled, serving `qkv.attention`.

FlexAttention fuses attention around two user functions, and qkv's options map onto them:
- causal, window and sinks -> `mask_mod(b, h, q_idx, k_idx) -> bool` and a BlockMask: qkv's
  tile rule (`qkv.attention.tiles.TilePlan`, the interval arithmetic of the tiled
  backend) marks each 128 x 128 block hidden (skipped), whole (no mask_mod) or partial, with no
  pass over an L_q x L_k grid. Cached per pattern and shape.
- soft-capping, bias and float mask, ALiBi, `score_mod`, then a dense bool mask (as -inf) ->
  one `score_mod`, in the order of `AttentionRequest`. Numbers (cap, window edges, shift) enter
  as 0-d tensors, so one compiled kernel serves every window, cap and length; only the kind of
  pattern (which parts are present) and the dtype compile anew.

flex_attention is compiled once per process (dynamic shapes; ~4 s for the first pattern on a
2-core CPU, ~0.5 s for each further kind, less in a later process through inductor's on-disk
cache). A call that brings a dense (L_q, L_k) mask or bias, or a sparse pattern (whose
lookup tables the mask_mod reads), compiles for its exact shapes instead: with dynamic shapes,
torch 2.13's CPU kernel fails to build when a score_mod reads such a tensor next to a
BlockMask, or when a mask_mod reads one at all (so a bool mask enters the score_mod as -inf).
It has no backward on the CPU in torch 2.13, and its CPU kernel takes fp32, bf16 and fp16 only.
"""

from __future__ import annotations

import functools

import torch

from qkv import capabilities
from qkv.attention import score_terms
from qkv.attention.nan_rows import fill_nan_rows, nan_rows
from qkv.attention.request import AttentionRequest
from qkv.attention.tiles import TilePlan

name = "flex"
summary = "PyTorch's FlexAttention, compiled: qkv's patterns as score_mod + BlockMask"

BLOCK = 128  # FlexAttention's default block size: the BlockMask's granularity
CPU_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Below this many scores per head auto leaves the call to SDPA, tiled or the reference math:
# a compiled kernel's fixed costs grow in weight as calls shrink. Chosen, not measured: at
# L = 1024 (1024^2 scores, benchmarks/patterns.py) flex is already the fastest on patterns.
MIN_SCORES = 512 * 512
_LAYOUTS_MAX = 64  # cached BlockMask layouts (a model makes one per pattern and length)


def why_not(request: AttentionRequest) -> str | None:
    if _flex_attention() is None:
        return f"torch {torch.__version__} has no FlexAttention (torch >= 2.5)"
    if request.return_weights:
        return "it returns no weights"
    if request.dropout_p > 0.0:
        return "it has no dropout"
    if request.lengths is not None or request.query_lengths is not None:
        return "per-row lengths are not turned into its BlockMask"
    device = request.q.device.type
    if device not in ("cpu", "cuda"):
        return f"it runs on CPU and CUDA tensors, not {device}"
    if device == "cpu" and request.q.dtype not in CPU_DTYPES:
        return f"its CPU kernel takes fp32, bf16 and fp16, not {request.q.dtype}"
    if device == "cpu" and needs_grad(request):
        return (
            "torch has no FlexAttention backward on the CPU (call it under torch.no_grad(), "
            "or let auto pick a backend with one)"
        )
    if device == "cpu" and _score_mod_parts(request) and not _clear_of_the_cpu_tail_bug(request):
        return (
            f"L_q={request.query_len}, L_k={request.key_len}: torch 2.13's CPU kernel computes "
            f"wrong rows when a score_mod (soft-cap, dense mask or bias, ALiBi, yours) meets a "
            f"length of 8 more than a multiple of 16"
        )
    if _has_dense_additive(request) and (_has_structure(request) or device == "cpu"):
        return (
            "a dense bias or float mask (on the CPU, or next to causal/window): FlexAttention's "
            "kernel turns a NaN score into an empty row (output 0) there, against qkv's NaN "
            "rule (qkv.attention.masks); SDPA reads such tensors as fast"
        )
    if device == "cpu" and not torch.compiler.is_compiling():  # it reads env and CPU: untraceable
        support = _cpu_support()
        if not support:
            return support.reason
    return None


@functools.cache
def _cpu_support() -> capabilities.Support:
    """`capabilities.flex_attention_cpu()`, asked once per process: what it reads (the CPU, the
    compiler, ATEN_CPU_CAPABILITY) is set before a process starts attending."""
    return capabilities.flex_attention_cpu()


# torch 2.13's CPU FlexAttention kernel, with a score_mod, gives wrong values in a few rows of
# the last (batch, head) when a length is 8 more than a multiple of 16 (seen on an AVX2 CPU at
# every such L tried from 72 to 200, in 1 to 14 of 15 random draws; never at the other
# lengths tried, 56 to 264): such calls are left to the other backends.
def _hits_the_cpu_tail_bug(size: int) -> bool:
    return size % 16 == 8


def _score_mod_parts(request: AttentionRequest) -> bool:
    """Whether the call needs a score_mod (see `_score_mod`): a soft-cap, a mask or bias of
    either kind, ALiBi or a score_mod of its own."""
    return (
        request.softcap is not None
        or request.mask is not None
        or request.bias is not None
        or request.alibi_slopes is not None
        or request.score_mod is not None
    )


def _has_dense_additive(request: AttentionRequest) -> bool:
    """Whether `score_terms.dense_additive(request)` has a term (without summing them)."""
    return request.bias is not None or request.has_additive_mask


def _clear_of_the_cpu_tail_bug(request: AttentionRequest) -> bool:
    return not any(_hits_the_cpu_tail_bug(size) for size in (request.query_len, request.key_len))


def why_not_auto(request: AttentionRequest) -> str | None:
    """Why `auto` passes over a call flex could serve: another backend is faster there."""
    if torch.compiler.is_compiling():  # its BlockMask cache and compiled kernel are eager-only
        return "inside a compiled graph auto keeps to SDPA and tiled (no BlockMask cache there)"
    scores = request.query_len * request.key_len
    if scores < MIN_SCORES:
        return f"L_q * L_k = {scores} < {MIN_SCORES}: a compiled kernel's fixed costs dominate"
    if request.pattern is not None:
        return (
            "a sparse pattern compiles for each length (its lookup tables fail to build with "
            "dynamic shapes in torch 2.13): auto leaves it to tiled, which needs no compile"
        )
    if request.modifies_scores:
        return None  # only flex fuses a soft-cap or a score_mod
    if request.mask is not None or request.bias is not None:
        return "the call brings a dense mask or bias, which SDPA reads as fast"
    if request.window is None and request.alibi_slopes is None:
        return "SDPA needs no dense mask or bias for this call, and is as fast or faster"
    return None


def needs_grad(request: AttentionRequest) -> bool:
    """Whether autograd will ask this call for a backward."""
    tensors = (request.q, request.k, request.v, request.bias, request.mask)
    return torch.is_grad_enabled() and any(
        t is not None and t.is_floating_point() and t.requires_grad for t in tensors
    )


def notes(request: AttentionRequest) -> list[str]:
    out = [
        "flex_attention compiled once per process and kind of pattern (dynamic shapes: every "
        "length, window and cap reuses it)"
    ]
    if _has_structure(request):
        out.append(
            f"BlockMask of {BLOCK} x {BLOCK} blocks from qkv's tile rule: hidden blocks skipped, "
            f"whole blocks unmasked; cached per pattern and shape"
        )
    parts = [
        label
        for label, present in (
            ("soft-cap", request.softcap is not None),
            ("dense bias/float mask", _has_dense_additive(request)),
            ("ALiBi from the slopes", request.alibi_slopes is not None),
            ("your score_mod", request.score_mod is not None),
            ("the bool mask as -inf", request.has_bool_mask),
        )
        if present
    ]
    if parts:
        out.append("score_mod: " + ", then ".join(parts) + ", computed per score in the kernel")
    if request.group_size > 1:
        out.append("GQA/MQA: enable_gqa=True, K/V not repeated")
    if _compute_dtype(request) != request.q.dtype:
        out.append(
            f"{request.q.dtype} on the CPU: computed in fp32 and cast back (FlexAttention's "
            f"CPU kernel is slower in low precision than in fp32)"
        )
    return out


def run(request: AttentionRequest) -> tuple[torch.Tensor, None]:
    """Returns (output (B, H, L_q, D_v), None) in q's dtype."""
    # detached: torch refuses CPU tensors that require grad even under no_grad, where no
    # backward can follow (why_not refuses the calls that autograd records)
    arguments = (request.q.detach(), request.k.detach(), request.v.detach())
    if needs_grad(request):
        arguments = (request.q, request.k, request.v)
    dtype = _compute_dtype(request)
    if dtype != request.q.dtype:
        arguments = tuple(t.to(dtype) for t in arguments)
    options = {
        "score_mod": _score_mod(request),
        "block_mask": _block_mask(request),
        "scale": request.scale,
        "enable_gqa": request.group_size > 1,
    }
    if torch.compiler.is_compiling():  # already in a graph: traced into it, not compiled apart
        output = _flex_attention()(*arguments, **options)
    else:
        # a tensor the mask_mod reads (a dense mask, a pattern's lookup table) fails to
        # build with dynamic shapes in torch 2.13: exact shapes then, one compile per length
        dense = request.mask is not None or request.bias is not None
        compiled = _compiled(dynamic=not dense and request.pattern is None)
        # Without duck-typed sizes: two sizes equal in the first call (batch 2 and 2 key
        # blocks) stay two symbols instead of one that a later call fails (a recompile).
        with torch.fx.experimental._config.patch(use_duck_shape=False):
            output = compiled(*arguments, **options)
    output = fill_nan_rows(output, _nan_rows(request))
    return output.to(request.q.dtype), None


def _nan_rows(request: AttentionRequest) -> torch.Tensor:
    """Bool (B, H, L_q, 1): the rows that qkv's NaN rule makes NaN and FlexAttention's
    kernel returns as 0 (`qkv.attention.nan_rows`); rows with no visible key stay 0."""
    visible = score_terms.allowed(request)
    additive = score_terms.additive(request)
    if additive is not None:
        shown = ~torch.isneginf(additive)
        visible = shown if visible is None else visible & shown
    rows = nan_rows(request.q.detach(), request.k.detach(), visible)
    if visible is None:
        return rows
    return rows & visible.any(dim=-1, keepdim=True)


def _compute_dtype(request: AttentionRequest) -> torch.dtype:
    """fp32 for bf16/fp16 on the CPU: FlexAttention's CPU kernel is 1.4-1.6x slower in bf16
    than in fp32 (benchmarks/patterns.py), more than the casts of q, k, v cost."""
    if request.q.device.type == "cpu" and request.q.dtype in (torch.bfloat16, torch.float16):
        return torch.float32
    return request.q.dtype


def _flex_attention():
    """PyTorch's flex_attention, or None before torch 2.5; looked up once, and kept in a
    module global rather than a functools.cache (which torch.compile warns of, tracing a step
    that asks auto for a backend)."""
    global _FLEX_ATTENTION
    if _FLEX_ATTENTION is _NOT_LOOKED_UP:
        try:
            from torch.nn.attention.flex_attention import flex_attention
        except ImportError:
            flex_attention = None
        _FLEX_ATTENTION = flex_attention
    return _FLEX_ATTENTION


_NOT_LOOKED_UP = object()
_FLEX_ATTENTION = _NOT_LOOKED_UP


@functools.cache
def _compiled(dynamic: bool):
    # A recompile per kind of pattern and dtype: more than torch.compile's default of 8 per
    # function would silently run flex_attention unfused (many times slower). Isolated, these
    # recompiles count against this compiled function's limit alone, not other callers'.
    return torch.compile(
        _flex_attention(), dynamic=dynamic, recompile_limit=64, isolate_recompiles=True
    )


def _has_structure(request: AttentionRequest) -> bool:
    return request.causal or request.window is not None or request.pattern is not None


def _block_mask(request: AttentionRequest):
    """FlexAttention's BlockMask for the call's causal/window/sinks, or None."""
    if not _has_structure(request):
        return None
    return _cached_block_mask(
        request.query_len,
        request.key_len,
        request.causal,
        request.window,
        request.sinks if request.window is not None else 0,
        request.q.device,
        needs_grad(request),
        request.pattern,
    )


@functools.lru_cache(maxsize=_LAYOUTS_MAX)
def _cached_block_mask(L_q, L_k, causal, window, sinks, device, with_q_blocks: bool, pattern):
    """The BlockMask of one pattern and shape, its mask_mod included: a model asks for the
    same one in every layer. `with_q_blocks`: the transposed layout a backward pass reads."""
    from torch.nn.attention.flex_attention import BlockMask

    plan = TilePlan(
        query_len=L_q,
        key_len=L_k,
        block_q=BLOCK,
        block_k=BLOCK,
        causal=causal,
        window=window,
        sinks=sinks,
        lengths=None,
        has_dense_mask=False,
        pattern=pattern,
    )
    return BlockMask.from_kv_blocks(
        *_layout(plan, device),
        BLOCK_SIZE=BLOCK,
        mask_mod=_mask_mod(plan, device),
        seq_lengths=(L_q, L_k),
        compute_q_blocks=with_q_blocks,
    )


def _layout(plan: TilePlan, device) -> tuple[torch.Tensor, ...]:
    """(partial count, partial indices, whole count, whole indices) per query block, each
    (1, 1, n_q, ...) int32: the key blocks FlexAttention visits, partial ones through mask_mod."""
    computed, whole = (t.to(device) for t in plan.grid(BLOCK, BLOCK))  # (n_q, n_k) each
    partial = computed & ~whole

    def listed(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        count = blocks.sum(dim=-1, dtype=torch.int32)  # (n_q,)
        order = torch.argsort((~blocks).to(torch.int8), dim=-1, stable=True)  # listed first
        return count[None, None], order.to(torch.int32)[None, None]

    return (*listed(partial), *listed(whole))


def _mask_mod(plan: TilePlan, device):
    """Visibility of key k_idx from query q_idx: `TilePlan.visible`'s rule, per element.

    Two functions for every causal/window/sinks pattern (an absent constraint is a bound no key
    reaches): one for self-attention without sinks, one for the rest. So two compiled kernels
    serve them all; only the BlockMask differs.
    """
    number = functools.partial(torch.tensor, device=device)
    unbounded = plan.query_len + plan.key_len
    left, right = plan.window if plan.window is not None else (unbounded, unbounded)
    ahead = 0 if plan.causal else right  # how far past its own position a query sees
    shift, behind, ahead = number(plan.shift), number(left), number(ahead)
    sinks = number(plan.sinks)

    if plan.shift == 0 and plan.sinks == 0:  # self-attention, no sinks: fewer ops per score

        def mask_mod(batch, head, q_idx, k_idx):
            return (k_idx >= q_idx - behind) & (k_idx <= q_idx + ahead)

    else:

        def mask_mod(batch, head, q_idx, k_idx):
            position = q_idx + shift  # aligned bottom-right
            near = (k_idx >= position - behind) & (k_idx <= position + ahead)
            return near | ((k_idx < sinks) & (k_idx <= position + ahead))

    if plan.pattern is None:
        return mask_mod
    structural, pattern = mask_mod, plan.pattern.rule(plan.key_len, device)

    def with_pattern(batch, head, q_idx, k_idx):  # the sparse pattern, intersected
        visible = pattern(q_idx + shift, k_idx)
        return structural(batch, head, q_idx, k_idx) & visible

    return with_pattern


def _score_mod(request: AttentionRequest):
    """Soft-cap, dense additive terms, ALiBi, the user's score_mod and a dense bool mask."""
    cap = request.softcap
    number = functools.partial(torch.tensor, dtype=torch.float32, device=request.q.device)
    cap, inverse = (None, None) if cap is None else (number(cap), number(1.0 / cap))
    dense = score_terms.dense_additive(request)
    dense = None if dense is None else _expanded(request, dense.to(torch.float32))
    after = score_terms.score_mod_with_alibi(request)
    allowed = _expanded(request, request.mask) if request.has_bool_mask else None
    if cap is None and dense is None and after is None and allowed is None:
        return None
    hidden = torch.tensor(float("-inf"), device=request.q.device)

    def score_mod(score, batch, head, q_idx, k_idx):
        if cap is not None:
            score = cap * torch.tanh(score * inverse)
        if dense is not None:
            score = score + dense[batch, head, q_idx, k_idx]
        if after is not None:
            score = after(score, batch, head, q_idx, k_idx)
        if allowed is not None:
            score = torch.where(allowed[batch, head, q_idx, k_idx], score, hidden)
        return score

    return score_mod


def _expanded(request: AttentionRequest, tensor: torch.Tensor) -> torch.Tensor:
    """A 2-D or broadcastable 4-D mask/bias as a (B, H, L_q, L_k) view (stride 0, no copy)."""
    shape = (request.batch, request.num_heads, request.query_len, request.key_len)
    return (tensor if tensor.dim() == 4 else tensor[None, None]).expand(shape)
