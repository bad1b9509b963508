"""One bf16/fp16 query on the CPU (a decoding step) runs through SDPA in fp32, where PyTorch's
CPU kernel is several times faster: the output must come back in the input dtype, at most twice
as far from the fp64 result as PyTorch's own low-precision call (qkv's low-precision rule), with
causal, windows, GQA and fully masked rows handled as everywhere else."""

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
