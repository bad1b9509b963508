"""DifferentialAttention against the paper's formula written out (Ye et al. 2024, s2.1).

The reference below reads the layer's parameters and computes eq. 1-3 step by step in float64:
both softmax maps materialised with torch.softmax over scores set to -inf where the mask, the
causal rule or the window hides a key, RoPE rotated by hand, the RMSNorm of each head written
as x / sqrt(mean(x^2) + eps). It never calls `qkv.attention`.
"""

import math

import pytest
import torch
from torch.autograd import gradcheck
from torch.func import functional_call

import qkv
from qkv.layers import DifferentialAttention
from qkv.positional import RotaryEmbedding

from .helpers import randomize_

F64 = torch.float64


def visible_keys(B, L, *, causal=False, window=None, lengths=None, mask=None):
    """bool (B, 1, L, L): True where query i may attend key j, every rule written out."""
    i = torch.arange(L).view(L, 1)
    j = torch.arange(L).view(1, L)
    allowed = torch.ones(B, 1, L, L, dtype=torch.bool)
    if causal:
        allowed &= j <= i
    if window is not None:  # an int W: itself and the W - 1 keys before it
        allowed &= (j <= i) & (j > i - window)
    if lengths is not None:
        allowed &= (j < lengths.view(B, 1, 1, 1)).expand(B, 1, L, L)
    if mask is not None:
        allowed &= mask
    return allowed


