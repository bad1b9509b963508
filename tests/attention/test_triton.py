"""The Triton kernels against float64 eager attention: on a GPU when there is one, else in
Triton's interpreter on the CPU (tests/conftest.py sets TRITON_INTERPRET=1 before any import
of Triton); `auto` never picks the interpreter for CPU tensors.
"""

import os

import pytest
import torch
import torch.nn.functional as F

import qkv
from qkv.positional import alibi_slopes
from tests.attention.reference_math import eager_reference, sdpa_reference

DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"

CASES = {
    "plain": {},
    "causal": {"causal": True},
    "window": {"window": 9},
    "two_sided_window": {"window": (5, 3)},
    "sinks": {"window": 6, "sinks": 3},
    "causal_sinks": {"causal": True, "window": 8, "sinks": 2},
    "lengths": {"lengths": torch.tensor([37, 12])},
    "causal_lengths": {"causal": True, "lengths": torch.tensor([20, 37])},
}


def _inputs(B=2, H=4, H_kv=2, L_q=19, L_k=37, D=32, dtype=torch.float32):
    torch.manual_seed(0)
    return [
        torch.randn(B, heads, L, D, dtype=dtype, device=DEVICE, requires_grad=True)
        for heads, L in ((H, L_q), (H_kv, L_k), (H_kv, L_k))
    ]


def _compare(options, *, alibi=False, atol=2e-5, **shape):
    """fp32 kernels (exact products) against float64 eager attention: output, lse, grads."""
    q, k, v = _inputs(**shape)
    slopes = alibi_slopes(q.shape[1]) if alibi else None
    output, lse = qkv.triton_attention(q, k, v, **options, alibi_slopes=slopes, return_lse=True)
    exact_inputs = [t.detach().cpu().double().requires_grad_() for t in (q, k, v)]
    shift = k.shape[2] - q.shape[2]  # bottom-right alignment of query positions

    def alibi_mod(s, b, h, i, j):
        return s - slopes.double()[h] * (i + shift - j).abs()

    expected, expected_lse = eager_reference(
        *exact_inputs, **options, score_mod=alibi_mod if alibi else None
    )
    torch.testing.assert_close(output.cpu().double(), expected, atol=atol, rtol=atol)
    torch.testing.assert_close(lse.cpu().double(), expected_lse, atol=atol, rtol=atol)
    grad = torch.randn_like(expected)
    ours = torch.autograd.grad(output, (q, k, v), grad.float().to(DEVICE))
    theirs = torch.autograd.grad(expected, exact_inputs, grad)
    for got, want in zip(ours, theirs, strict=True):
        torch.testing.assert_close(got.cpu().double(), want, atol=10 * atol, rtol=10 * atol)


@pytest.mark.parametrize("case", list(CASES))
def test_forward_and_backward_match_float64(case):
    _compare(CASES[case])


def test_alibi_matches_float64():
    _compare({"causal": True}, alibi=True)


@pytest.mark.parametrize("head_dim", [32, 64, 20])
def test_head_dims_and_mqa(head_dim):
    _compare({"causal": True}, H=4, H_kv=1, L_q=21, L_k=21, D=head_dim)


def test_backend_triton_serves_qkv_attention_and_auto_skips_it_on_cpu():
    q, k, v = (t.detach() for t in _inputs())
    expected = F.scaled_dot_product_attention(
        q, k, v, attn_mask=qkv.masks.causal(19, 37, device=DEVICE), enable_gqa=True
    )
    output = qkv.attention(q, k, v, causal=True, backend="triton")
    torch.testing.assert_close(output, expected, atol=2e-5, rtol=2e-5)
    text = qkv.explain(q, k, v, causal=True, window=5)
    assert "passed over 'triton': CPU tensors" in text and not text.startswith("backend 'triton'")


def test_what_the_kernels_cannot_serve_is_refused_by_name():
    q, k, v = (t.detach() for t in _inputs())
    with pytest.raises(ValueError, match="backend: 'triton' cannot serve .* no dense mask"):
        qkv.attention(q, k, v, mask=qkv.masks.causal(19, 37, device=DEVICE), backend="triton")
    big = torch.randn(1, 1, 4, 256, device=DEVICE)
    with pytest.raises(ValueError, match="head dim 256 > 128"):
        qkv.triton_attention(big, big, big)
    with pytest.raises(ValueError, match=r"alibi_slopes: expected shape \(4,\)"):
        qkv.triton_attention(q, k, v, alibi_slopes=torch.ones(3))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_output_and_gradients_err_at_most_twice_what_sdpa_does(dtype):
    # The low-precision rule: compare with fp64 and allow twice the error PyTorch makes itself.
    options = {"causal": True, "window": 12}
    exact_inputs = [t.detach().double().requires_grad_() for t in _inputs(L_q=33, L_k=40)]
    grad = torch.randn(2, 4, 33, 32, dtype=torch.float64, device=DEVICE)
    exact = sdpa_reference(*exact_inputs, **options)
    exact_grads = torch.autograd.grad(exact, exact_inputs, grad)

    def errors(attention):
        low = [t.detach().to(dtype).requires_grad_() for t in exact_inputs]
        out = attention(*low, **options)
        grads = torch.autograd.grad(out, low, grad.to(dtype))
        return [(out.double() - exact).abs().max()] + [
            (g.double() - e).abs().max() for g, e in zip(grads, exact_grads, strict=True)
        ]

    for ours, pytorch in zip(errors(qkv.triton_attention), errors(sdpa_reference), strict=True):
        assert ours <= 2 * pytorch


