"""Sanity checks of an attention implementation, (a) to (i) and more, each against PyTorch.

Every check measures something (a difference to PyTorch, a leaked weight, a deviation from a
formula) and compares it with a tolerance, so the table `qkv check` prints shows numbers, not
only ticks. Checks are plain functions registered with `@check`; `run_checks` runs them all.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from qkv import masks
from qkv.attention import attention, explain
from qkv.attention.core import serving_backends
from qkv.layers import EncoderBlock, MultiHeadAttention
from qkv.positional import (
    alibi_slopes,
    apply_rope,
    interleaved_to_half_split,
    rope_cos_sin,
    sinusoidal_table,
)


@dataclass(frozen=True)
class CheckResult:
    """One row of the table: what was checked, what was measured, and whether it passed."""

    label: str
    description: str
    measured: str
    passed: bool


_CHECKS: list[tuple[str, str, Callable[[], tuple[str, bool]]]] = []


def check(label: str, description: str):
    """Register a check: a function returning (what was measured, passed)."""

    def register(function: Callable[[], tuple[str, bool]]):
        _CHECKS.append((label, description, function))
        return function

    return register


def run_checks(seed: int = 0) -> list[CheckResult]:
    """Run every registered check with a fixed seed; an exception counts as a failure."""
    results = []
    for label, description, function in _CHECKS:
        torch.manual_seed(seed)
        try:
            measured, passed = function()
        except Exception as error:  # a crash is a failed check, reported in the table
            measured, passed = f"raised {type(error).__name__}: {error}", False
        results.append(CheckResult(label, description, measured, passed))
    return results


def _max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


def _within(value: float, tolerance: float, name: str) -> tuple[str, bool]:
    return f"{name}={value:.2e} (tol {tolerance:.0e})", value <= tolerance


# Small shapes: B=2, L=5, E=16, H=4; cross-attention with L_q=7 over L_k=5.
B, L, E, H = 2, 5, 16, 4


@check("(a)", "self-attention: shapes, weight rows sum to 1")
def _self_attention() -> tuple[str, bool]:
    mha = MultiHeadAttention(E, H).eval()
    out, weights = mha(torch.randn(B, L, E), return_weights=True)
    deviation = (weights.sum(-1) - 1).abs().max().item()
    shapes_ok = out.shape == (B, L, E) and weights.shape == (B, H, L, L)
    measured, ok = _within(deviation, 1e-6, "|row sum - 1|")
    return f"out {tuple(out.shape)} weights {tuple(weights.shape)} {measured}", ok and shapes_ok


@check("(b)", "causal mask: weights above the diagonal are 0")
def _causal() -> tuple[str, bool]:
    mha = MultiHeadAttention(E, H).eval()
    _, weights = mha(torch.randn(B, L, E), causal=True, return_weights=True)
    return _within(weights.triu(diagonal=1).abs().max().item(), 0.0, "max future weight")


@check("(c)", "padding mask: padded key columns get weight 0")
def _padding() -> tuple[str, bool]:
    mha = MultiHeadAttention(E, H).eval()
    lengths = torch.tensor([L, 3])
    mask = masks.padding(lengths, L)
    _, weights = mha(torch.randn(B, L, E), mask=mask, return_weights=True)
    return _within(weights[1, :, :, 3:].abs().max().item(), 0.0, "max weight on padding")


@check("(d)", "cross-attention: L_q=7 queries over L_k=5 keys")
def _cross_attention() -> tuple[str, bool]:
    mha = MultiHeadAttention(E, H).eval()
    out, weights = mha(torch.randn(B, 7, E), torch.randn(B, L, E), return_weights=True)
    ok = out.shape == (B, 7, E) and weights.shape == (B, H, 7, L)
    return f"out {tuple(out.shape)} weights {tuple(weights.shape)}", ok


@check("(e)", "causal self-attention and padded cross-attention agree with SDPA")
def _self_and_cross_vs_sdpa() -> tuple[str, bool]:
    mha = MultiHeadAttention(E, H).eval()
    x, context = torch.randn(B, 7, E), torch.randn(B, L, E)
    context_mask = masks.padding(torch.tensor([L, 2]), L)
    worst = 0.0
    for inputs, options, sdpa_mask in [
        ((x, None), {"causal": True}, masks.causal(7)),
        ((x, context), {"mask": context_mask}, context_mask),
    ]:
        ours = mha(*inputs, **options)
        source = x if inputs[1] is None else context
        q = mha.q_proj(x).view(B, 7, H, E // H).transpose(1, 2)  # (B, H, L_q, D)
        k = mha.k_proj(source).view(B, -1, H, E // H).transpose(1, 2)  # (B, H, L_k, D)
        v = mha.v_proj(source).view(B, -1, H, E // H).transpose(1, 2)  # (B, H, L_k, D)
        heads = F.scaled_dot_product_attention(q, k, v, attn_mask=sdpa_mask)
        theirs = mha.out_proj(heads.transpose(1, 2).reshape(B, 7, E))
        worst = max(worst, _max_abs(ours, theirs))
    return _within(worst, 1e-5, "|delta out|")


@check("(f)", "MultiHeadAttention.from_torch(nn.MultiheadAttention): same output and weights")
def _vs_torch_mha() -> tuple[str, bool]:
    torch_mha = torch.nn.MultiheadAttention(E, H, batch_first=True).eval()
    ours = MultiHeadAttention.from_torch(torch_mha).eval()
    x = torch.randn(B, L, E)
    mask = masks.combine(masks.causal(L), masks.padding(torch.tensor([L, 3]), L))
    expected, expected_weights = torch_mha(
        x,
        x,
        x,
        attn_mask=masks.to_torch_attn_mask(mask.expand(B, H, L, L)),
        average_attn_weights=False,
    )
    out, weights = ours(x, mask=mask, return_weights=True)
    delta_out, delta_weights = _max_abs(out, expected), _max_abs(weights, expected_weights)
    ok = delta_out <= 1e-6 and delta_weights <= 1e-6
    return f"|delta out|={delta_out:.2e} |delta weights|={delta_weights:.2e} (tol 1e-06)", ok


@check("(g)", "fully masked row: no NaN, output 0, finite gradients")
def _fully_masked_row() -> tuple[str, bool]:
    worst, finite = 0.0, True
    for backend in ("reference", "sdpa"):
        q, k, v = (torch.randn(B, H, L, E // H, requires_grad=True) for _ in range(3))
        mask = torch.ones(L, L, dtype=torch.bool)
        mask[2] = False
        out = attention(q, k, v, mask=mask, backend=backend)
        out.sum().backward()
        worst = max(worst, out[:, :, 2].abs().max().item())
        finite &= all(torch.isfinite(t.grad).all().item() for t in (q, k, v))
        finite &= bool(torch.isfinite(out).all())
    measured, ok = _within(worst, 0.0, "|out| on the row")
    return f"{measured}, finite={finite} (reference, sdpa)", ok and finite


@check("(h)", "embed_dim not divisible by num_heads -> ValueError")
def _bad_heads() -> tuple[str, bool]:
    try:
        MultiHeadAttention(10, 3)
    except ValueError as error:
        return f"ValueError: {error}", "embed_dim" in str(error)
    return "no error raised", False


@check("(i)", "return_weights=False -> no weights computed or returned")
def _no_weights() -> tuple[str, bool]:
    out = MultiHeadAttention(E, H).eval()(torch.randn(B, L, E))
    explained = explain(*(torch.randn(B, H, L, E // H) for _ in range(3)))
    return f"returned {type(out).__name__}, auto picks sdpa", isinstance(
        out, torch.Tensor
    ) and explained.startswith("backend 'sdpa'")


@check("(j)", "qkv.attention vs F.scaled_dot_product_attention, float64, every backend")
def _vs_sdpa() -> tuple[str, bool]:
    q, k, v = (torch.randn(B, H, 9, 8, dtype=torch.float64) for _ in range(3))
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return _within(_worst_causal_backend(q, k, v, expected), 1e-12, "|delta out|")


@check("(k)", "causal with L_q != L_k is bottom-right, like torch's causal_lower_right")
def _bottom_right() -> tuple[str, bool]:
    from torch.nn.attention.bias import causal_lower_right

    q = torch.randn(B, H, 3, 8, dtype=torch.float64)
    k, v = (torch.randn(B, H, 7, 8, dtype=torch.float64) for _ in range(2))
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(3, 7))
    mask_equal = torch.equal(masks.causal(3, 7), causal_lower_right(3, 7)._materialize())
    measured, ok = _within(_max_abs(attention(q, k, v, causal=True), expected), 1e-12, "|d|")
    return f"{measured}, masks equal={mask_equal}", ok and mask_equal


@check("(l)", "GQA (8 query heads, 2 K/V heads) vs SDPA enable_gqa")
def _gqa() -> tuple[str, bool]:
    q = torch.randn(B, 8, 6, 8, dtype=torch.float64)
    k, v = (torch.randn(B, 2, 6, 8, dtype=torch.float64) for _ in range(2))
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    return _within(_worst_causal_backend(q, k, v, expected), 1e-12, "|delta out|")


def _worst_causal_backend(q, k, v, expected: torch.Tensor) -> float:
    """The largest |causal attention - expected| over every backend that serves the call."""
    return max(
        _max_abs(attention(q, k, v, causal=True, backend=name), expected)
        for name in serving_backends(q, k, v, causal=True)
    )


@check("(m)", "ALiBi slopes for 8 heads are 1/2 ... 1/256")
def _alibi() -> tuple[str, bool]:
    expected = torch.tensor([2.0**-i for i in range(1, 9)])
    return _within(_max_abs(alibi_slopes(8), expected), 0.0, "|delta slope|")


@check("(n)", "RoPE: q.k after rotation depends only on m - n")
def _rope_relative() -> tuple[str, bool]:
    q, k = (
        torch.randn(1, 1, 1, 16, dtype=torch.float64),
        torch.randn(1, 1, 1, 16, dtype=torch.float64),
    )

    def score(m: int, n: int) -> float:
        cos_m, sin_m = rope_cos_sin(torch.tensor([m]), 16, dtype=torch.float64)
        cos_n, sin_n = rope_cos_sin(torch.tensor([n]), 16, dtype=torch.float64)
        return (apply_rope(q, cos_m, sin_m) * apply_rope(k, cos_n, sin_n)).sum().item()

    drift = max(abs(score(m, m - 3) - score(3, 0)) for m in (5, 17, 100, 1000))
    return _within(drift, 1e-9, "max drift at m-n=3")


@check("(o)", "RoPE layouts: interleaved (Meta) == half-split (HF) after permuting weights")
def _rope_layouts() -> tuple[str, bool]:
    heads, head_dim, length = 2, 8, 6
    weight = torch.randn(heads * head_dim, E, dtype=torch.float64)
    x = torch.randn(1, length, E, dtype=torch.float64)
    positions = torch.arange(length)
    scores = []
    for layout, w in (("interleaved", weight), ("half", interleaved_to_half_split(weight, heads))):
        cos, sin = rope_cos_sin(positions, head_dim, layout=layout, dtype=torch.float64)
        projected = (x @ w.T).view(1, length, heads, head_dim).transpose(1, 2)  # (1, H, L, D)
        rotated = apply_rope(projected, cos, sin, layout=layout)
        scores.append(rotated @ rotated.transpose(-1, -2))
    return _within(_max_abs(*scores), 1e-10, "|delta scores|")


@check("(p)", "sinusoidal: PE(pos + k) is a fixed rotation of PE(pos)")
def _sinusoidal_rotation() -> tuple[str, bool]:
    dim, shift = 16, 7
    table = sinusoidal_table(64 + shift, dim, dtype=torch.float64)
    frequencies = 10000.0 ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    cos, sin = torch.cos(shift * frequencies), torch.sin(shift * frequencies)
    rotation = torch.zeros(dim, dim, dtype=torch.float64)
    for i in range(dim // 2):  # row vector (sin, cos) @ R turns by the angle shift * frequency_i
        rotation[2 * i : 2 * i + 2, 2 * i : 2 * i + 2] = torch.stack(
            [torch.stack([cos[i], -sin[i]]), torch.stack([sin[i], cos[i]])]
        )
    return _within(_max_abs(table[:64] @ rotation, table[shift:]), 1e-9, "|R_k PE(p) - PE(p+k)|")


@check("(q)", "fp16 scores that overflow 65504 stay finite (fp32 softmax statistics)")
def _fp16_overflow() -> tuple[str, bool]:
    q, k = torch.full((1, 1, 2, 64), 300.0), torch.full((1, 1, 3, 64), 300.0)
    v = torch.randn(1, 1, 3, 8)
    naive = torch.softmax((q.half() @ k.half().transpose(-1, -2)) / 8, dim=-1)
    ours = attention(q.half(), k.half(), v.half(), backend="reference")
    exact = F.scaled_dot_product_attention(q.double(), k.double(), v.double())
    delta = _max_abs(ours, exact)
    naive_nan = bool(torch.isnan(naive).any())
    return f"naive fp16 NaN={naive_nan}, qkv |delta|={delta:.1e} (tol 2e-03)", delta <= 2e-3


@check("(r)", "EncoderBlock.from_torch(nn.TransformerEncoderLayer), post- and pre-norm")
def _encoder_block() -> tuple[str, bool]:
    worst = 0.0
    for norm_first in (False, True):
        layer = torch.nn.TransformerEncoderLayer(
            E, H, 32, dropout=0.0, batch_first=True, norm_first=norm_first
        ).eval()
        block = EncoderBlock.from_torch(layer).eval()
        x = torch.randn(B, L, E)
        padding = masks.padding(torch.tensor([L, 3]), L)
        expected = layer(x, src_key_padding_mask=masks.to_torch_key_padding_mask(padding))
        ours = block(x, mask=padding)
        worst = max(worst, _max_abs(ours[0], expected[0]), _max_abs(ours[1, :3], expected[1, :3]))
    return _within(worst, 1e-5, "|delta out|")


@check("(s)", "scale: Var(q.k) = d_k for unit-variance inputs, 1 after dividing by sqrt(d_k)")
def _scaling() -> tuple[str, bool]:
    d_k = 64
    q, k = (
        torch.randn(20000, d_k, dtype=torch.float64),
        torch.randn(20000, d_k, dtype=torch.float64),
    )
    dots = (q * k).sum(-1)
    raw, scaled = dots.var().item(), (dots / math.sqrt(d_k)).var().item()
    ok = abs(raw / d_k - 1) < 0.05 and abs(scaled - 1) < 0.05
    return f"Var(q.k)={raw:.1f} (d_k={d_k}), scaled={scaled:.3f}", ok
