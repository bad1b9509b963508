"""qkv's cross_entropy (fp32, 0 where nothing is labelled) against F.cross_entropy: same loss,
same gradients."""

import pytest
import torch
import torch.nn.functional as F

from qkv.models.gpt import next_token_loss
from qkv.models.losses import IGNORE_INDEX, cross_entropy, sequence_cross_entropy


def _case(N=37, V=11, seed=0, dtype=torch.float64):
    generator = torch.Generator().manual_seed(seed)
    logits = (3 * torch.randn(N, V, generator=generator)).to(dtype).requires_grad_()
    targets = torch.randint(0, V, (N,), generator=generator)
    targets[::4] = IGNORE_INDEX
    return logits, targets


@pytest.mark.parametrize("smoothing", [0.0, 0.1, 0.7])
def test_loss_and_gradient_equal_pytorch(smoothing):
    logits, targets = _case()
    expected = F.cross_entropy(
        logits, targets, ignore_index=IGNORE_INDEX, label_smoothing=smoothing
    )
    (expected_grad,) = torch.autograd.grad(2.5 * expected, logits)
    ours = cross_entropy(logits, targets, label_smoothing=smoothing)
    (grad,) = torch.autograd.grad(2.5 * ours, logits)  # an upstream gradient other than 1
    assert ours.dtype == torch.float32  # computed in fp32, as documented
    torch.testing.assert_close(ours, expected.float(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-5, atol=1e-7)
    assert grad[targets == IGNORE_INDEX].abs().max() == 0


def test_bf16_logits_get_an_fp32_loss_and_a_bf16_gradient():
    logits, targets = _case(dtype=torch.bfloat16)
    expected = F.cross_entropy(logits.float(), targets, ignore_index=IGNORE_INDEX)
    ours = cross_entropy(logits, targets)
    ours.backward()
    torch.testing.assert_close(ours, expected)
    assert logits.grad.dtype == torch.bfloat16


def test_no_labelled_target_gives_zero_not_nan():
    logits, _ = _case()
    targets = torch.full((logits.shape[0],), IGNORE_INDEX)
    assert torch.isnan(F.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX))
    loss = cross_entropy(logits, targets)
    loss.backward()
    assert loss.item() == 0 and logits.grad.abs().max() == 0


def test_model_losses_equal_pytorch_on_sequences():
    generator = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 6, 9, generator=generator, requires_grad=True)
    labels = torch.randint(0, 9, (2, 6), generator=generator)
    labels[1, :2] = IGNORE_INDEX
    shifted = torch.cat([labels[:, 1:], torch.full((2, 1), IGNORE_INDEX)], dim=1)
    expected = F.cross_entropy(logits.reshape(-1, 9), shifted.reshape(-1), ignore_index=-100)
    torch.testing.assert_close(next_token_loss(logits, labels), expected)
    smoothed = F.cross_entropy(
        logits.reshape(-1, 9), labels.reshape(-1), ignore_index=-100, label_smoothing=0.1
    )
    torch.testing.assert_close(
        sequence_cross_entropy(logits, labels, label_smoothing=0.1), smoothed
    )
