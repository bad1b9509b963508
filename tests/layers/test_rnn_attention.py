"""Additive (Bahdanau et al. 2015) and dot/general (Luong et al. 2015) attention against eager
float64 formulas written from the papers' equations, with qkv's mask convention."""

from __future__ import annotations

import math

import pytest
import torch

from qkv.layers import AdditiveAttention, DotAttention, GeneralAttention
from qkv.layers.rnn_attention import masked_softmax

B, L_Q, S, D_Q, C, A = 2, 3, 5, 4, 6, 7


def _inputs(query_dim: int = D_Q, memory_dim: int = C):
    torch.manual_seed(0)
    query = torch.randn(B, L_Q, query_dim, dtype=torch.float64)
    memory = torch.randn(B, S, memory_dim, dtype=torch.float64)
    mask = torch.ones(B, S, dtype=torch.bool)
    mask[1, 3:] = False  # the second source has 3 tokens
    return query, memory, mask


def _softmax_over_allowed(scores: list[float], allowed: list[bool]) -> list[float]:
    """exp(e_j) / sum of exp(e_k) over the allowed k; all zeros when none is allowed."""
    visible = [s for s, ok in zip(scores, allowed, strict=True) if ok]
    if not visible:
        return [0.0] * len(scores)
    top = max(visible)
    total = sum(math.exp(s - top) for s in visible)
    return [math.exp(s - top) / total if ok else 0.0 for s, ok in zip(scores, allowed, strict=True)]


def _eager(score, query, memory, mask):
    """Context and weights from a score function e(b, i, j), one number at a time."""
    context = torch.zeros(B, query.shape[1], memory.shape[2], dtype=torch.float64)
    weights = torch.zeros(B, query.shape[1], S, dtype=torch.float64)
    for b in range(B):
        for i in range(query.shape[1]):
            allowed = mask[b, i].tolist() if mask.dim() == 3 else mask[b].tolist()
            alpha = _softmax_over_allowed([score(b, i, j) for j in range(S)], allowed)
            weights[b, i] = torch.tensor(alpha, dtype=torch.float64)
            context[b, i] = sum(a * memory[b, j] for j, a in enumerate(alpha))
    return context, weights


def test_additive_attention_equals_bahdanau_formula():
    query, memory, mask = _inputs()
    module = AdditiveAttention(D_Q, C, A, dtype=torch.float64)
    W_a, U_a = module.query_proj.weight.detach(), module.memory_proj.weight.detach()
    v_a = module.score_proj.weight[0].detach()

    def score(b, i, j):  # e_ij = v_a^T tanh(W_a s_{i-1} + U_a h_j)
        return float(v_a @ torch.tanh(W_a @ query[b, i] + U_a @ memory[b, j]))

    context, weights = module(query, memory, mask=mask)
    expected_context, expected_weights = _eager(score, query, memory, mask)
    torch.testing.assert_close(weights, expected_weights, rtol=0, atol=1e-12)
    torch.testing.assert_close(context, expected_context, rtol=0, atol=1e-12)
    assert weights[1, :, 3:].abs().max() == 0  # masked annotations get no weight


def test_additive_one_step_and_precomputed_memory_give_the_same_result():
    query, memory, mask = _inputs()
    module = AdditiveAttention(D_Q, C, A, dtype=torch.float64)
    full_context, full_weights = module(query, memory, mask=mask)
    projected = module.project_memory(memory)
    context, weights = module(query[:, 1], memory, mask=mask, projected_memory=projected)
    torch.testing.assert_close(context, full_context[:, 1], rtol=0, atol=1e-12)
    torch.testing.assert_close(weights, full_weights[:, 1], rtol=0, atol=1e-12)


def test_dot_attention_equals_luong_formula():
    query, memory, mask = _inputs(query_dim=C)
    per_query = mask[:, None].repeat(1, L_Q, 1)
    per_query[0, 2, :] = False  # a query that sees nothing
    context, weights = DotAttention()(query, memory, mask=per_query)
    expected = _eager(lambda b, i, j: float(query[b, i] @ memory[b, j]), query, memory, per_query)
    torch.testing.assert_close(weights, expected[1], rtol=0, atol=1e-12)
    torch.testing.assert_close(context, expected[0], rtol=0, atol=1e-12)
    assert context[0, 2].abs().max() == 0 and weights[0, 2].abs().max() == 0


def test_general_attention_equals_luong_formula():
    query, memory, mask = _inputs()
    module = GeneralAttention(D_Q, C, dtype=torch.float64)
    W_a = module.memory_proj.weight.detach()  # (D_q, C): score = h_t^T W_a h_s

    context, weights = module(query, memory, mask=mask)
    expected = _eager(lambda b, i, j: float(query[b, i] @ W_a @ memory[b, j]), query, memory, mask)
    torch.testing.assert_close(weights, expected[1], rtol=0, atol=1e-12)
    torch.testing.assert_close(context, expected[0], rtol=0, atol=1e-12)


@pytest.mark.parametrize("kind", ["additive", "dot", "general"])
def test_fully_masked_rows_give_zeros_and_finite_gradients(kind):
    query, memory, _ = _inputs(query_dim=C)
    query.requires_grad_(True)
    module = {
        "additive": AdditiveAttention(C, C, A, dtype=torch.float64),
        "dot": DotAttention(),
        "general": GeneralAttention(C, C, dtype=torch.float64),
    }[kind]
    mask = torch.zeros(B, S, dtype=torch.bool)
    mask[0] = True
    context, weights = module(query, memory, mask=mask)
    assert not torch.isnan(context).any() and context[1].abs().max() == 0
    torch.testing.assert_close(weights[0].sum(-1), torch.ones(L_Q, dtype=torch.float64))
    (grad,) = torch.autograd.grad(context.sum(), query)
    assert torch.isfinite(grad).all() and grad[1].abs().max() == 0


def test_masked_softmax_equals_torch_softmax_over_the_allowed_entries():
    torch.manual_seed(2)
    scores = torch.randn(2, 3, 4, dtype=torch.float16)
    mask = torch.tensor([[True, True, False, True], [False] * 4])[:, None]  # (2, 1, 4)
    weights = masked_softmax(scores, mask)
    assert weights.dtype == torch.float16
    expected = torch.softmax(scores[0, :, [0, 1, 3]].double(), dim=-1)
    torch.testing.assert_close(weights[0][:, [0, 1, 3]].double(), expected, rtol=0, atol=1e-3)
    assert weights[0, :, 2].abs().max() == 0 and weights[1].abs().max() == 0


def test_bad_inputs_name_the_argument():
    query, memory, mask = _inputs()
    module = AdditiveAttention(D_Q, C, A, dtype=torch.float64)
    with pytest.raises(TypeError, match="mask: expected a bool tensor"):
        module(query, memory, mask=mask.long())
    with pytest.raises(ValueError, match="mask: expected shape"):
        module(query, memory, mask=mask[:, :2])
    with pytest.raises(ValueError, match="query: expected"):
        module(query[..., :2], memory)
    with pytest.raises(ValueError, match="memory: expected"):
        module(query, memory[..., :2])
    with pytest.raises(ValueError, match="query: expected"):
        DotAttention()(query, memory)  # D_q != C: dot needs one width
