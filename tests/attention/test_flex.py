"""The `flex` backend (PyTorch's FlexAttention, compiled) against float64 eager attention.

FlexAttention's CPU kernel takes fp32/bf16/fp16 and has no backward, so outputs are compared in
fp32 under no_grad. Every case reuses a few compiled kernels (dynamic shapes): the patterns'
numbers are tensors, only the kind of pattern compiles anew.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn.attention.flex_attention import create_block_mask

import qkv
from qkv.attention import AttentionRequest, flex
from tests.attention.reference_math import eager_reference, visible_with_sinks

TOLERANCE = {"atol": 2e-5, "rtol": 2e-5}


def float64(*tensors):
    return [t.double() for t in tensors]


@st.composite
def structural_calls(draw):
    """Causal/window/sinks patterns over shapes with partial, whole and hidden 128-blocks."""
    torch.manual_seed(draw(st.integers(0, 2**31 - 1)))
    # Batch, heads and head dims fixed, lengths over two blocks, a pattern always: a size of 1
    # (a single block too), MHA against GQA or no BlockMask each compile a kernel of their own
    # (~3 s each). The other tests here cover those; test_attention.py varies the rest.
    B, H_kv, group = 2, 2, 2
    L_q = draw(st.integers(129, 300))
    L_k = L_q if draw(st.booleans()) else draw(st.integers(129, 300))  # self-attention: own code
    q = torch.randn(B, H_kv * group, L_q, 16)
    k = torch.randn(B, H_kv, L_k, 16)
    v = torch.randn(B, H_kv, L_k, 16)
    window = draw(st.sampled_from([None, 1, 40, 200, (30, 0), (20, 50), (300, 300)]))
    sinks = draw(st.sampled_from([0, 1, 5])) if window is not None else 0
    causal = window is None or draw(st.booleans())
    return (q, k, v), {"causal": causal, "window": window, "sinks": sinks}


@settings(max_examples=25, deadline=None)
@given(call=structural_calls())
def test_masks_windows_and_sinks_match_float64_eager_attention(call):
    (q, k, v), options = call
    with torch.no_grad():
        output = qkv.attention(q, k, v, **options, backend="flex")
    expected, _ = eager_reference(*float64(q, k, v), **options)
    torch.testing.assert_close(output.double(), expected, **TOLERANCE)


def alibi_dense(slopes, L_q, L_k):
    """-m_h |i' - j| written out independently: (1, H, L_q, L_k)."""
    i = torch.arange(L_q).view(-1, 1) + (L_k - L_q)
    j = torch.arange(L_k).view(1, -1)
    return -slopes.view(1, -1, 1, 1) * (i - j).abs()


def head_tilt(score, batch, head, q_idx, k_idx):
    return score + 0.05 * (head + 1) * torch.sin(0.1 * (q_idx - k_idx))


@pytest.mark.parametrize("case", ["softcap", "alibi", "score_mod", "everything"])
def test_score_modifiers_match_float64_eager_attention(case):
    torch.manual_seed(1)
    B, H, L_q = 2, 4, 150
    L_k = L_q if case == "alibi" else 260  # self-attention's ALiBi has code of its own
    q, k, v = torch.randn(B, H, L_q, 16), torch.randn(B, 2, L_k, 16), torch.randn(B, 2, L_k, 16)
    slopes = qkv.positional.alibi_slopes(H)
    mask = torch.rand(B, 1, L_q, L_k) > 0.3
    bias = torch.randn(1, H, L_q, L_k)
    ours, theirs = {}, {}
    if case in ("softcap", "everything"):
        ours["softcap"] = theirs["softcap"] = 2.5
    if case in ("alibi", "everything"):
        ours["alibi_slopes"] = slopes
        theirs["bias"] = alibi_dense(slopes.double(), L_q, L_k)
    if case in ("score_mod", "everything"):
        ours["score_mod"] = theirs["score_mod"] = head_tilt
    if case in ("bool mask", "everything"):
        ours["mask"] = mask
        theirs["bias"] = theirs.get("bias", 0) + torch.zeros(mask.shape).masked_fill(
            ~mask, -torch.inf
        )
    if case == "everything" and q.device.type != "cpu":  # the CPU's is not flex's: see below
        ours["bias"], theirs["bias"] = bias, theirs["bias"] + bias.double()
    if case in ("alibi", "score_mod"):
        ours["causal"] = theirs["causal"] = True  # with a BlockMask, too
    with torch.no_grad():
        output = qkv.attention(q, k, v, **ours, backend="flex")
    expected, _ = eager_reference(*float64(q, k, v), **theirs)
    torch.testing.assert_close(output.double(), expected, **TOLERANCE)


