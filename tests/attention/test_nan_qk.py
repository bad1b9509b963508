"""qkv's NaN rule for q and k on every backend: a NaN in a query row, or in a key that row may
see, makes the row NaN; a key the row cannot see is removed, NaN and all; a row that sees no
key is 0. PyTorch's fused CPU kernels (SDPA's flash kernel, FlexAttention's) return 0 where
every score of a row is NaN; `sdpa` and `flex` must not. The expected rows come from PyTorch's
plain softmax over the scores in float64, masked as the call masks them."""

from __future__ import annotations

import pytest
import torch

import qkv
from qkv import sparse

BACKENDS = ["reference", "sdpa", "tiled", "auto"]
NAN = float("nan")


def _qkv(L_q: int = 6, L_k: int = 6, heads: int = 4, kv_heads: int = 4, D: int = 8):
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(2, heads, L_q, D, generator=generator)
    k = torch.randn(2, kv_heads, L_k, D, generator=generator)
    v = torch.randn(2, kv_heads, L_k, D, generator=generator)
    return q, k, v


def _expected_nan_rows(q, k, v, visible) -> torch.Tensor:
    """Bool (B, H, L_q): the rows that softmax(q k^T / sqrt(D)) v, in float64 with the blocked
    scores set to -inf before the softmax (and empty rows set to 0), leaves NaN."""
    group = q.shape[1] // k.shape[1]
    k, v = (t.double().repeat_interleave(group, dim=1) for t in (k, v))
    scores = q.double() @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    scores = scores.masked_fill(~visible, float("-inf"))
    empty = ~visible.any(dim=-1, keepdim=True)
    weights = torch.softmax(scores.masked_fill(empty, 0.0), dim=-1).masked_fill(empty, 0.0)
    return torch.isnan(weights @ v.nan_to_num()).any(dim=-1)


def _causal(L_q: int, L_k: int) -> torch.Tensor:  # bottom-right aligned
    return torch.ones(L_q, L_k, dtype=torch.bool).tril(diagonal=L_k - L_q)


# (description, L_q, L_k, kv_heads, options, visible (L_q, L_k), where to put NaN)
CASES = [
    ("NaN query, no mask", 6, 6, 4, {}, None, ("q", 0, 1, 2)),
    ("NaN query, causal", 6, 6, 4, {"causal": True}, _causal(6, 6), ("q", 1, 3, 4)),
    ("NaN query, one query causal (decoding)", 1, 7, 4, {"causal": True}, None, ("q", 0, 2, 0)),
    ("NaN query, grouped heads", 6, 6, 2, {"causal": True}, _causal(6, 6), ("q", 0, 3, 2)),
    ("NaN key, causal: the rows from it on", 6, 6, 4, {"causal": True}, _causal(6, 6),
     ("k", 0, 1, 3)),
    ("NaN key, causal L_q < L_k", 3, 7, 4, {"causal": True}, _causal(3, 7), ("k", 1, 2, 5)),
    ("NaN key, grouped heads: its query heads", 6, 6, 2, {}, None, ("k", 0, 1, 4)),
    ("NaN key a window hides", 6, 6, 4, {"causal": True, "window": 2},
     _causal(6, 6) & ~_causal(6, 6).tril(-2), ("k", 0, 0, 1)),
    ("NaN key a bool mask hides", 6, 6, 4,
     {"mask": torch.arange(6).view(1, 6) != 2}, torch.arange(6).view(1, 6) != 2, ("k", 1, 1, 2)),
    ("every key NaN", 6, 6, 4, {}, None, ("k", 0, 0, None)),
    ("every key NaN, causal", 6, 6, 4, {"causal": True}, _causal(6, 6), ("k", 1, 3, None)),
]  # fmt: skip


# FlexAttention compiles a kernel per case (~10 s each here): the cases where its kernel
# returned 0 before, and one where a mask must hide the NaN.
FLEX_CASES = {"NaN query, causal", "every key NaN", "NaN key a window hides"}


def _backends_for(case: tuple) -> list:
    flex = ["flex"] if case[0] in FLEX_CASES else []
    return [pytest.param(backend, *case, id=f"{case[0]}-{backend}") for backend in BACKENDS + flex]


PARAMETERS = ("backend", "description", "L_q", "L_k", "kv_heads", "options", "visible", "nan")


