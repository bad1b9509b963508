"""Relative positions in the Triton kernels: an `OffsetBias` (T5's bucketed bias, Shaw et al.'s
relative keys) read per tile, against float64 eager attention with the dense bias, for the
output, the log-sum-exp and every gradient, the bias's own parameters included. On a GPU when
there is one, else in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1)."""

import copy
import os

import pytest
import torch

import qkv
from qkv.attention import OffsetBias
from qkv.positional import ShawRelativeKeys, T5RelativeBias
from tests.attention.reference_math import eager_reference

DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"


def _inputs(B=2, H=4, H_kv=2, L_q=19, L_k=37, D=16):
    torch.manual_seed(0)
    return [
        torch.randn(B, heads, L, D, device=DEVICE, requires_grad=True)
        for heads, L in ((H, L_q), (H_kv, L_k), (H_kv, L_k))
    ]


def _exact(tensors):
    return [t.detach().cpu().double().requires_grad_() for t in tensors]


def _check_grads(ours, theirs, atol=2e-4):
    for got, want in zip(ours, theirs, strict=True):
        torch.testing.assert_close(got.cpu().double(), want, atol=atol, rtol=atol)


@pytest.mark.parametrize(
    "options",
    [
        {"bidirectional": True},
        {"bidirectional": False, "causal": True},
        {"bidirectional": True, "window": (6, 4), "lengths": torch.tensor([37, 20])},
    ],
)
def test_t5_bias_per_tile_equals_the_dense_bias_with_the_tables_gradient(options):
    options = dict(options)
    bidirectional = options.pop("bidirectional")
    # 8 buckets up to distance 12: offsets of up to 36 reach the clipped, shared last bucket
    module = T5RelativeBias(4, bidirectional=bidirectional, num_buckets=8, max_distance=12)
    with torch.no_grad():
        module.relative_attention_bias.weight.normal_(0, 1.0)
    module = module.to(DEVICE)
    exact_module = copy.deepcopy(module).cpu().double()
    q, k, v = _inputs()
    output, lse = qkv.triton_attention(
        q, k, v, offset_bias=module.score_mod(19, 37), return_lse=True, **options
    )
    exact = _exact((q, k, v))
    expected, expected_lse = eager_reference(*exact, bias=exact_module(19, 37), **options)
    torch.testing.assert_close(output.cpu().double(), expected, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(lse.cpu().double(), expected_lse, atol=2e-5, rtol=2e-5)
    grad = torch.randn_like(expected)
    table, exact_table = (m.relative_attention_bias.weight for m in (module, exact_module))
    ours = torch.autograd.grad(output, (q, k, v, table), grad.float().to(DEVICE))
    theirs = torch.autograd.grad(expected, (*exact, exact_table), grad)
    _check_grads(ours, theirs)


def test_shaw_relative_keys_per_tile_equal_the_dense_bias_with_gradients_to_q_and_the_keys():
    module = ShawRelativeKeys(16, max_distance=5).to(DEVICE)
    with torch.no_grad():
        module.relative_keys.normal_(0, 1.0)
    exact_module = copy.deepcopy(module).cpu().double()
    q, k, v = _inputs(H=4, H_kv=1, L_q=37, L_k=37)
    output = qkv.triton_attention(q, k, v, causal=True, offset_bias=module.score_mod(q, 37))
    exact = _exact((q, k, v))
    expected, _ = eager_reference(*exact, causal=True, bias=exact_module(exact[0], 37))
    torch.testing.assert_close(output.cpu().double(), expected, atol=2e-5, rtol=2e-5)
    grad = torch.randn_like(expected)
    ours = torch.autograd.grad(output, (q, k, v, module.relative_keys), grad.float().to(DEVICE))
    theirs = torch.autograd.grad(expected, (*exact, exact_module.relative_keys), grad)
    _check_grads(ours, theirs)


def test_qkv_attention_hands_an_offset_bias_to_the_kernels_and_refuses_other_score_mods():
    module = T5RelativeBias(4, bidirectional=True, num_buckets=8, max_distance=12).to(DEVICE)
    q, k, v = (t.detach() for t in _inputs())
    score_mod = module.score_mod(19, 37)
    expected = qkv.attention(q, k, v, bias=module(19, 37), backend="reference")
    output = qkv.attention(q, k, v, score_mod=score_mod, backend="triton")
    torch.testing.assert_close(output, expected.detach(), atol=2e-5, rtol=2e-5)
    assert "offset bias is read per tile" in qkv.explain(q, k, v, score_mod=score_mod,
                                                         backend="triton")  # fmt: skip
    with pytest.raises(ValueError, match="score_mod only as a qkv.attention.OffsetBias"):
        qkv.attention(q, k, v, score_mod=lambda s, b, h, i, j: s, backend="triton")


def test_an_offset_bias_made_for_another_shape_is_refused_by_name():
    q, k, v = (t.detach() for t in _inputs())
    table = torch.zeros(1, 3, 1, 9, device=DEVICE)
    with pytest.raises(ValueError, match="do not broadcast over H = 4"):
        qkv.triton_attention(q, k, v, offset_bias=OffsetBias(table, 4, 18))
    with pytest.raises(ValueError, match="made for shift 0, but this call has L_k - L_q = 18"):
        qkv.triton_attention(q, k, v, offset_bias=OffsetBias(table[:, :1], 4, 0))
    with pytest.raises(
        ValueError, match=r"values: expected a last dimension of .* = 7, got shape \(1, 3, 1, 9\)"
    ):
        OffsetBias(table, 3, 18)
    with pytest.raises(TypeError, match="offset_bias: expected a qkv.attention.OffsetBias"):
        qkv.triton_attention(q, k, v, offset_bias=table)