@pytest.mark.parametrize(
    ("L_q", "L_k", "options"),
    [
        (300, 300, {"causal": True}),
        (200, 520, {"causal": True, "window": 100}),
        (520, 200, {"causal": True}),  # early queries see nothing
        (400, 400, {"window": (60, 130), "sinks": 3}),
        (384, 640, {"causal": True, "window": 200, "sinks": 130}),
    ],
)
def test_block_layout_from_the_tile_rule_equals_pytorchs_from_the_full_mask(L_q, L_k, options):
    """qkv builds the BlockMask from block bounds alone; PyTorch's create_block_mask evaluates
    the mask at every (query, key). Same hidden / whole / partial blocks."""
    q, k, v = torch.randn(1, 1, L_q, 8), torch.randn(1, 1, L_k, 8), torch.randn(1, 1, L_k, 8)
    request = AttentionRequest(q, k, v, **options)
    ours = flex._block_mask(request)
    visible = visible_with_sinks(L_q, L_k, **options)[0, 0]
    theirs = create_block_mask(lambda b, h, i, j: visible[i, j], None, None, L_q, L_k)
    assert torch.equal(ours.to_dense(), theirs.to_dense())
    # A block PyTorch calls whole is whole for qkv too; qkv may also call a tail block whole
    # that PyTorch's padded evaluation calls partial, when every real (query, key) is visible.
    ours_whole, theirs_whole = _whole_blocks(ours)[0, 0], _whole_blocks(theirs)[0, 0]
    assert (ours_whole >= theirs_whole).all()
    for n_q, n_k in ours_whole.nonzero().tolist():
        assert visible[n_q * 128 : (n_q + 1) * 128, n_k * 128 : (n_k + 1) * 128].all()


def _whole_blocks(block_mask) -> torch.Tensor:
    """Which blocks need no mask_mod, as a dense (1, 1, n_q, n_k) map."""
    if block_mask.full_kv_num_blocks is None:
        return torch.zeros_like(block_mask.to_dense())
    return (
        type(block_mask)
        .from_kv_blocks(block_mask.full_kv_num_blocks, block_mask.full_kv_indices)
        .to_dense()
    )


def test_rows_without_a_visible_key_are_zero_and_a_nan_bias_is_left_to_other_backends():
    """Rows without a visible key give 0. A dense bias is not flex's on the CPU: its kernel
    turned a NaN score into an empty row (output 0) at L = 192, against the NaN rule that
    `auto`'s backends keep."""
    q, k, v = (torch.randn(2, 2, 192, 16) for _ in range(3))
    mask = torch.ones(2, 1, 192, 192, dtype=torch.bool)
    mask[0, :, 5] = False
    bias = torch.zeros(192, 192)
    bias[7, 3] = torch.nan
    with torch.no_grad():
        empty = qkv.attention(q, k, v, mask=mask, backend="flex")
        late = qkv.attention(q, k[:, :, :50], v[:, :, :50], causal=True, backend="flex")
        with pytest.raises(ValueError, match="turns a NaN score into an empty row"):
            qkv.attention(q, k, v, bias=bias, backend="flex")
        poisoned = qkv.attention(q, k, v, bias=bias)
    assert (empty[0, :, 5] == 0).all() and empty.isfinite().all()
    assert (late[:, :, :142] == 0).all()  # L_q > L_k: the first 142 queries see no key
    assert poisoned[:, :, 7].isnan().all() and not poisoned[:, :, 6].isnan().any()


