"""One bf16/fp16 query row on the CPU (a decoding step) runs through SDPA in fp32, where
PyTorch's CPU kernel is several times faster; a GQA/MQA group's queries stacked on their K/V head
are several rows and keep their dtype. Either way the output comes back in the input dtype, at
most twice as far from the fp64 result as PyTorch's own low-precision call (qkv's low-precision
rule), with causal, windows, GQA and fully masked rows handled as everywhere else."""

import pytest
import torch

import qkv
from tests.attention.reference_math import sdpa_reference

L_K = 40
EMPTY_SECOND_ROW = torch.tensor([[True] * L_K, [False] * L_K])[:, None, None, :]  # (B, 1, 1, L_k)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "options", [{"causal": True}, {"window": 5}, {"mask": EMPTY_SECOND_ROW}, {"scale": 0.7}]
)
def test_one_low_precision_query_is_as_accurate_as_pytorchs_own_call(dtype, options):
    generator = torch.Generator().manual_seed(0)
    shapes = ((2, 8, 1, 16), (2, 2, L_K, 16), (2, 2, L_K, 16))  # GQA: 8 query heads over 2
    q, k, v = (torch.randn(shape, generator=generator, dtype=torch.float64) for shape in shapes)
    exact = sdpa_reference(q, k, v, **options)
    low = [t.to(dtype) for t in (q, k, v)]
    ours = qkv.attention(*low, **options)
    theirs = sdpa_reference(*low, **options)
    assert ours.dtype == dtype
    our_error = (ours.double() - exact).abs().max()
    assert our_error <= 2 * (theirs.double() - exact).abs().max()
    if "mask" in options:
        assert torch.equal(ours[1], torch.zeros_like(ours[1]))  # the row with no visible key


def test_explain_says_when_a_query_is_computed_in_fp32():
    q, k, v = (torch.randn(1, 4, length, 8, dtype=torch.bfloat16) for length in (1, 9, 9))
    assert "computed in fp32 and cast back" in qkv.explain(q, k, v, causal=True)
    longer = torch.randn(1, 4, 2, 8, dtype=torch.bfloat16)
    assert "computed in fp32" not in qkv.explain(longer, k, v, causal=True)
    assert "computed in fp32" not in qkv.explain(q.float(), k.float(), v.float(), causal=True)
    grouped_k = k[:, :2]  # GQA: the group's two queries stacked are two rows, kept in bf16
    text = qkv.explain(q, grouped_k, grouped_k, causal=True)
    assert "computed in fp32" not in text and "stacked" in text
    assert qkv.attention(q, grouped_k, grouped_k, causal=True).dtype == torch.bfloat16


@pytest.mark.parametrize(("heads", "kv_heads"), [(9, 3), (8, 1), (4, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_groups_queries_stacked_on_their_kv_head_give_each_heads_attention(
    heads, kv_heads, dtype
):
    """GQA and MQA, one query per head over a cache (causal aligned bottom-right sees every
    key): each K/V head's group of queries goes to the kernel as its rows. Against the float64
    reference with K/V repeated per query head; fp32 within fp32's rounding, bf16 within twice
    PyTorch's own low-precision error."""
    generator = torch.Generator().manual_seed(1)
    shapes = ((2, heads, 1, 16), (2, kv_heads, L_K, 16), (2, kv_heads, L_K, 8))
    q, k, v = (torch.randn(shape, generator=generator, dtype=torch.float64) for shape in shapes)
    exact = sdpa_reference(q, k, v, causal=True, scale=0.3)
    low = [t.to(dtype) for t in (q, k, v)]
    ours = qkv.attention(*low, causal=True, scale=0.3)
    assert ours.shape == (2, heads, 1, 8) and ours.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(ours.double(), exact, rtol=0, atol=1e-6)
    else:
        theirs = sdpa_reference(*low, causal=True, scale=0.3)
        assert (ours.double() - exact).abs().max() <= 2 * (theirs.double() - exact).abs().max()
    text = qkv.explain(*low, causal=True)
    assert "each group's queries stacked as its K/V head's rows" in text


def test_stacked_queries_keep_the_nan_rule_per_head():
    """A NaN query gives NaN to its own head alone; a NaN key gives NaN to every head of its
    group and to no other group (`qkv.attention.nan_rows`)."""
    q, k, v = torch.randn(1, 6, 1, 8), torch.randn(1, 2, L_K, 8), torch.randn(1, 2, L_K, 8)
    q[0, 4, 0, 3] = float("nan")  # head 4: group of K/V head 1
    k[0, 0, 17, 2] = float("nan")  # K/V head 0: heads 0-2
    out = qkv.attention(q, k, v, causal=True)
    nan_heads = out.isnan().any(-1).flatten().tolist()
    assert nan_heads == [True, True, True, False, True, False]


def test_a_group_is_not_stacked_where_its_queries_see_different_keys():
    """Two queries per head (a chunk of a prompt), causal: not stacked, and the explanation
    says enable_gqa."""
    q, k, v = torch.randn(1, 4, 2, 8), torch.randn(1, 2, 9, 8), torch.randn(1, 2, 9, 8)
    text = qkv.explain(q, k, v, causal=True)
    assert "stacked" not in text and "enable_gqa=True" in text
    expected = sdpa_reference(q, k, v, causal=True)
    torch.testing.assert_close(qkv.attention(q, k, v, causal=True), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("heads", "kv_heads"), [(9, 3), (8, 1)])
@pytest.mark.parametrize(
    "options",
    [{"window": 5}, {"mask": EMPTY_SECOND_ROW}, {"lengths": torch.tensor([L_K, 11])},
     {"bias": "per head"}, {"alibi_slopes": "per head"}],
    ids=["window", "padding-mask", "lengths", "bias-per-head", "alibi"],
)  # fmt: skip
def test_stacked_queries_take_every_mask_and_bias(heads, kv_heads, options):
    """One query per head, with a mask, padding, a window or a bias per head (ALiBi's
    slopes): the stacked rows give each head its own attention (float64 reference with K/V
    repeated); a row with no visible key gives 0."""
    generator = torch.Generator().manual_seed(2)
    shapes = ((2, heads, 1, 16), (2, kv_heads, L_K, 16), (2, kv_heads, L_K, 16))
    q, k, v = (torch.randn(shape, generator=generator) for shape in shapes)
    options = dict(options)
    reference = dict(options)
    if options.get("bias") == "per head":
        bias = torch.randn(1, heads, 1, L_K, generator=generator)
        options["bias"], reference["bias"] = bias, bias.double()
    if options.get("alibi_slopes") == "per head":
        slopes = qkv.positional.alibi_slopes(heads)
        options["alibi_slopes"] = slopes
        positions = torch.arange(L_K, dtype=torch.float64)
        distance = (positions - (L_K - 1)).abs()  # the query sits at the last key's position
        reference = {"bias": -(slopes.double()[:, None] * distance)[None, :, None, :]}
    if "lengths" in options:
        keys = torch.arange(L_K) < options["lengths"][:, None]  # (B, L_k)
        reference = {"mask": keys[:, None, None, :]}
    ours = qkv.attention(q, k, v, causal=True, **options)
    expected = sdpa_reference(q.double(), k.double(), v.double(), causal=True, **reference)
    torch.testing.assert_close(ours.double(), expected, rtol=0, atol=1e-5)
    assert "stacked as its K/V head's rows" in qkv.explain(q, k, v, causal=True, **options)
