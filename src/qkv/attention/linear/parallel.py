"""Linear attention over whole sequences, non-causal or causal (Katharopoulos et al. 2020,
s3.2-3.3), with any feature map of `features` (elu(x) + 1, or FAVOR+'s random features,
Choromanski et al. 2021).

Causal attention reads prefix sums of S and z, over keys j <= i + L_k - L_q (aligned
bottom-right, as `qkv.masks.causal`, s3.3), in O(L) memory, forward and backward (what s3.3.1's
gradients as cumulative sums aim at): `_CausalSums`, an autograd Function, works in chunks of C
positions, the chunkwise form of Hua et al. 2022 and Yang et al. 2024: inside a chunk the masked
quadratic form (C, C), across chunks the running state S. Its backward runs chunk by chunk too:
the query gradients in forward order, recomputing the running S; the key and value gradients in
reverse order, carrying R = sum over later queries of phi(q_i) dout_i^T. It saves only its
inputs, O(L (F + D_v)); a cumulative sum would keep the (L, F, D_v) prefix states, and autograd
through a loop over the chunks would keep every chunk's (F, D_v) state, O(L F D_v / C), and a
graph node per chunk. Computation is in fp32 (fp64 stays fp64); outputs come back in q's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from qkv.attention.linear.features import FeatureMap, key_features, query_features
from qkv.validation import check_positive_int, describe

__all__ = ["CHUNK_SIZE", "check_inputs", "describe_mask", "linear_attention", "normalise"]

CHUNK_SIZE = 64  # C: a chunk's (C, C) scores cost about what its (F, D_v) state does for F ~ 64


def linear_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    feature_map: FeatureMap,
    causal: bool = False,
    key_padding: torch.Tensor | None = None,
    chunk_size: int = CHUNK_SIZE,
) -> torch.Tensor:
    """Linear attention (Katharopoulos et al. 2020, s3.2-3.3), non-causal or causal.

    Args:
        q: (B, H, L_q, D). k: (B, H_kv, L_k, D). v: (B, H_kv, L_k, D_v). H % H_kv == 0: each
            group of H / H_kv query heads reads one K/V head (GQA), through views, no copy.
        feature_map: x (..., D) -> phi(x) (..., F), positive: `elu_feature_map`, a
            `FavorFeatureMap`, or any callable; one with `log_features` is stabilised.
        causal: query i sees keys j <= i + L_k - L_q (bottom-right, as `qkv.masks.causal`).
        key_padding: (B, L_k) bool, True on real keys (qkv's convention: True may be attended);
            the others contribute nothing.
        chunk_size: C, the chunk length of the causal form.

    Returns (B, H, L_q, D_v) in q's dtype; a query that sees no key gets 0, with finite gradients.
    """
    check_inputs(q, k, v, causal, key_padding, chunk_size)
    B, H_kv, L_k = k.shape[:3]
    dtype = torch.promote_types(q.dtype, torch.float32)
    phi_k, offset = key_features(feature_map, k.to(dtype), key_padding)  # (B, H_kv, L_k, F)
    phi_q = query_features(feature_map, q.to(dtype), offset, H_kv)  # (B, H_kv, G, L_q, F)
    ones = phi_k.new_ones(B, H_kv, L_k, 1)
    values = torch.cat([v.to(dtype), ones], dim=-1)  # (B, H_kv, L_k, D_v + 1): z beside S
    if causal:
        sums = _causal_sums(phi_q, phi_k, values, chunk_size)  # (B, H_kv, G, L_q, D_v + 1)
    else:
        state = phi_k.transpose(-1, -2) @ values  # (B, H_kv, F, D_v + 1): [S, z]
        sums = phi_q @ state.unsqueeze(2)  # (B, H_kv, G, L_q, D_v + 1)
    return normalise(sums).flatten(1, 2).to(q.dtype)  # (B, H, L_q, D_v)


def normalise(sums: torch.Tensor) -> torch.Tensor:
    """(..., D_v + 1) [numerator, denominator] -> numerator / denominator, and 0 for 0 / 0."""
    numerator, denominator = sums[..., :-1], sums[..., -1:]
    return numerator / torch.where(denominator == 0, 1.0, denominator)


def _causal_sums(
    phi_q: torch.Tensor, phi_k: torch.Tensor, values: torch.Tensor, chunk_size: int
) -> torch.Tensor:
    """sum over j <= i + L_k - L_q of (phi_q_i . phi_k_j) values_j: (B, H_kv, G, L_q, U)."""
    L_q, L_k = phi_q.shape[-2], phi_k.shape[-2]
    # Bottom-right alignment as plain causality over L = max(L_q, L_k): the shorter side gets
    # zero features in front, queries whose outputs are dropped or keys that add nothing.
    phi_q = F.pad(phi_q, (0, 0, max(L_k - L_q, 0), 0))  # (B, H_kv, G, L, F)
    phi_k = F.pad(phi_k, (0, 0, max(L_q - L_k, 0), 0))  # (B, H_kv, L, F)
    values = F.pad(values, (0, 0, max(L_q - L_k, 0), 0))  # (B, H_kv, L, U)
    sums = _CausalSums.apply(phi_q, phi_k, values, chunk_size)  # (B, H_kv, G, L, U)
    return sums[..., sums.shape[-2] - L_q :, :]


def _chunks(length: int, chunk_size: int) -> list[slice]:
    return [slice(start, min(start + chunk_size, length)) for start in range(0, length, chunk_size)]


class _CausalSums(torch.autograd.Function):
    """Y_i = sum_{j <= i} (phi_q_i . phi_k_j) u_j, chunk by chunk, forward and backward.

    phi_q (B, H_kv, G, L, F), phi_k (B, H_kv, L, F), u (B, H_kv, L, U) -> Y (B, H_kv, G, L, U).
    """

    @staticmethod
    def forward(ctx, phi_q, phi_k, u, chunk_size):
        ctx.save_for_backward(phi_q, phi_k, u)
        ctx.chunk_size = chunk_size
        out = phi_q.new_empty(*phi_q.shape[:-1], u.shape[-1])
        state = phi_k.new_zeros(*phi_k.shape[:-2], phi_k.shape[-1], u.shape[-1])  # (B, H_kv, F, U)
        for chunk in _chunks(phi_k.shape[-2], chunk_size):
            q_c, k_c, u_c = phi_q[..., chunk, :], phi_k[..., chunk, :], u[..., chunk, :]
            scores = torch.tril(q_c @ k_c.unsqueeze(2).transpose(-1, -2))  # (B, H_kv, G, C, C)
            out[..., chunk, :] = q_c @ state.unsqueeze(2) + scores @ u_c.unsqueeze(2)
            state = state + k_c.transpose(-1, -2) @ u_c
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        phi_q, phi_k, u = ctx.saved_tensors
        chunks = _chunks(phi_k.shape[-2], ctx.chunk_size)
        grad_q = _grad_queries(grad_out, phi_k, u, chunks) if ctx.needs_input_grad[0] else None
        grad_k = grad_u = None
        if ctx.needs_input_grad[1] or ctx.needs_input_grad[2]:
            grad_k, grad_u = _grad_keys_values(grad_out, phi_q, phi_k, u, chunks)
        return grad_q, grad_k, grad_u, None


def _grad_queries(grad_out, phi_k, u, chunks: list[slice]) -> torch.Tensor:
    """dphi_q_i = sum_{j <= i} (dY_i . u_j) phi_k_j, in forward order, the state recomputed."""
    grad_q = grad_out.new_empty(*grad_out.shape[:-1], phi_k.shape[-1])  # (B, H_kv, G, L, F)
    state = phi_k.new_zeros(*phi_k.shape[:-2], phi_k.shape[-1], u.shape[-1])  # (B, H_kv, F, U)
    for chunk in chunks:
        g_c, k_c, u_c = grad_out[..., chunk, :], phi_k[..., chunk, :], u[..., chunk, :]
        inner = torch.tril(g_c @ u_c.unsqueeze(2).transpose(-1, -2))  # (B, H_kv, G, C, C)
        earlier = g_c @ state.unsqueeze(2).transpose(-1, -2)  # (B, H_kv, G, C, F)
        grad_q[..., chunk, :] = earlier + inner @ k_c.unsqueeze(2)
        state = state + k_c.transpose(-1, -2) @ u_c
    return grad_q


def _grad_keys_values(grad_out, phi_q, phi_k, u, chunks: list[slice]):
    """dphi_k_j = sum_{i >= j} (dY_i . u_j) phi_q_i and du_j = sum_{i >= j} (phi_q_i . phi_k_j) dY_i
    over the G query heads too, in reverse order, carrying R = sum_{later i} phi_q_i dY_i^T."""
    grad_k, grad_u = torch.empty_like(phi_k), torch.empty_like(u)
    later = phi_k.new_zeros(*phi_k.shape[:-2], phi_k.shape[-1], u.shape[-1])  # R (B, H_kv, F, U)
    for chunk in reversed(chunks):
        q_c, g_c = phi_q[..., chunk, :], grad_out[..., chunk, :]  # (B, H_kv, G, C, F | U)
        k_c, u_c = phi_k[..., chunk, :], u[..., chunk, :]  # (B, H_kv, C, F | U)
        scores = torch.tril(q_c @ k_c.unsqueeze(2).transpose(-1, -2))  # (B, H_kv, G, C, C)
        inner = torch.tril(g_c @ u_c.unsqueeze(2).transpose(-1, -2))  # (B, H_kv, G, C, C)
        grad_k[..., chunk, :] = (inner.transpose(-1, -2) @ q_c).sum(2) + u_c @ later.transpose(
            -1, -2
        )
        grad_u[..., chunk, :] = (scores.transpose(-1, -2) @ g_c).sum(2) + k_c @ later
        later = later + (q_c.transpose(-1, -2) @ g_c).sum(2)
    return grad_k, grad_u


def check_inputs(q, k, v, causal, key_padding, chunk_size) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise TypeError(f"{name}: expected a floating-point tensor, got {describe(t)}")
        if t.dim() != 4:
            raise ValueError(f"{name}: expected shape (B, H, L, D), got {tuple(t.shape)}")
    if not q.dtype == k.dtype == v.dtype:
        raise TypeError(f"q, k, v: expected one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not q.device == k.device == v.device:
        raise ValueError(f"q, k, v: expected one device, got {q.device}, {k.device}, {v.device}")
    (B, H, _, D), (_, H_kv, L_k, _) = q.shape, k.shape
    if k.shape[0] != B or k.shape[-1] != D or v.shape[:3] != (B, H_kv, L_k):
        raise ValueError(
            f"k, v: expected k (B={B}, H_kv, L_k, D={D}) and v (B, H_kv, L_k, D_v), got "
            f"k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if H_kv == 0 or H % H_kv:
        raise ValueError(f"k: its {H_kv} key/value heads must divide the {H} query heads of q")
    if not isinstance(causal, bool):
        raise TypeError(f"causal: expected a bool, got {describe(causal)}")
    check_positive_int("chunk_size", chunk_size)
    if key_padding is not None and (
        not isinstance(key_padding, torch.Tensor)
        or key_padding.dtype != torch.bool
        or key_padding.shape != (B, L_k)
        or key_padding.device != k.device
    ):
        raise ValueError(
            f"key_padding: expected a bool tensor (B, L_k) = ({B}, {L_k}) on {k.device}, True on "
            f"real keys, got {describe_mask(key_padding)}"
        )


def describe_mask(mask: object) -> str:
    if isinstance(mask, torch.Tensor):
        return f"{describe(mask)}, dtype {mask.dtype}, on {mask.device}"
    return describe(mask)
