"""Linear attention (qkv.attention.linear) against references written outside it: the O(L^2)
formula in float64 below (feature maps applied, then visible products normalised per query),
autograd through that formula, PyTorch's exact softmax attention for FAVOR+'s approximation, and
softmax's kernel exp(q^T k / sqrt(D)) for FAVOR+'s estimate."""

import math

import pytest
import torch
import torch.nn.functional as F

import qkv
from qkv.analysis.cost.memory import peak_bytes
from qkv.attention import (
    FavorFeatureMap,
    LinearAttention,
    LinearAttentionState,
    elu_feature_map,
    linear_attention,
    linear_attention_state,
    linear_attention_step,
    orthogonal_random_features,
)
from qkv.layers import MultiHeadAttention
from qkv.masks import padding
from tests.layers.helpers import randomize_

f64 = torch.float64


def elu_plus_one(x):
    """Katharopoulos et al. 2020, s3.2.1."""
    return F.elu(x) + 1.0


def lemma1_features(x, projection):
    """Choromanski et al. 2021, Lemma 1: exp(w^T x' - |x'|^2 / 2) / sqrt(m), x' = x d^(-1/4)."""
    m, d = projection.shape
    x = x / d**0.25
    return torch.exp(x @ projection.T - (x * x).sum(-1, keepdim=True) / 2) / math.sqrt(m)