@pytest.mark.parametrize("length", [72, 200])
def test_lengths_where_torchs_cpu_kernel_errs_go_to_another_backend(length):
    """torch 2.13's CPU kernel, with a score_mod, gave wrong rows at L = 8 mod 16 (0.1-0.3 off
    in the last batch and head, in most random draws): flex refuses such calls by name, and
    auto computes them elsewhere, equal to float64 attention."""
    q, k, v = (torch.randn(2, 2, length, 16, generator=torch.Generator().manual_seed(1))
               for _ in range(3))  # fmt: skip
    with pytest.raises(ValueError, match="length of 8 more than a multiple of 16"):
        qkv.attention(q, k, v, softcap=5.0, backend="flex")
    assert not qkv.explain(q, k, v, softcap=5.0).startswith("backend 'flex'")
    got = qkv.attention(q, k, v, softcap=5.0)
    expected = qkv.attention(*float64(q, k, v), softcap=5.0, backend="reference")
    torch.testing.assert_close(got.double(), expected, atol=1e-5, rtol=1e-5)


def test_what_flex_cannot_serve_is_refused_with_the_reason():
    q, k, v = (torch.randn(1, 2, 64, 8) for _ in range(3))
    reasons = {
        "fp64": qkv.explain(*float64(q, k, v), window=8, backend="auto"),
        "grad": qkv.explain(q.requires_grad_(), k, v, window=8, backend="auto"),
    }
    assert "fp32, bf16 and fp16, not torch.float64" in reasons["fp64"]
    assert "no FlexAttention backward on the CPU" in reasons["grad"]
    with pytest.raises(ValueError, match="flex' cannot serve.*NaN score"), torch.no_grad():
        qkv.attention(q, k, v, bias=torch.zeros(64, 64), causal=True, backend="flex")
    with pytest.raises(ValueError, match="flex' cannot serve.*no weights"):
        qkv.attention(q, k, v, return_weights=True, backend="flex")


def test_auto_takes_flex_for_patterns_sdpa_would_need_dense_tensors_for():
    long = [torch.randn(1, 2, 1024, 16) for _ in range(3)]
    short = [torch.randn(1, 2, 64, 16) for _ in range(3)]
    with torch.no_grad():
        for options in ({"window": 128}, {"alibi_slopes": torch.ones(2)}, {"softcap": 5.0}):
            assert qkv.explain(*long, causal=True, **options).startswith("backend 'flex'")
        plain = qkv.explain(*long, causal=True)
        small = qkv.explain(*short, softcap=5.0)
    assert plain.startswith("backend 'sdpa'") and "taken without asking the others" in plain
    assert small.startswith("backend 'reference'") and "fixed costs" in small


def test_tensors_that_require_grad_are_served_under_no_grad():
    """torch's FlexAttention refuses CPU tensors with requires_grad even under no_grad."""
    q = torch.randn(2, 4, 300, 16, requires_grad=True)  # the hypothesis test's shapes
    k, v = (torch.randn(2, 2, 300, 16, requires_grad=True) for _ in range(2))
    with torch.no_grad():
        output = qkv.attention(q, k, v, causal=True, window=100, backend="flex")
    expected, _ = eager_reference(*float64(q, k, v), causal=True, window=100)
    torch.testing.assert_close(output.double(), expected, **TOLERANCE)


@pytest.fixture
def fresh_cpu_support():
    """flex asks capabilities once per process: again in the test, and after it."""
    flex._cpu_support.cache_clear()
    yield
    flex._cpu_support.cache_clear()


def test_on_a_cpu_flex_cannot_compile_for_auto_falls_back_and_says_why(
    monkeypatch, fresh_cpu_support
):
    """ATEN_CPU_CAPABILITY=default (the portable baseline, as on a CPU without AVX2): inductor
    cannot build FlexAttention's CPU kernel, so auto must not pick it."""
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "default")
    q, k, v = (torch.randn(1, 2, 1024, 16) for _ in range(3))
    with torch.no_grad():
        text = qkv.explain(q, k, v, causal=True, window=128)
        output = qkv.attention(q, k, v, causal=True, window=128)
    assert "passed over 'flex': ATEN_CPU_CAPABILITY=default" in text
    expected, _ = eager_reference(*float64(q, k, v), causal=True, window=128)
    torch.testing.assert_close(output.double(), expected, **TOLERANCE)
