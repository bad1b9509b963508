"""The NumPy lab against PyTorch in float64: scaled dot-product attention against
F.scaled_dot_product_attention, multi-head attention against nn.MultiheadAttention with the same
weights, and every hand-written gradient against torch autograd."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from qkv.analysis.numpy_lab import (
    MultiHeadWeights,
    attention_backward,
    attention_forward,
    multi_head_backward,
    multi_head_forward,
)
from qkv.attention import attention

TOLERANCE = {"rtol": 1e-10, "atol": 1e-12}


def _arrays(*shapes: tuple[int, ...], seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(shape) for shape in shapes]


def _torch_attention_gradients(q, k, v, d_out, mask, scale=None):
    """Output and dq, dk, dv by autograd through F.scaled_dot_product_attention."""
    tensors = [torch.tensor(array, requires_grad=True) for array in (q, k, v)]
    torch_mask = None if mask is None else torch.from_numpy(mask)
    out = F.scaled_dot_product_attention(*tensors, attn_mask=torch_mask, scale=scale)
    out.backward(torch.from_numpy(d_out))
    return out.detach().numpy(), [tensor.grad.numpy() for tensor in tensors]


@pytest.mark.parametrize(
    "shape, mask_kind, scale",
    [((2, 3, 5, 4), None, None), ((1, 2, 6, 8), "causal", None), ((2, 1, 4, 3), "random", 0.7)],
)
def test_attention_forward_and_backward_equal_torch(shape, mask_kind, scale):
    B, H, L, D = shape
    q, k, v, d_out = _arrays(shape, shape, shape, shape, seed=L)
    mask = None
    if mask_kind == "causal":
        mask = np.tril(np.ones((L, L), dtype=bool))  # (L, L): True = may attend
    elif mask_kind == "random":
        mask = np.random.default_rng(1).random((B, 1, L, L)) < 0.6
        mask[..., 0] = True  # every query sees a key (fully masked rows are tested below)
    out, weights = attention_forward(q, k, v, mask=mask, scale=scale)
    grads = attention_backward(d_out, q, k, v, weights, scale=scale)
    expected_out, (dq, dk, dv) = _torch_attention_gradients(q, k, v, d_out, mask, scale)
    np.testing.assert_allclose(out, expected_out, **TOLERANCE)
    np.testing.assert_allclose(grads.q, dq, **TOLERANCE)
    np.testing.assert_allclose(grads.k, dk, **TOLERANCE)
    np.testing.assert_allclose(grads.v, dv, **TOLERANCE)


def test_cross_attention_lengths_and_value_width():
    q, k, v, d_out = _arrays((2, 3, 4), (2, 7, 4), (2, 7, 6), (2, 3, 6), seed=3)
    out, weights = attention_forward(q, k, v)
    grads = attention_backward(d_out, q, k, v, weights)
    expected_out, (dq, dk, dv) = _torch_attention_gradients(q, k, v, d_out, None)
    assert out.shape == (2, 3, 6) and weights.shape == (2, 3, 7)
    np.testing.assert_allclose(out, expected_out, **TOLERANCE)
    for got, expected in zip((grads.q, grads.k, grads.v), (dq, dk, dv), strict=True):
        np.testing.assert_allclose(got, expected, **TOLERANCE)


def test_fully_masked_row_gives_zero_output_and_zero_gradients_like_qkv_attention():
    shape = (1, 2, 4, 3)
    q, k, v, d_out = _arrays(shape, shape, shape, shape, seed=4)
    mask = np.ones((4, 4), dtype=bool)
    mask[2] = False  # query 2 sees nothing
    out, weights = attention_forward(q, k, v, mask=mask)
    grads = attention_backward(d_out, q, k, v, weights)
    assert np.isfinite(out).all() and not out[:, :, 2].any()
    assert not grads.q[:, :, 2].any()
    tensors = [torch.tensor(array, requires_grad=True) for array in (q, k, v)]
    reference = attention(*tensors, mask=torch.from_numpy(mask), backend="reference")
    reference.backward(torch.from_numpy(d_out))
    np.testing.assert_allclose(out, reference.detach().numpy(), **TOLERANCE)
    for got, tensor in zip((grads.q, grads.k, grads.v), tensors, strict=True):
        np.testing.assert_allclose(got, tensor.grad.numpy(), **TOLERANCE)


def _torch_mha(E: int, H: int, seed: int, *, kdim: int | None = None) -> nn.MultiheadAttention:
    torch.manual_seed(seed)
    mha = nn.MultiheadAttention(E, H, batch_first=True, kdim=kdim, vdim=kdim, dtype=torch.float64)
    for parameter in mha.parameters():  # nn.MultiheadAttention starts its biases at 0
        nn.init.normal_(parameter, std=0.3)
    return mha


def _lab_weights(mha: nn.MultiheadAttention) -> MultiHeadWeights:
    E = mha.embed_dim
    if mha._qkv_same_embed_dim:
        q_weight, k_weight, v_weight = mha.in_proj_weight.detach().numpy().reshape(3, E, E)
    else:
        q_weight, k_weight, v_weight = (
            weight.detach().numpy()
            for weight in (mha.q_proj_weight, mha.k_proj_weight, mha.v_proj_weight)
        )
    q_bias, k_bias, v_bias = mha.in_proj_bias.detach().numpy().reshape(3, E)
    return MultiHeadWeights(
        q_weight=q_weight, q_bias=q_bias, k_weight=k_weight, k_bias=k_bias, v_weight=v_weight,
        v_bias=v_bias, out_weight=mha.out_proj.weight.detach().numpy(),
        out_bias=mha.out_proj.bias.detach().numpy(),
    )  # fmt: skip


def _torch_weight_gradients(mha: nn.MultiheadAttention) -> dict[str, np.ndarray]:
    E = mha.embed_dim
    if mha._qkv_same_embed_dim:
        weights = mha.in_proj_weight.grad.numpy().reshape(3, E, E)
    else:
        weights = [
            w.grad.numpy() for w in (mha.q_proj_weight, mha.k_proj_weight, mha.v_proj_weight)
        ]
    biases = mha.in_proj_bias.grad.numpy().reshape(3, E)
    return {
        "q_weight": weights[0], "k_weight": weights[1], "v_weight": weights[2],
        "q_bias": biases[0], "k_bias": biases[1], "v_bias": biases[2],
        "out_weight": mha.out_proj.weight.grad.numpy(), "out_bias": mha.out_proj.bias.grad.numpy(),
    }  # fmt: skip


@pytest.mark.parametrize("masked", [False, True])
def test_self_attention_equals_nn_multihead_attention_and_its_gradients(masked):
    B, L, E, H = 2, 5, 12, 3
    mha = _torch_mha(E, H, seed=0)
    x, d_out = _arrays((B, L, E), (B, L, E), seed=5)
    mask = np.tril(np.ones((L, L), dtype=bool)) if masked else None
    out, cache = multi_head_forward(x, weights=_lab_weights(mha), num_heads=H, mask=mask)
    grads = multi_head_backward(d_out, cache)

    x_torch = torch.tensor(x, requires_grad=True)
    blocked = None if mask is None else torch.from_numpy(~mask)  # PyTorch's True = blocked
    expected, _ = mha(x_torch, x_torch, x_torch, attn_mask=blocked, need_weights=False)
    expected.backward(torch.from_numpy(d_out))
    np.testing.assert_allclose(out, expected.detach().numpy(), **TOLERANCE)
    np.testing.assert_allclose(grads.x + grads.context, x_torch.grad.numpy(), **TOLERANCE)
    for name, expected_grad in _torch_weight_gradients(mha).items():
        np.testing.assert_allclose(getattr(grads.weights, name), expected_grad, **TOLERANCE)


def test_cross_attention_with_key_padding_equals_nn_multihead_attention():
    B, L_q, L_k, E, E_kv, H = 2, 3, 6, 8, 5, 2
    mha = _torch_mha(E, H, seed=1, kdim=E_kv)
    x, context, d_out = _arrays((B, L_q, E), (B, L_k, E_kv), (B, L_q, E), seed=6)
    lengths = np.array([6, 4])
    visible = np.arange(L_k)[None, :] < lengths[:, None]  # (B, L_k): True = a real token
    out, cache = multi_head_forward(
        x, context, weights=_lab_weights(mha), num_heads=H, mask=visible[:, None, None, :]
    )
    grads = multi_head_backward(d_out, cache)

    x_torch, context_torch = (torch.tensor(a, requires_grad=True) for a in (x, context))
    expected, _ = mha(x_torch, context_torch, context_torch,
                      key_padding_mask=torch.from_numpy(~visible), need_weights=False)  # fmt: skip
    expected.backward(torch.from_numpy(d_out))
    np.testing.assert_allclose(out, expected.detach().numpy(), **TOLERANCE)
    np.testing.assert_allclose(grads.x, x_torch.grad.numpy(), **TOLERANCE)
    np.testing.assert_allclose(grads.context, context_torch.grad.numpy(), **TOLERANCE)
    assert not grads.context[1, 4:].any()  # padding gets no gradient
    for name, expected_grad in _torch_weight_gradients(mha).items():
        np.testing.assert_allclose(getattr(grads.weights, name), expected_grad, **TOLERANCE)


def test_bad_inputs_name_the_argument():
    q, k = _arrays((2, 4, 3), (2, 5, 3))
    with pytest.raises(ValueError, match="v"):
        attention_forward(q, k, k[:, :2])
    with pytest.raises(ValueError, match="mask"):
        attention_forward(q, k, k, mask=np.ones((3, 3), dtype=bool))
    with pytest.raises(ValueError, match="mask"):
        attention_forward(q, k, k, mask=np.ones((4, 5)))
    with pytest.raises(ValueError, match="scale"):
        attention_forward(q, k, k, scale=-1.0)
    mha = _torch_mha(6, 2, seed=0)
    x = _arrays((1, 3, 6))[0]
    with pytest.raises(ValueError, match="num_heads"):
        multi_head_forward(x, weights=_lab_weights(mha), num_heads=4)
    with pytest.raises(ValueError, match="weights.k_weight"):
        multi_head_forward(x, x[..., :4], weights=_lab_weights(mha), num_heads=2)


def test_float32_inputs_stay_float32_and_match_torch_float32():
    q, k, v, d_out = (a.astype(np.float32) for a in _arrays(*[(2, 2, 6, 8)] * 4, seed=7))
    out, weights = attention_forward(q, k, v)
    grads = attention_backward(d_out, q, k, v, weights)
    assert out.dtype == weights.dtype == grads.q.dtype == grads.k.dtype == np.float32
    expected_out, (dq, _, _) = _torch_attention_gradients(q, k, v, d_out, None)
    np.testing.assert_allclose(out, expected_out, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(grads.q, dq, rtol=1e-4, atol=1e-5)