def eager_linear_attention(phi_q, phi_k, v, *, causal=False, key_padding=None):
    """The quadratic form: weights phi(q_i).phi(k_j) on the visible keys, divided by their sum
    (a query that sees no key: 0). GQA by repeating K/V, causal aligned bottom-right."""
    B, H, L_q, _ = phi_q.shape
    H_kv, L_k = phi_k.shape[1], phi_k.shape[2]
    phi_k = phi_k.repeat_interleave(H // H_kv, dim=1)
    v = v.repeat_interleave(H // H_kv, dim=1)
    weights = torch.einsum("bhif,bhjf->bhij", phi_q, phi_k)
    i = torch.arange(L_q)[:, None] + (L_k - L_q)
    j = torch.arange(L_k)[None, :]
    visible = (j <= i) if causal else torch.ones(L_q, L_k, dtype=torch.bool)
    visible = visible.expand(B, 1, L_q, L_k)
    if key_padding is not None:
        visible = visible & key_padding[:, None, None, :]
    weights = weights * visible
    total = weights.sum(-1, keepdim=True)
    return torch.einsum("bhij,bhjd->bhid", weights, v) / torch.where(total == 0, 1.0, total)


def projection(num_features, head_dim, seed, dtype=f64):
    generator = torch.Generator().manual_seed(seed)
    return orthogonal_random_features(num_features, head_dim, generator=generator, dtype=dtype)


def maps(kind, head_dim=5):
    """(qkv's feature map, the test's own) for one kind."""
    if kind == "elu":
        return elu_feature_map, elu_plus_one
    W = projection(12, head_dim, seed=3)
    return FavorFeatureMap(W), lambda x: lemma1_features(x, W)


def inputs(B=2, H=4, H_kv=2, L_q=7, L_k=7, D=5, D_v=3, dtype=f64, seed=0, scale=1.0):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, L_q, D, generator=generator, dtype=dtype) * scale
    k = torch.randn(B, H_kv, L_k, D, generator=generator, dtype=dtype) * scale
    v = torch.randn(B, H_kv, L_k, D_v, generator=generator, dtype=dtype)
    return q, k, v


@pytest.mark.parametrize("kind", ["elu", "favor"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(("L_q", "L_k"), [(7, 7), (5, 12), (12, 5), (1, 9), (4, 0)])
@pytest.mark.parametrize("padded", [False, True])
def test_matches_the_quadratic_formula(kind, causal, L_q, L_k, padded):
    q, k, v = inputs(L_q=L_q, L_k=L_k)
    ours, theirs = maps(kind)
    key_padding = padding(torch.tensor([max(L_k - 3, 0), 0]), L_k)[:, 0, 0] if padded else None
    output = linear_attention(
        q, k, v, feature_map=ours, causal=causal, key_padding=key_padding, chunk_size=3
    )
    expected = eager_linear_attention(
        theirs(q), theirs(k), v, causal=causal, key_padding=key_padding
    )
    torch.testing.assert_close(output, expected, atol=1e-12, rtol=1e-10)
    if padded:  # the second sequence has no real key: output 0
        assert output[1].abs().max() == 0


def test_stabilised_favor_stays_exact_where_lemma1_features_underflow():
    """Large inputs: fp32 Lemma 1 features underflow to 0 for every feature of some rows; the
    stabilised fp32 output still equals the float64 formula."""
    q, k, v = inputs(B=1, L_q=16, L_k=16, D=16, dtype=torch.float32, scale=10.0)
    W = projection(32, 16, seed=0, dtype=torch.float32)
    assert (lemma1_features(q, W) == 0).all(dim=-1).any()
    output = linear_attention(q, k, v, feature_map=FavorFeatureMap(W))
    W64 = W.to(f64)
    expected = eager_linear_attention(
        lemma1_features(q.to(f64), W64), lemma1_features(k.to(f64), W64), v.to(f64)
    )
    assert output.dtype == torch.float32 and output.isfinite().all()
    torch.testing.assert_close(output.to(f64), expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kind", ["elu", "favor"])
def test_recurrent_steps_equal_the_causal_parallel_form(kind):
    q, k, v = inputs(L_q=11, L_k=11)
    ours, _ = maps(kind)
    parallel = linear_attention(q, k, v, feature_map=ours, causal=True, chunk_size=4)
    state, steps = None, []
    for t in range(11):
        one = slice(t, t + 1)
        output, state = linear_attention_step(
            state, q[:, :, one], k[:, :, one], v[:, :, one], feature_map=ours
        )
        steps.append(output)
    torch.testing.assert_close(torch.cat(steps, dim=2), parallel, atol=1e-12, rtol=1e-10)
    assert isinstance(state, LinearAttentionState)
    assert state.key_value_sum.shape == (2, 2, q.shape[-1] if kind == "elu" else 12, 3)

    # a prompt read at once, then decoding
    state = linear_attention_state(k[:, :, :6], v[:, :, :6], feature_map=ours)
    for t in range(6, 11):
        one = slice(t, t + 1)
        output, state = linear_attention_step(
            state, q[:, :, one], k[:, :, one], v[:, :, one], feature_map=ours
        )
        torch.testing.assert_close(output, parallel[:, :, one], atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("kind", ["elu", "favor"])
@pytest.mark.parametrize(("causal", "L_q", "L_k"), [(False, 4, 6), (True, 7, 7), (True, 5, 7)])
def test_gradcheck(kind, causal, L_q, L_k):
    q, k, v = (t.requires_grad_() for t in inputs(B=1, H=2, H_kv=1, L_q=L_q, L_k=L_k, D=3))
    ours, _ = maps(kind, head_dim=3)
    key_padding = torch.ones(1, L_k, dtype=torch.bool)
    key_padding[0, 1] = False

    def attend(q, k, v):
        return linear_attention(
            q, k, v, feature_map=ours, causal=causal, key_padding=key_padding, chunk_size=3
        )

    assert torch.autograd.gradcheck(attend, (q, k, v))


@pytest.mark.parametrize("kind", ["elu", "favor"])
@pytest.mark.parametrize("causal", [False, True])
def test_gradients_equal_autograd_through_the_quadratic_formula(kind, causal):
    ours, theirs = maps(kind)
    q, k, v = inputs(L_q=37, L_k=37, seed=1)
    key_padding = padding(torch.tensor([37, 30]), 37)[:, 0, 0]
    grad = torch.randn(2, 4, 37, 3, dtype=f64)
    mine = [t.clone().requires_grad_() for t in (q, k, v)]
    reference = [t.clone().requires_grad_() for t in (q, k, v)]
    output = linear_attention(
        *mine, feature_map=ours, causal=causal, key_padding=key_padding, chunk_size=8
    )
    phi_q, phi_k = theirs(reference[0]), theirs(reference[1])
    expected = eager_linear_attention(
        phi_q, phi_k, reference[2], causal=causal, key_padding=key_padding
    )
    output.backward(grad)
    expected.backward(grad)
    for ours_leaf, reference_leaf in zip(mine, reference, strict=True):
        torch.testing.assert_close(ours_leaf.grad, reference_leaf.grad, atol=1e-10, rtol=1e-8)


def test_random_features_are_orthogonal_within_blocks():
    W = projection(20, 8, seed=0)
    for block in (W[:8], W[8:16], W[16:]):
        gram = block @ block.T
        off_diagonal = gram - torch.diag(torch.diagonal(gram))
        assert off_diagonal.abs().max() < 1e-10
    assert W.shape == (20, 8)
    assert torch.equal(W, projection(20, 8, seed=0))


def test_favor_kernel_estimate_is_unbiased():
    """Over independent projections, the mean of phi(q)^T phi(k) is exp(q^T k / sqrt(D)) within
    four standard errors, for each of several (q, k) pairs (Lemma 1 with orthogonal rows)."""
    D, draws = 8, 400
    generator = torch.Generator().manual_seed(11)
    q = torch.randn(5, D, generator=generator, dtype=f64) * 0.5
    k = torch.randn(5, D, generator=generator, dtype=f64) * 0.5
    exact = torch.exp((q * k).sum(-1) / math.sqrt(D))
    estimates = torch.stack(
        [
            (FavorFeatureMap(W)(q) * FavorFeatureMap(W)(k)).sum(-1)
            for W in (projection(16, D, seed=s) for s in range(draws))
        ]
    )  # (draws, 5)
    standard_error = estimates.std(dim=0) / math.sqrt(draws)
    assert ((estimates.mean(dim=0) - exact).abs() < 4 * standard_error).all()
    assert (standard_error < 0.05 * exact).all()  # the test can tell a biased estimate apart


@pytest.mark.parametrize("causal", [False, True])
def test_favor_error_to_softmax_attention_falls_as_features_grow(causal):
    q, k, v = inputs(B=1, H=2, H_kv=2, L_q=64, L_k=64, D=16, D_v=8, seed=5, scale=0.4)
    exact = F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    def mean_error(num_features):
        errors = [
            (
                linear_attention(
                    q,
                    k,
                    v,
                    feature_map=FavorFeatureMap(projection(num_features, 16, seed)),
                    causal=causal,
                )
                - exact
            ).norm()
            / exact.norm()
            for seed in range(8)
        ]
        return torch.stack(errors).mean().item()

    errors = [mean_error(m) for m in (16, 64, 256, 1024)]
    assert errors == sorted(errors, reverse=True), errors
    assert errors[-1] < errors[0] / 4, errors  # about 1 / sqrt(m): 8x from 16 to 1024


def test_causal_forward_backward_memory_is_linear_in_length():
    """Saved for backward, and the peak, stay a few (L, D) tensors: far below the (L, D, D_v) of
    materialised prefix sums (O(L^2) attention would need L^2 = 8192 * L values)."""
    L, D = 8192, 32
    q, k, v = (torch.randn(1, 1, L, D, requires_grad=True) for _ in range(3))
    saved = []

    def pack(tensor):
        saved.append(tensor.numel() * tensor.element_size())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        output = linear_attention(q, k, v, feature_map=elu_feature_map, causal=True)
    output.sum().backward()
    input_bytes = 3 * L * D * 4
    prefix_sums_bytes = L * D * D * 4  # (L, D, D_v)
    assert sum(saved) < 4 * input_bytes
    assert sum(saved) < prefix_sums_bytes / 2

    def peak(length):
        q, k, v = (torch.randn(1, 1, length, D, requires_grad=True) for _ in range(3))
        attend = linear_attention(q, k, v, feature_map=elu_feature_map, causal=True)
        return peak_bytes(lambda: attend.sum().backward()), peak_bytes(
            lambda: linear_attention(q, k, v, feature_map=elu_feature_map, causal=True)
        )

    (backward_half, forward_half), (backward_full, forward_full) = peak(L // 2), peak(L)
    assert max(backward_full, forward_full) < prefix_sums_bytes / 2
    assert backward_full < 2.3 * backward_half and forward_full < 2.3 * forward_half


@pytest.mark.parametrize("causal", [False, True])
def test_multi_head_attention_runs_linear_attention_after_its_projections(causal):
    layer = MultiHeadAttention(16, 4, 2, attention=LinearAttention("elu")).to(f64)
    randomize_(layer, seed=2)
    x = torch.randn(2, 9, 16, dtype=f64, requires_grad=True)
    mask = padding(torch.tensor([9, 6]), 9)
    output = layer(x, mask=mask, causal=causal)

    def project(linear, heads):
        return F.linear(x, linear.weight, linear.bias).view(2, 9, heads, 4).transpose(1, 2)

    q, k, v = project(layer.q_proj, 4), project(layer.k_proj, 2), project(layer.v_proj, 2)
    heads = eager_linear_attention(
        elu_plus_one(q), elu_plus_one(k), v, causal=causal, key_padding=mask[:, 0, 0]
    )
    concat = heads.transpose(1, 2).reshape(2, 9, 16)
    expected = F.linear(concat, layer.out_proj.weight, layer.out_proj.bias)
    torch.testing.assert_close(output, expected, atol=1e-12, rtol=1e-10)
    output.square().sum().backward()
    assert x.grad.isfinite().all() and layer.q_proj.weight.grad.abs().sum() > 0


def test_favor_projection_is_a_buffer_that_moves_and_redraws():
    layer = MultiHeadAttention(16, 2, attention=LinearAttention("favor", head_dim=8, seed=4))
    attention = layer.attention
    assert attention.projection.shape == (8 * math.ceil(math.log(8)), 8)
    assert "attention.projection" in layer.state_dict()
    twin = LinearAttention("favor", head_dim=8, seed=4)
    assert torch.equal(twin.projection, attention.projection)
    layer.to(f64)
    assert attention.projection.dtype == f64
    before = attention.projection.clone()
    attention.redraw()
    assert attention.projection.dtype == f64 and not torch.equal(before, attention.projection)
    output = layer(torch.randn(2, 5, 16, dtype=f64), causal=True)
    assert output.shape == (2, 5, 16) and output.isfinite().all()


def test_low_precision_inputs_compute_in_fp32_and_return_their_dtype():
    q, k, v = inputs(L_q=20, L_k=20, D=8, dtype=torch.bfloat16)
    output = linear_attention(q, k, v, feature_map=elu_feature_map, causal=True)
    expected = eager_linear_attention(
        elu_plus_one(q.to(f64)), elu_plus_one(k.to(f64)), v.to(f64), causal=True
    )
    assert output.dtype == torch.bfloat16
    torch.testing.assert_close(output.to(f64), expected, atol=2e-2, rtol=2e-2)


def test_multi_head_attention_takes_any_callable():
    calls = []

    def attend(q, k, v, **options):
        calls.append(options)
        return qkv.attention(q, k, v, **options)

    plain = MultiHeadAttention(16, 4)
    routed = MultiHeadAttention(16, 4, attention=attend)
    routed.load_state_dict(plain.state_dict())
    x = torch.randn(2, 5, 16)
    torch.testing.assert_close(routed(x, causal=True), plain(x, causal=True))
    assert calls and calls[0]["causal"] is True


B, L = 2, 6
Q, K, V = inputs(B=B, L_q=L, L_k=L, dtype=torch.float32)


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"window": 4}, r"window: .*expected None, got int 4"),
        ({"bias": torch.zeros(L, L)}, r"bias: .*expected None"),
        ({"dropout_p": 0.1}, r"dropout_p: .*expected 0.0, got float 0.1"),
        ({"return_weights": True}, r"return_weights: .*expected False"),
        ({"backend": "sdpa"}, r"backend: .*expected 'auto'"),
        ({"scale": 0.5}, r"scale: .*expected None"),
        ({"mask": torch.ones(L, L, dtype=torch.bool)}, r"mask: .*key-padding mask"),
        ({"mask": torch.zeros(B, 1, 1, L)}, r"mask: .*dtype torch.float32"),
    ],
)
def test_linear_attention_module_refuses_what_it_cannot_serve(options, match):
    with pytest.raises(ValueError, match=match):
        LinearAttention("elu")(Q, K, V, **options)


@pytest.mark.parametrize(
    ("build", "error", "match"),
    [
        (lambda: LinearAttention("relu"), ValueError, r"feature_map: expected 'elu' or 'favor'"),
        (lambda: LinearAttention(3), TypeError, r"feature_map: expected 'elu' or 'favor', got int"),
        (lambda: LinearAttention()(Q, K, V, sink=1), TypeError, r"sink: expected a keyword of"),
        (lambda: LinearAttention("elu", head_dim=4), ValueError, r"head_dim: only .*favor"),
        (lambda: LinearAttention("favor"), TypeError, r"head_dim: expected a positive int"),
        (lambda: LinearAttention("favor", head_dim=4, num_features=0), ValueError, "num_feat"),
        (lambda: LinearAttention("elu").redraw(), ValueError, r"redraw: feature_map='elu'"),
        (lambda: MultiHeadAttention(16, 4, attention="linear"), TypeError, r"attention: expec"),
        (
            lambda: LinearAttention("favor", head_dim=4)(Q, K, V),
            ValueError,
            r"q: expected head dim 4",
        ),
        (
            lambda: MultiHeadAttention(16, 4, dropout=0.1, attention=LinearAttention())(
                torch.randn(1, 3, 16)
            ),
            ValueError,
            r"dropout_p: ",
        ),
    ],
)
def test_module_bad_arguments(build, error, match):
    with pytest.raises(error, match=match):
        build()


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (
            lambda: linear_attention(
                Q, K, V, feature_map=elu_feature_map, key_padding=torch.ones(B, L + 1).bool()
            ),
            ValueError,
            r"key_padding: expected a bool tensor \(B, L_k\) = \(2, 6\)",
        ),
        (
            lambda: linear_attention(Q, K[:, :1].expand(B, 3, L, 5), V, feature_map=F.elu),
            ValueError,
            r"k, v: expected",
        ),
        (
            lambda: linear_attention(
                Q,
                torch.cat([K, K[:, :1]], 1),
                torch.cat([V, V[:, :1]], 1),
                feature_map=elu_feature_map,
            ),
            ValueError,
            r"k: its 3 key/value heads must divide the 4 query heads",
        ),
        (
            lambda: linear_attention(Q, K, V, feature_map=elu_feature_map, causal="yes"),
            TypeError,
            r"causal: expected a bool, got str 'yes'",
        ),
        (
            lambda: linear_attention(Q, K, V, feature_map=elu_feature_map, chunk_size=0),
            ValueError,
            r"chunk_size: expected a positive int, got 0",
        ),
        (
            lambda: linear_attention(Q, K, V, feature_map=lambda x: x.sum(-2)),
            ValueError,
            r"feature_map: expected features \(\.\.\., F\)",
        ),
        (
            lambda: linear_attention_step(None, Q, K, V, feature_map=elu_feature_map),
            ValueError,
            r"q, k, v: expected one new token each",
        ),
        (
            lambda: linear_attention_step(
                "state", Q[:, :, :1], K[:, :, :1], V[:, :, :1], feature_map=elu_feature_map
            ),
            TypeError,
            r"state: expected a LinearAttentionState or None, got str",
        ),
        (
            lambda: FavorFeatureMap(torch.ones(4, 3))(torch.ones(2, 5)),
            ValueError,
            r"x: expected head dim 3",
        ),
    ],
)
def test_function_bad_arguments(call, error, match):
    with pytest.raises(error, match=match):
        call()