def rotate_by_hand(x, positions, base=10000.0):
    """RoPE, "half" layout: pair (i, i + D/2) of x (..., L, D) at position m turned by m theta_i,
    theta_i = base^(-2i/D) (Su et al. 2021, s3.4)."""
    D = x.shape[-1]
    theta = base ** (-torch.arange(0, D // 2, dtype=F64) * 2 / D)  # (D/2,)
    angle = positions.to(F64).view(-1, 1) * theta  # (L, D/2)
    cos, sin = angle.cos(), angle.sin()
    first, second = x[..., : D // 2], x[..., D // 2 :]
    return torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)


def paper_formula(layer, x, allowed, positions=None):
    """Ye et al. 2024, eq. 1-3, from the layer's parameters. Returns (output, maps A1 - lambda
    A2 (B, H, L, L)). A query row that sees no key gives 0, as qkv promises."""
    B, L, E = x.shape
    H, H_kv = layer.num_heads, layer.num_kv_heads
    d = E // H // 2
    p = dict(layer.named_parameters())
    q, k, v = (
        torch.nn.functional.linear(x, p[f"{n}_proj.weight"], p.get(f"{n}_proj.bias")) for n in "qkv"
    )
    lam = (
        torch.exp((p["lambda_q1"] * p["lambda_k1"]).sum())
        - torch.exp((p["lambda_q2"] * p["lambda_k2"]).sum())
        + (0.8 - 0.6 * math.exp(-0.3 * (layer.depth - 1)))
    )
    heads, maps = [], []
    for h in range(H):
        g = h // (H // H_kv)  # the key/value head this query head reads
        q_first, q_second = (
            q[..., 2 * h * d : (2 * h + 1) * d],
            q[..., (2 * h + 1) * d : (2 * h + 2) * d],
        )
        k_first, k_second = (
            k[..., 2 * g * d : (2 * g + 1) * d],
            k[..., (2 * g + 1) * d : (2 * g + 2) * d],
        )
        value = v[..., 2 * g * d : (2 * g + 2) * d]  # (B, L, 2d)
        if positions is not None:
            q_first, q_second, k_first, k_second = (
                rotate_by_hand(t, positions) for t in (q_first, q_second, k_first, k_second)
            )
        softmaxes = []
        for qs, ks in ((q_first, k_first), (q_second, k_second)):
            scores = qs @ ks.transpose(-1, -2) / math.sqrt(d)  # (B, L, L)
            scores = scores.masked_fill(~allowed[:, 0], float("-inf"))
            softmax = torch.softmax(scores, dim=-1)
            softmaxes.append(torch.where(allowed[:, 0].any(-1, keepdim=True), softmax, 0.0))
        difference = softmaxes[0] - lam * softmaxes[1]  # (B, L, L)
        head = difference @ value  # (B, L, 2d)
        head = head / torch.sqrt((head * head).mean(-1, keepdim=True) + 1e-5)
        head = head * p["head_norm.weight"] * (1 - layer.lambda_init)
        heads.append(head)
        maps.append(difference)
    output = torch.cat(heads, dim=-1)  # (B, L, E)
    output = torch.nn.functional.linear(output, p["out_proj.weight"], p.get("out_proj.bias"))
    return output, torch.stack(maps, dim=1)


def make_layer(embed_dim=16, num_heads=2, num_kv_heads=None, seed=0, **options):
    torch.manual_seed(seed)
    layer = DifferentialAttention(embed_dim, num_heads, num_kv_heads, dtype=F64, **options)
    return randomize_(layer, seed=seed)


CASES = {
    "plain": ({}, {}),
    "causal": ({}, {"causal": True}),
    "padding": ({"bias": True}, {"lengths": torch.tensor([6, 3])}),
    "window": ({}, {"window": 3}),
    "gqa_causal": ({"embed_dim": 32, "num_heads": 4, "num_kv_heads": 2}, {"causal": True}),
    "rope_causal": ({"rope": RotaryEmbedding(4)}, {"causal": True, "positions": True}),
    "mqa_rope_window_padding": (
        {"embed_dim": 32, "num_heads": 4, "num_kv_heads": 1, "rope": RotaryEmbedding(4)},
        {"window": 2, "lengths": torch.tensor([6, 4]), "positions": True},
    ),
}


def run_case(name, backend="reference"):
    layer_options, call = CASES[name]
    layer = make_layer(depth=3, backend=backend, **layer_options)
    B, L = 2, 6
    x = torch.randn(B, L, layer.embed_dim, dtype=F64, generator=torch.Generator().manual_seed(1))
    kwargs = {key: call[key] for key in ("causal", "window") if key in call}
    if "lengths" in call:
        kwargs["mask"] = qkv.masks.padding(call["lengths"], L)
    positions = torch.arange(5, 5 + L) if call.get("positions") else None
    if positions is not None:
        kwargs["positions"] = positions
    allowed = visible_keys(
        B,
        L,
        causal=call.get("causal", False),
        window=call.get("window"),
        lengths=call.get("lengths"),
    )
    return layer, x, kwargs, allowed, positions


@pytest.mark.parametrize("name", list(CASES))
def test_output_and_weights_equal_the_paper_formula(name):
    layer, x, kwargs, allowed, positions = run_case(name)
    output, weights = layer(x, return_weights=True, **kwargs)
    expected, maps = paper_formula(layer, x, allowed, positions)
    torch.testing.assert_close(output, expected, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(weights, maps, rtol=1e-10, atol=1e-12)
    layer.backend = "auto"  # without weights: a fused or tiled backend, float64 all the same
    torch.testing.assert_close(layer(x, **kwargs), expected, rtol=1e-10, atol=1e-10)


def test_gradients_equal_those_of_the_paper_formula():
    layer, x, kwargs, allowed, positions = run_case("gqa_causal", backend="auto")
    x.requires_grad_(True)
    upstream = torch.randn(x.shape, dtype=F64, generator=torch.Generator().manual_seed(2))
    names = [name for name, _ in layer.named_parameters()]
    grads = torch.autograd.grad((layer(x, **kwargs) * upstream).sum(), [x, *layer.parameters()])
    expected = torch.autograd.grad(
        (paper_formula(layer, x, allowed, positions)[0] * upstream).sum(), [x, *layer.parameters()]
    )
    for name, got, want in zip(["x", *names], grads, expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-10, msg=name)
    lambda_grads = [g for n, g in zip(names, grads[1:], strict=True) if n.startswith("lambda")]
    assert len(lambda_grads) == 4 and all(g.abs().sum() > 0 for g in lambda_grads)


@pytest.mark.parametrize("variant", ["gqa_rope_causal", "padding_weights"])
def test_gradcheck(variant):
    # finite differences over x and every parameter but the projection matrices (plain
    # products; their gradients are compared with the formula's above): kept tiny
    rope = variant == "gqa_rope_causal"
    options = {"rope": RotaryEmbedding(2), "num_kv_heads": 1} if rope else {"bias": True}
    layer = make_layer(embed_dim=8, num_heads=2, depth=2, seed=3, **options)
    x = torch.randn(1 if rope else 2, 3, 8, dtype=F64, generator=torch.Generator().manual_seed(4))
    x.requires_grad_(True)
    params = {
        n: p.detach().clone().requires_grad_()
        for n, p in layer.named_parameters()
        if not n.endswith("_proj.weight")
    }
    names = list(params)

    def forward(x, *weights):
        state = dict(zip(names, weights, strict=True))  # projections keep the layer's own
        if rope:
            return functional_call(layer, state, (x,), {"causal": True})
        mask = qkv.masks.padding(torch.tensor([3, 2]), 3)
        return functional_call(layer, state, (x,), {"mask": mask, "return_weights": True})

    assert gradcheck(forward, (x, *params.values()), eps=1e-6, atol=1e-5)


def test_lambda_init_follows_the_schedule():
    # 0.8 - 0.6 exp(-0.3 (l - 1)), Ye et al. 2024, eq. 2
    expected = {1: 0.2, 2: 0.8 - 0.6 * 0.7408182206817179, 12: 0.8 - 0.6 * 0.036883167401240}
    for depth, value in expected.items():
        layer = DifferentialAttention(8, 2, depth=depth)
        assert layer.lambda_init == pytest.approx(value, abs=1e-12)
    assert DifferentialAttention(8, 2, depth=12).lambda_init == pytest.approx(0.777870, abs=1e-6)


def test_sizes_follow_the_paper():
    layer = DifferentialAttention(64, 4, 2, depth=1)
    assert layer.head_dim == 8  # d = E / 2H; values 2d
    assert layer.q_proj.weight.shape == (64, 64)
    assert layer.k_proj.weight.shape == layer.v_proj.weight.shape == (2 * 16, 64)
    assert layer.out_proj.weight.shape == (64, 64)
    assert layer.lambda_q1.shape == (8,) and layer.head_norm.weight.shape == (16,)
    lambdas = torch.cat([layer.lambda_q1, layer.lambda_k1, layer.lambda_q2, layer.lambda_k2])
    assert 0.0 < lambdas.std().item() < 0.3  # N(0, 0.1^2)


@pytest.mark.parametrize("backend", ["reference", "sdpa", "tiled"])
def test_a_fully_masked_row_gives_zero_and_finite_gradients(backend):
    layer = make_layer(depth=4, backend=backend)
    x = torch.randn(2, 4, 16, dtype=F64, generator=torch.Generator().manual_seed(5))
    x.requires_grad_(True)
    mask = torch.ones(2, 1, 4, 4, dtype=torch.bool)
    mask[0, :, 2] = False  # query 2 of batch 0 sees nothing
    mask[1] = False  # batch 1 sees nothing at all
    output = layer(x, mask=mask, causal=True)
    assert torch.equal(output[0, 2], torch.zeros(16, dtype=F64))
    assert torch.equal(output[1], torch.zeros(4, 16, dtype=F64))
    expected, _ = paper_formula(layer, x, visible_keys(2, 4, causal=True, mask=mask))
    torch.testing.assert_close(output, expected, rtol=1e-10, atol=1e-10)
    output.square().sum().backward()
    assert torch.isfinite(x.grad).all()
    assert all(torch.isfinite(p.grad).all() for p in layer.parameters())


@pytest.mark.parametrize("name", ["causal", "padding", "window", "mqa_rope_window_padding"])
def test_reference_and_auto_backends_agree(name):
    layer, x, kwargs, _, _ = run_case(name, backend="reference")
    layer, x = layer.float(), x.float()
    expected = layer(x, **kwargs)
    layer.backend = "auto"
    torch.testing.assert_close(layer(x, **kwargs), expected, rtol=1e-5, atol=1e-5)


def test_bad_inputs_name_the_argument():
    with pytest.raises(ValueError, match=r"embed_dim: 12 .*2 \* num_heads=8"):
        DifferentialAttention(12, 4, depth=1)
    with pytest.raises(ValueError, match="num_kv_heads: 3 does not divide num_heads=4"):
        DifferentialAttention(24, 4, 3, depth=1)
    with pytest.raises(ValueError, match="depth: expected a positive int, got 0"):
        DifferentialAttention(8, 2, depth=0)
    with pytest.raises(TypeError, match="depth: expected a positive int, got float 1.0"):
        DifferentialAttention(8, 2, depth=1.0)
    with pytest.raises(TypeError, match="num_heads: .*got str"):
        DifferentialAttention(8, "2", depth=1)
    with pytest.raises(TypeError, match="bias: expected a bool, got str"):
        DifferentialAttention(8, 2, depth=1, bias="yes")
    with pytest.raises(TypeError, match="backend: expected a str"):
        DifferentialAttention(8, 2, depth=1, backend=None)
    with pytest.raises(ValueError, match="rope: built for head_dim=4, expected head_dim=2"):
        DifferentialAttention(8, 2, depth=1, rope=RotaryEmbedding(4))
    with pytest.raises(TypeError, match="rope: expected"):
        DifferentialAttention(8, 2, depth=1, rope="rope")
    layer = DifferentialAttention(8, 2, depth=1)
    with pytest.raises(ValueError, match=r"x: expected shape \(B, L, 8\), got \(2, 3, 6\)"):
        layer(torch.randn(2, 3, 6))
    with pytest.raises(TypeError, match="x: expected a torch.Tensor, got list"):
        layer([[0.0] * 8])
    with pytest.raises(ValueError, match="positions: given, but this layer has no rope"):
        layer(torch.randn(1, 3, 8), positions=torch.arange(3))
    with pytest.raises(TypeError, match="causal: expected a bool"):
        layer(torch.randn(1, 3, 8), causal=1)