@pytest.mark.parametrize(
    "options",
    [{}, {"causal": True}, {"causal": True, "lengths": torch.tensor([30, 37])}, {"window": 9}],
)
def test_sparse_pattern_blocks_equal_eager_attention_with_the_dense_mask(options):
    """Only the listed blocks are loaded; outputs, lse and gradients equal float64 eager
    attention with the pattern as a -inf bias (every row keeps its global key 0)."""
    from qkv.attention import sparse

    pattern = sparse.bigbird(window=3, global_tokens=1, random_blocks=1, block=16, seed=5)
    pattern = pattern | sparse.Strided(7)
    B = 2 if "lengths" in options else 1  # the pattern is every row's: a second row adds nothing
    q, k, v = _inputs(B=B, L_q=40, L_k=70)
    output, lse = qkv.triton_attention(q, k, v, pattern=pattern, return_lse=True, **options)
    hidden = ~qkv.masks.from_pattern(pattern, 40, 70)
    bias = torch.zeros(40, 70, dtype=torch.float64).masked_fill(hidden, float("-inf"))
    exact_inputs = [t.detach().cpu().double().requires_grad_() for t in (q, k, v)]
    expected, expected_lse = eager_reference(*exact_inputs, bias=bias, **options)
    torch.testing.assert_close(output.cpu().double(), expected, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(lse.cpu().double(), expected_lse, atol=2e-5, rtol=2e-5)
    grad = torch.randn_like(expected)
    ours = torch.autograd.grad(output, (q, k, v), grad.float().to(DEVICE))
    theirs = torch.autograd.grad(expected, exact_inputs, grad)
    for got, want in zip(ours, theirs, strict=True):
        torch.testing.assert_close(got.cpu().double(), want, atol=2e-4, rtol=2e-4)


def test_packed_sequences_equal_each_sequence_alone():
    from qkv.attention import sparse

    query_lengths, key_lengths = [7, 0, 21, 12], [20, 5, 21, 24]
    pattern = sparse.Packed.from_lengths(query_lengths, key_lengths, causal=True)
    q, k, v = _inputs(B=1, L_q=40, L_k=70)  # the packing is every row's: one row shows it
    output = qkv.triton_attention(q, k, v, pattern=pattern)
    grad = torch.randn_like(output)
    ours = torch.autograd.grad(output, (q, k, v), grad)
    exact = [t.detach().cpu().double().requires_grad_() for t in (q, k, v)]
    pieces = []
    for s in range(4):
        rows = slice(pattern.query_offsets[s], pattern.query_offsets[s + 1])
        keys = slice(pattern.key_offsets[s], pattern.key_offsets[s + 1])
        out, _ = eager_reference(exact[0][:, :, rows], exact[1][:, :, keys], exact[2][:, :, keys],
                                 causal=True)  # fmt: skip
        pieces.append(out)
    expected = torch.cat(pieces, dim=2)
    torch.testing.assert_close(output.cpu().double(), expected, atol=2e-5, rtol=2e-5)
    theirs = torch.autograd.grad(expected, exact, grad.cpu().double())
    for got, want in zip(ours, theirs, strict=True):
        torch.testing.assert_close(got.cpu().double(), want, atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize(
    "options",
    [{"causal": True}, {"causal": False}, {"causal": True, "window": (4, 0), "sinks": 1}],
)
def test_per_row_query_lengths_align_each_row_on_its_own(options):
    """query_lengths: row b's last real query sits on its last real key; padding queries get
    output 0; against float64 eager attention with the definition's (B, 1, L_q, L_k) mask."""
    from tests.attention.test_row_lengths import eager, row_mask

    q, k, v = _inputs(B=3, L_q=19, L_k=37)
    query_lengths, key_lengths = [19, 5, 0], [37, 12, 20]
    output = qkv.triton_attention(q, k, v, lengths=torch.tensor(key_lengths),
                                  query_lengths=torch.tensor(query_lengths), **options)  # fmt: skip
    exact = [t.detach().cpu().double().requires_grad_() for t in (q, k, v)]
    expected = eager(*exact, row_mask(query_lengths, key_lengths, 19, 37, **options))
    torch.testing.assert_close(output.cpu().double(), expected, atol=2e-5, rtol=2e-5)
    grad = torch.randn_like(expected)
    ours = torch.autograd.grad(output, (q, k, v), grad.float().to(DEVICE))
    theirs = torch.autograd.grad(expected, exact, grad)
    for got, want in zip(ours, theirs, strict=True):
        torch.testing.assert_close(got.cpu().double(), want, atol=2e-4, rtol=2e-4)