@pytest.mark.parametrize(PARAMETERS, [param for case in CASES for param in _backends_for(case)])
def test_nan_in_q_or_k_reaches_exactly_the_rows_that_see_it(
    backend, description, L_q, L_k, kv_heads, options, visible, nan
):
    q, k, v = _qkv(L_q, L_k, kv_heads=kv_heads)
    which, batch, head, position = nan
    target = q if which == "q" else k
    if position is None:
        target[batch, head, :, 0] = NAN
    else:
        target[batch, head, position, 3] = NAN
    if visible is None:
        visible = torch.ones(L_q, L_k, dtype=torch.bool)
    output = qkv.attention(q, k, v, backend=backend, **options)  # (B, H, L_q, D)
    expected = _expected_nan_rows(q, k, v, visible)
    assert torch.equal(torch.isnan(output).any(dim=-1), expected)
    assert torch.equal(torch.isnan(output).all(dim=-1), expected)  # whole rows, nothing else


@pytest.mark.parametrize("backend", BACKENDS + ["flex"])
def test_a_nan_query_in_a_row_that_sees_nothing_stays_zero(backend):
    q, k, v = _qkv()
    q[0, 0, 2, 1] = NAN
    mask = torch.ones(6, 6, dtype=torch.bool)
    mask[2] = False
    output = qkv.attention(q, k, v, mask=mask, backend=backend)
    assert torch.equal(output[0, 0, 2], torch.zeros(8))
    assert not torch.isnan(output).any()


def test_packed_sequences_keep_a_nan_inside_its_own_sequence():
    """sdpa serves packed sequences as a padded batch: a NaN key poisons its own sequence's
    later rows and no other sequence's."""
    q, k, v = _qkv(L_q=9, L_k=9)
    k[0, 0, 4, 0] = NAN  # in the second sequence, (3, 6]
    pattern = sparse.Packed((0, 3, 6, 9))
    output = qkv.attention(q, k, v, backend="sdpa", causal=True, pattern=pattern)
    reference = qkv.attention(q, k, v, backend="reference", causal=True, pattern=pattern)
    assert torch.equal(torch.isnan(output), torch.isnan(reference))
    assert torch.isnan(output[0, 0, 4:6]).all() and not torch.isnan(output[0, 0, :4]).any()


MASKED_CASES = [case for case in CASES if case[5] is not None and "no mask" not in case[0]]


@pytest.mark.parametrize(PARAMETERS[1:], MASKED_CASES, ids=[case[0] for case in MASKED_CASES])
def test_sdpa_keeps_the_rule_where_it_cannot_ask_the_host(
    monkeypatch, description, L_q, L_k, kv_heads, options, visible, nan
):
    """An eager CPU call asks once whether any key is NaN and skips the rule's work when none
    is (`nan_rows.known_clean`); in a traced graph or on a GPU it does not ask, and must give
    the same rows, with and without the NaN."""
    from qkv.attention import sdpa

    q, k, v = _qkv(L_q, L_k, kv_heads=kv_heads)
    clean = qkv.attention(q, k, v, backend="sdpa", **options)
    which, batch, head, position = nan
    target = q if which == "q" else k
    target[batch, head, slice(None) if position is None else position, 3] = NAN
    asked = qkv.attention(q, k, v, backend="sdpa", **options)
    monkeypatch.setattr(sdpa, "known_clean", lambda nan_key: False)
    assert torch.equal(torch.isnan(qkv.attention(q, k, v, backend="sdpa", **options)),
                       torch.isnan(asked))  # fmt: skip
    q, k, v = _qkv(L_q, L_k, kv_heads=kv_heads)
    torch.testing.assert_close(qkv.attention(q, k, v, backend="sdpa", **options), clean,
                               rtol=0, atol=0)  # fmt: skip


def test_nan_keys_are_exactly_the_keys_holding_a_nan():
    """`nan_keys` reads each key's maximum: NaN for a NaN anywhere in it, in any dtype, and
    not for a key holding infinities (whose scores the rule leaves to the softmax)."""
    from qkv.attention.nan_rows import nan_keys

    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        k = torch.randn(1, 2, 5, 8).to(dtype)
        k[0, 0, 1, 7] = NAN
        k[0, 1, 3, 0] = NAN
        k[0, 1, 4, 2], k[0, 1, 4, 5] = float("inf"), float("-inf")
        k[0, 0, 2, 0] = float("-inf")
        assert torch.equal(nan_keys(k), torch.isnan(k).any(dim=-1))
