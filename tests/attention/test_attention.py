"""qkv.attention against F.scaled_dot_product_attention in float64, outputs and gradients."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import qkv
from qkv.attention import serving_backends
from tests.attention.reference_math import eager_reference, sdpa_reference

BACKENDS = ["reference", "sdpa", "tiled", "auto"]


@st.composite
def attention_calls(draw):
    """Random shapes, GQA ratios, masks (fully masked rows included), causal, windows, biases."""
    torch.manual_seed(draw(st.integers(0, 2**31 - 1)))
    B, H_kv, group = draw(st.integers(1, 2)), draw(st.integers(1, 3)), draw(st.integers(1, 3))
    H, L_q, L_k, D = (
        H_kv * group,
        draw(st.integers(1, 9)),
        draw(st.integers(1, 9)),
        draw(st.integers(1, 8)),
    )
    q = torch.randn(B, H, L_q, D, dtype=torch.float64)
    k = torch.randn(B, H_kv, L_k, D, dtype=torch.float64)
    v = torch.randn(B, H_kv, L_k, draw(st.integers(1, 8)), dtype=torch.float64)
    mask_shape = draw(
        st.sampled_from([(L_q, L_k), (B, 1, 1, L_k), (1, H, L_q, L_k), (B, H, L_q, L_k)])
    )
    mask = draw(st.sampled_from(["none", "bool", "additive"]))
    if mask == "bool":
        mask = torch.rand(mask_shape) > draw(st.sampled_from([0.0, 0.3, 0.7]))
    elif mask == "additive":
        mask = torch.randn(mask_shape, dtype=torch.float64).masked_fill(
            torch.rand(mask_shape) < 0.4, -torch.inf
        )
    else:
        mask = None
    bias = draw(st.sampled_from([None, (L_q, L_k), (1, H, L_q, L_k)]))
    bias = None if bias is None else torch.randn(bias, dtype=torch.float64)
    window = draw(st.sampled_from([None, 1, 3, (1, 0), (2, 1), (0, 4)]))
    return {
        "q": q,
        "k": k,
        "v": v,
        "mask": mask,
        "bias": bias,
        "window": window,
        "causal": draw(st.booleans()),
        "scale": draw(st.sampled_from([None, 0.3, 1.0])),
    }


@settings(max_examples=120, deadline=None)
@given(call=attention_calls(), backend=st.sampled_from(BACKENDS))
def test_output_and_gradients_match_sdpa_in_float64(call, backend):
    inputs = {name: call[name].clone().requires_grad_() for name in ("q", "k", "v")}
    options = {name: call[name] for name in ("mask", "bias", "window", "causal", "scale")}
    expected_inputs = {name: call[name].clone().requires_grad_() for name in ("q", "k", "v")}

    output = qkv.attention(**inputs, **options, backend=backend)
    expected = sdpa_reference(**expected_inputs, **options)
    torch.testing.assert_close(output, expected, atol=1e-10, rtol=1e-8)

    grad_output = torch.randn_like(output)
    output.backward(grad_output)
    expected.backward(grad_output)
    for name in ("q", "k", "v"):
        assert torch.isfinite(inputs[name].grad).all()
        torch.testing.assert_close(
            inputs[name].grad, expected_inputs[name].grad, atol=1e-9, rtol=1e-7
        )


@pytest.mark.parametrize("backend", ["reference", "sdpa", "tiled"])
def test_fully_masked_rows_give_zero_output_and_finite_gradients(backend):
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 6, 8, requires_grad=True) for _ in range(3))
    mask = qkv.masks.combine(qkv.masks.causal(6), qkv.masks.padding(torch.tensor([6, 0]), 6))
    output = qkv.attention(q, k, v, mask=mask, backend=backend)  # sample 1 sees no key at all
    assert torch.all(output[1] == 0)
    output.sum().backward()
    for tensor in (q, k, v):
        assert torch.isfinite(tensor.grad).all()
    assert torch.all(q.grad[1] == 0)  # nothing flows through a query that saw nothing
    # Causal with L_q > L_k: the first L_q - L_k queries precede every key.
    late = qkv.attention(q, k[:, :, :2], v[:, :, :2], causal=True, backend=backend)
    assert torch.all(late[:, :, :4] == 0) and late[:, :, 4:].abs().sum() > 0


@pytest.mark.parametrize("backend", ["reference", "sdpa", "tiled"])
def test_a_row_masked_only_by_an_additive_minus_inf_is_also_zero(backend):
    q, k, v = (torch.randn(1, 2, 3, 4) for _ in range(3))
    additive = torch.zeros(3, 3)
    additive[1] = -torch.inf
    output = qkv.attention(q, k, v, mask=additive, backend=backend)
    assert torch.all(output[:, :, 1] == 0) and torch.isfinite(output).all()


def test_empty_key_sequence_gives_zeros():
    q, k, v = torch.randn(1, 2, 3, 4), torch.randn(1, 2, 0, 4), torch.randn(1, 2, 0, 5)
    output, weights = qkv.attention(q, k, v, return_weights=True)
    assert output.shape == (1, 2, 3, 5) and torch.all(output == 0) and weights.shape == (1, 2, 3, 0)


def test_weights_are_the_softmax_sdpa_multiplies_v_by():
    torch.manual_seed(1)
    q, k, v = (torch.randn(2, 4, 5, 8, dtype=torch.float64) for _ in range(3))
    output, weights = qkv.attention(q, k, v, causal=True, return_weights=True)
    identity = torch.eye(5, dtype=torch.float64).expand(2, 4, 5, 5)
    # With V = I, SDPA's output *is* its weight matrix.
    expected = F.scaled_dot_product_attention(q, k, identity, is_causal=True)
    torch.testing.assert_close(weights, expected)
    torch.testing.assert_close(weights.sum(-1), torch.ones(2, 4, 5, dtype=torch.float64))
    torch.testing.assert_close(output, weights @ v)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("backend", ["reference", "sdpa", "tiled"])
def test_low_precision_error_is_at_most_twice_pytorchs(dtype, backend):
    # The low-precision rule: compare with fp64 and allow twice the error PyTorch makes itself.
    torch.manual_seed(2)
    q, k, v = (torch.randn(2, 4, 33, 16, dtype=torch.float64) for _ in range(3))
    mask = qkv.masks.combine(qkv.masks.causal(33), qkv.masks.padding(torch.tensor([33, 20]), 33))
    exact = sdpa_reference(q, k, v, mask=mask)
    low = [t.to(dtype) for t in (q, k, v)]
    pytorch_error = (sdpa_reference(*low, mask=mask).double() - exact).abs().max()
    our_error = (qkv.attention(*low, mask=mask, backend=backend).double() - exact).abs().max()
    assert our_error <= 2 * pytorch_error


def test_reference_backend_survives_fp16_scores_that_overflow():
    # q.k = 64 * 300^2 = 5.8e6 overflows fp16 (max 65504); softmax statistics in fp32 do not.
    q = torch.full((1, 1, 2, 64), 300.0)
    k = torch.full((1, 1, 3, 64), 300.0)
    v = torch.randn(1, 1, 3, 8)
    exact = F.scaled_dot_product_attention(q.double(), k.double(), v.double())
    output = qkv.attention(q.half(), k.half(), v.half(), backend="reference")
    assert torch.isfinite(output).all()
    torch.testing.assert_close(output.double(), exact, atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("backend", ["reference", "sdpa", "tiled"])
def test_gradcheck_float64(backend):
    torch.manual_seed(3)
    q = torch.randn(1, 4, 5, 3, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 2, 6, 3, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 2, 6, 2, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(1, 4, 5, 6, dtype=torch.float64, requires_grad=True)
    mask = torch.rand(1, 1, 5, 6) > 0.4
    mask[..., 0, :] = False  # one fully masked row

    def run(q, k, v, bias):
        return qkv.attention(q, k, v, mask=mask, bias=bias, window=(3, 1), backend=backend)

    assert torch.autograd.gradcheck(run, (q, k, v, bias))


def test_auto_serves_weights_from_reference_and_everything_else_from_sdpa():
    q, k, v = (torch.randn(1, 2, 4, 8) for _ in range(3))
    assert qkv.explain(q, k, v).startswith("backend 'sdpa'")
    text = qkv.explain(q, k, v, return_weights=True)
    assert text.startswith("backend 'reference'")
    assert "passed over 'sdpa': the fused kernel does not return the attention weights" in text
    gqa = qkv.explain(q, k[:, :1], v[:, :1], causal=True)
    assert "enable_gqa=True" in gqa and "is_causal=True" in gqa
    assert "bottom-right" in qkv.explain(q, k[:, :, :3], v[:, :, :3], causal=True)


def test_one_causal_query_sees_every_key_without_a_mask():
    # A decoding step: bottom-right alignment makes the single query the newest position.
    q, k, v = torch.randn(2, 4, 1, 8), torch.randn(2, 2, 9, 8), torch.randn(2, 2, 9, 8)
    expected = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)  # every key visible
    torch.testing.assert_close(qkv.attention(q, k, v, causal=True), expected)
    assert "one query (a decoding step): it sees every key, no mask" in qkv.explain(
        q, k, v, causal=True
    )


@st.composite
def pattern_calls(draw):
    """Calls with sinks, ALiBi, a soft-cap or a score_mod (float64, any shape)."""
    torch.manual_seed(draw(st.integers(0, 2**31 - 1)))
    B, H_kv, group = draw(st.integers(1, 2)), draw(st.integers(1, 2)), draw(st.integers(1, 2))
    H, L_q, L_k = H_kv * group, draw(st.integers(1, 9)), draw(st.integers(1, 9))
    q = torch.randn(B, H, L_q, 4, dtype=torch.float64)
    k, v = (torch.randn(B, H_kv, L_k, 4, dtype=torch.float64) for _ in range(2))
    window = draw(st.sampled_from([None, 2, (1, 2)]))
    options = {
        "causal": draw(st.booleans()),
        "window": window,
        "sinks": draw(st.sampled_from([0, 1, 3])) if window is not None else 0,
        "softcap": draw(st.sampled_from([None, 1.5])),
        "score_mod": draw(st.sampled_from([None, lambda s, b, h, i, j: s * (1 + 0.1 * h)])),
    }
    slopes = draw(st.sampled_from([None, torch.rand(H, dtype=torch.float64)]))
    return (q, k, v), options, slopes


@settings(max_examples=60, deadline=None)
@given(call=pattern_calls(), backend=st.sampled_from(["reference", "sdpa", "tiled", "auto"]))
def test_sinks_alibi_softcap_and_score_mod_match_eager_math_in_float64(call, backend):
    (q, k, v), options, slopes = call
    if backend not in ("auto", *serving_backends(q, k, v, **options, alibi_slopes=slopes)):
        with pytest.raises(ValueError, match="cannot soft-cap or score_mod"):  # sdpa, named
            qkv.attention(q, k, v, **options, alibi_slopes=slopes, backend=backend)
        return
    ours = [t.clone().requires_grad_() for t in (q, k, v)]
    theirs = [t.clone().requires_grad_() for t in (q, k, v)]
    output = qkv.attention(*ours, **options, alibi_slopes=slopes, backend=backend)
    L_q, L_k = q.shape[2], k.shape[2]
    distance = (torch.arange(L_q).view(-1, 1) + L_k - L_q - torch.arange(L_k)).abs()
    alibi = None if slopes is None else -slopes.view(1, -1, 1, 1) * distance
    expected, _ = eager_reference(*theirs, **options, bias=alibi)
    torch.testing.assert_close(output, expected, atol=1e-10, rtol=1e-8)
    grad_output = torch.randn_like(output)
    output.backward(grad_output)
    expected.backward(grad_output)
    for ours_t, theirs_t in zip(ours, theirs, strict=True):
        torch.testing.assert_close(ours_t.grad, theirs_t.grad, atol=1e-9, rtol=1e-7)
