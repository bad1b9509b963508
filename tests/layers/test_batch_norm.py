"""BatchNorm over token features against `nn.BatchNorm1d`: on the (B * L, E) matrix without
padding, on the real tokens alone with padding; outputs, gradients, running statistics and
eval mode; and the padding's effect on the unmasked statistics, against a float64 formula."""

import pytest
import torch
from torch import nn

from qkv.layers import BatchNorm

B, L, E = 3, 7, 10
LENGTHS = torch.tensor([7, 4, 2])  # (B,): row b has LENGTHS[b] real tokens, then padding


def _x(dtype=torch.float32, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(B, L, E, generator=generator, dtype=torch.float64) * 2 + 1).to(dtype)


def _pair(*, momentum=0.1, seed=1):
    """A qkv BatchNorm and an nn.BatchNorm1d with the same random affine parameters."""
    ours, reference = BatchNorm(E, momentum=momentum), nn.BatchNorm1d(E, momentum=momentum)
    generator = torch.Generator().manual_seed(seed)
    weight, bias = (
        1 + 0.3 * torch.randn(E, generator=generator),
        0.3 * torch.randn(E, generator=generator),
    )
    with torch.no_grad():
        for module in (ours, reference):
            module.weight.copy_(weight)
            module.bias.copy_(bias)
    return ours, reference


def _real(lengths=LENGTHS):
    return torch.arange(L) < lengths[:, None]  # (B, L), True on real tokens


def test_without_padding_equals_batchnorm1d_on_all_positions_with_gradients():
    ours, reference = _pair()
    x = _x().requires_grad_()
    x_ref = x.detach().clone().requires_grad_()
    out, expected = ours(x), reference(x_ref.reshape(B * L, E)).view(B, L, E)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    grad = torch.randn(B, L, E, generator=torch.Generator().manual_seed(3))
    out.backward(grad)
    expected.backward(grad)
    torch.testing.assert_close(x.grad, x_ref.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours.weight.grad, reference.weight.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours.bias.grad, reference.bias.grad, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("by", ["mask", "lengths"])
def test_with_padding_equals_batchnorm1d_on_the_real_tokens(by):
    ours, reference = _pair()
    x = _x().requires_grad_()
    real = _real()
    x_ref = x.detach()[real].clone().requires_grad_()  # (N, E): the real tokens only
    out = ours(x, **({"mask": real} if by == "mask" else {"lengths": LENGTHS}))
    expected = reference(x_ref)
    torch.testing.assert_close(out[real], expected, atol=1e-5, rtol=1e-5)
    grad = torch.randn(x_ref.shape, generator=torch.Generator().manual_seed(4))
    out[real].backward(grad)
    expected.backward(grad)
    torch.testing.assert_close(x.grad[real], x_ref.grad, atol=1e-5, rtol=1e-5)
    assert (x.grad[~real] == 0).all()  # the padding does not reach the loss through statistics
    torch.testing.assert_close(ours.running_mean, reference.running_mean, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(ours.running_var, reference.running_var, atol=1e-6, rtol=1e-6)


def test_running_statistics_and_eval_mode_follow_batchnorm1d():
    ours, reference = _pair(momentum=0.3)
    real = _real()
    for seed in range(3):
        x = _x(seed=seed)
        ours(x, mask=real)
        reference(x[real])
    torch.testing.assert_close(ours.running_mean, reference.running_mean, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(ours.running_var, reference.running_var, atol=1e-6, rtol=1e-6)
    ours.eval(), reference.eval()
    x = _x(seed=9)
    expected = reference(x.reshape(B * L, E)).view(B, L, E)
    torch.testing.assert_close(ours(x), expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours(x, mask=real), expected, atol=1e-5, rtol=1e-5)  # no stats


def test_without_running_statistics_eval_uses_the_batch_like_batchnorm1d():
    ours = BatchNorm(E, affine=False, track_running_stats=False).eval()
    reference = nn.BatchNorm1d(E, affine=False, track_running_stats=False).eval()
    x = _x(seed=5)
    torch.testing.assert_close(ours(x, mask=_real())[_real()], reference(x[_real()]))
    assert ours.running_mean is None and ours.weight is None


def test_unmasked_statistics_include_the_padding_float64_formula():
    # What padding does: the pad positions (here all equal to one pad vector) enter mu and sigma
    x = _x(torch.float64)
    pad = torch.linspace(-1, 1, E, dtype=torch.float64)
    x[~_real()] = pad
    flat = x.reshape(B * L, E)
    mu, var = flat.mean(0), ((flat - flat.mean(0)) ** 2).mean(0)  # Ioffe & Szegedy, Algorithm 1
    expected = (x - mu) / torch.sqrt(var + 1e-5)
    norm = BatchNorm(E, affine=False, dtype=torch.float64)
    torch.testing.assert_close(norm(x), expected, atol=1e-12, rtol=1e-12)
    masked = norm(x, mask=_real())
    assert (masked[_real()] - norm(x)[_real()]).abs().max() > 0.1


def test_masked_output_ignores_the_padding_and_bf16_stays_close():
    norm = BatchNorm(E)
    x = _x()
    y = x.clone()
    y[~_real()] = 1e3  # different padding content, the same real tokens
    torch.testing.assert_close(norm(x, mask=_real())[_real()], norm(y, mask=_real())[_real()])
    low = norm(x.bfloat16(), mask=_real())
    assert low.dtype == torch.bfloat16
    reference = norm(x.bfloat16().float(), mask=_real())
    assert (low.float() - reference)[_real()].abs().max() < 0.05  # one bf16 rounding


def test_bad_arguments_name_themselves():
    norm = BatchNorm(E)
    with pytest.raises(ValueError, match="x: expected shape"):
        norm(torch.zeros(B, E))
    with pytest.raises(ValueError, match="mask: expected shape"):
        norm(_x(), mask=torch.ones(B, L + 1, dtype=torch.bool))
    with pytest.raises(TypeError, match="mask: expected a bool tensor"):
        norm(_x(), mask=torch.ones(B, L))
    with pytest.raises(ValueError, match="either mask or lengths"):
        norm(_x(), mask=_real(), lengths=LENGTHS)
    with pytest.raises(ValueError, match="at least 2 real tokens"):
        norm(_x(), lengths=torch.tensor([1, 0, 0]))
    with pytest.raises(ValueError, match="momentum"):
        BatchNorm(E, momentum=1.5)
    with pytest.raises(TypeError, match="affine"):
        BatchNorm(E, affine=1)
