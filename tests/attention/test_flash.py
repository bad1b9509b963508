"""qkv.flash_attention (backend `tiled`) against float64 eager attention, feature by feature."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import qkv
from qkv.analysis.cost.memory import peak_bytes
from qkv.attention.tiled import kernels
from qkv.attention.tiles import dropout_keep
from tests.attention.reference_math import eager_reference, visible_with_sinks


def alibi_mod(slopes):
    return lambda s, b, h, i, j: s - slopes[h] * (i - j).abs()


@st.composite
def flash_calls(draw):
    torch.manual_seed(draw(st.integers(0, 2**31 - 1)))
    B, H_kv, group = draw(st.integers(1, 2)), draw(st.integers(1, 2)), draw(st.integers(1, 3))
    H, L_q, L_k, D = H_kv * group, draw(st.integers(1, 17)), draw(st.integers(1, 17)), 4
    bias_shape = draw(st.sampled_from([None, (L_q, L_k), (1, H, L_q, L_k), (B, 1, 1, L_k)]))
    use_lengths = draw(st.booleans())
    return {
        "q": torch.randn(B, H, L_q, D, dtype=torch.float64),
        "k": torch.randn(B, H_kv, L_k, D, dtype=torch.float64),
        "v": torch.randn(B, H_kv, L_k, draw(st.integers(1, 5)), dtype=torch.float64),
        "bias": None if bias_shape is None else torch.randn(bias_shape, dtype=torch.float64),
        "options": {
            "causal": draw(st.booleans()),
            "window": draw(st.sampled_from([None, 1, 4, (2, 0), (3, 2)])),
            "sinks": draw(st.sampled_from([0, 1, 3])),
            "lengths": torch.randint(0, L_k + 1, (B,)) if use_lengths else None,
            "softcap": draw(st.sampled_from([None, 2.0])),
            "score_mod": draw(st.sampled_from([None, alibi_mod(torch.linspace(0.1, 1.0, H))])),
        },
        "blocks": {"block_q": draw(st.integers(2, 7)), "block_k": draw(st.integers(2, 7))},
    }


@settings(max_examples=60, deadline=None)
@given(call=flash_calls())
def test_every_feature_matches_float64_eager_attention(call):
    ours = {n: call[n].clone().requires_grad_() for n in ("q", "k", "v")}
    theirs = {n: call[n].clone().requires_grad_() for n in ("q", "k", "v")}
    bias_ours = bias_theirs = None
    if call["bias"] is not None:
        bias_ours, bias_theirs = (call["bias"].clone().requires_grad_() for _ in range(2))
    options = call["options"]

    output, lse = qkv.flash_attention(
        **ours, bias=bias_ours, **options, **call["blocks"], return_lse=True
    )
    expected, expected_lse = eager_reference(**theirs, bias=bias_theirs, **options)
    torch.testing.assert_close(output, expected, atol=1e-10, rtol=1e-8)
    torch.testing.assert_close(lse, expected_lse, atol=1e-10, rtol=1e-8)

    grad = torch.randn_like(output)
    leaves_ours = [*ours.values()] + ([bias_ours] if bias_ours is not None else [])
    leaves_theirs = [*theirs.values()] + ([bias_theirs] if bias_theirs is not None else [])
    for got, want in zip(
        torch.autograd.grad(output, leaves_ours, grad),
        torch.autograd.grad(expected, leaves_theirs, grad),
        strict=True,
    ):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, want, atol=1e-9, rtol=1e-7)


def test_gradcheck_float64_with_every_feature():
    torch.manual_seed(0)
    q = torch.randn(1, 4, 7, 3, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 2, 9, 3, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 2, 9, 2, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(1, 4, 7, 9, dtype=torch.float64, requires_grad=True)

    def run(q, k, v, bias):
        return qkv.flash_attention(
            q,
            k,
            v,
            bias=bias,
            causal=True,
            window=4,
            sinks=2,
            softcap=3.0,
            lengths=torch.tensor([8]),
            block_q=3,
            block_k=4,
        )

    assert torch.autograd.gradcheck(run, (q, k, v, bias))


def test_dropout_backward_uses_exactly_the_forwards_mask():
    B, H, H_kv, L, D, p, block = 2, 4, 2, 11, 3, 0.3, 4
    q = torch.randn(B, H, L, D, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(B, H_kv, L, D, dtype=torch.float64, requires_grad=True) for _ in range(2))
    torch.manual_seed(7)
    seed = int(torch.randint(0, 2**62, (1,)).item())  # the draw flash_attention makes
    torch.manual_seed(7)
    output = qkv.flash_attention(q, k, v, causal=True, dropout_p=p, block_q=block, block_k=block)

    # Rebuild the whole mask from the per-tile seeds, then run eager attention with it.
    rows = torch.ones(B, H_kv, L * (H // H_kv), L, dtype=torch.bool)
    for qi, q_start in enumerate(range(0, L, block)):
        for kj, k_start in enumerate(range(0, L, block)):
            q_end, k_end = min(q_start + block, L), min(k_start + block, L)
            tile_rows = slice(q_start * H // H_kv, q_end * H // H_kv)
            shape = (B, H_kv, (q_end - q_start) * H // H_kv, k_end - k_start)
            rows[:, :, tile_rows, k_start:k_end] = dropout_keep(seed, qi, kj, shape, p, q.device)
    keep = kernels.from_rows(rows, H // H_kv)  # (B, H, L, L)
    assert 0.2 < 1 - keep.double().mean() < 0.4
    expected, _ = eager_reference(q, k, v, causal=True, dropout_keep=keep, dropout_p=p)
    torch.testing.assert_close(output, expected)
    grad = torch.randn_like(output)
    for got, want in zip(
        torch.autograd.grad(output, (q, k, v), grad),
        torch.autograd.grad(expected, (q, k, v), grad),
        strict=True,
    ):
        torch.testing.assert_close(got, want)


def _visited_tiles(L, block, **options):
    visited = []
    q, k, v = (torch.randn(1, 1, L, 4) for _ in range(3))
    qkv.flash_attention(
        q,
        k,
        v,
        **options,
        block_q=block,
        block_k=block,
        trace=lambda step: visited.append((step.q_block, step.k_block)),
    )
    return visited


@pytest.mark.parametrize("options", [{"causal": True}, {"window": 16}, {"window": 8, "sinks": 4}])
def test_hidden_tiles_are_skipped(options):
    L, block = 64, 8
    visited = _visited_tiles(L, block, **options)
    visible = visible_with_sinks(L, L, **options)[0, 0]
    needed = {
        (qi, kj)
        for qi in range(L // block)
        for kj in range(L // block)
        if visible[qi * block : (qi + 1) * block, kj * block : (kj + 1) * block].any()
    }
    assert set(visited) == needed and len(visited) == len(needed) < (L // block) ** 2


def test_trace_running_statistics_converge_to_the_exact_softmax():
    torch.manual_seed(1)
    q, k, v = (torch.randn(1, 2, 12, 4, dtype=torch.float64) for _ in range(3))
    steps = []
    _, lse = qkv.flash_attention(q, k, v, block_q=4, block_k=3, return_lse=True, trace=steps.append)
    assert [(s.q_block, s.k_block) for s in steps] == [(i, j) for i in range(3) for j in range(4)]
    scores = (q @ k.transpose(-1, -2)) / 2.0  # scale 1/sqrt(4)
    for q_block in range(3):
        last = [s for s in steps if s.q_block == q_block][-1]
        rows = scores[:, :, q_block * 4 : (q_block + 1) * 4]
        torch.testing.assert_close(last.running_max, rows.amax(-1))
        torch.testing.assert_close(
            last.running_sum, (rows - rows.amax(-1, keepdim=True)).exp().sum(-1)
        )
    torch.testing.assert_close(lse, torch.logsumexp(scores, dim=-1))


def test_attention_weights_recompute_the_exact_map_of_chosen_heads_and_rows():
    torch.manual_seed(2)
    q = torch.randn(2, 4, 10, 8, dtype=torch.float64)
    k, v = (torch.randn(2, 2, 13, 8, dtype=torch.float64) for _ in range(2))
    bias = torch.randn(1, 4, 10, 13, dtype=torch.float64)
    options = {"causal": True, "window": 6, "sinks": 2, "lengths": torch.tensor([13, 9])}
    _, lse = qkv.flash_attention(
        q, k, v, bias=bias, **options, block_q=4, block_k=4, return_lse=True
    )
    weights = qkv.attention_weights(q, k, lse, bias=bias, **options, heads=[3, 0], rows=[9, 2, 0])
    assert weights.shape == (2, 2, 3, 13)
    # The eager reference's weights: its output with V = identity.
    identity = torch.eye(13, dtype=torch.float64).expand(2, 2, 13, 13)
    full, _ = eager_reference(q, k, identity, bias=bias, **options)
    torch.testing.assert_close(weights, full[:, [3, 0]][:, :, [9, 2, 0]])


def test_forward_plus_backward_peak_memory_grows_linearly_in_length():
    def peak(L, backend):
        q, k, v = (torch.randn(1, 2, L, 16, requires_grad=True) for _ in range(3))
        return peak_bytes(
            lambda: qkv.attention(q, k, v, causal=True, backend=backend).sum().backward()
        )

    tiled = [peak(L, "tiled") for L in (512, 1024, 2048)]
    naive = [peak(L, "reference") for L in (512, 1024, 2048)]
    # Doubling L adds twice as much again for O(L), four times as much for O(L^2).
    assert (tiled[2] - tiled[1]) / (tiled[1] - tiled[0]) < 2.5
    assert (naive[2] - naive[1]) / (naive[1] - naive[0]) > 3.5
    assert tiled[2] * 8 < naive[2]


def test_auto_takes_tiled_only_for_long_windows_that_need_gradients():
    short = [torch.randn(1, 2, 256, 8, requires_grad=True) for _ in range(3)]
    long = [torch.randn(1, 1, 4096, 8, requires_grad=True) for _ in range(3)]
    assert qkv.explain(*short, window=64).startswith("backend 'sdpa'")
    assert qkv.explain(*long, causal=True).startswith("backend 'sdpa'")
    text = qkv.explain(*long, window=1024)  # flex has no backward on the CPU
    assert text.startswith("backend 'tiled'") and "no dense mask" in text
    assert "leave ~67% of the scores visible" in qkv.explain(*long, window=(1750, 1750))


@pytest.mark.parametrize(
    ("options", "error", "match"),
    [
        ({"sinks": -1}, ValueError, "sinks: expected an int >= 0, got -1"),
        ({"block_q": 0}, ValueError, "block_q: expected an int >= 1, got 0"),
        (
            {"lengths": torch.tensor([3, 9])},
            ValueError,
            r"lengths: expected values in \[0, L_k=8\]",
        ),
        ({"lengths": torch.tensor([3])}, ValueError, r"lengths: expected a tensor of shape \(2,\)"),
        ({"softcap": 0.0}, ValueError, "softcap: expected a positive finite number"),
        ({"score_mod": 3}, TypeError, "score_mod: expected a callable"),
        ({"bias": torch.ones(3, 3)}, ValueError, "bias: shape"),
    ],
)
def test_bad_input_names_the_argument(options, error, match):
    q, k, v = (torch.randn(2, 2, 8, 4) for _ in range(3))
    with pytest.raises(error, match=match):
        qkv.flash_attention(q, k, v, **options)
